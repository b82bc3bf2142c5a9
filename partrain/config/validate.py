"""Check a composed RunConfig against every layout rule before any process or file exists.

`validate(run)` returns a `ValidatedRun` (resolved degrees, rank layout, model facts, batch
arithmetic) or raises ConfigError listing every problem, each with key, value, rule and a fix.
The rules are those of brief section 5; model facts come from the HF config class (see
`partrain.models.facts`), so nothing is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

from ..errors import ConfigError, Problem
from ..layout import Layout, divisors, factorizations, resolve_degrees
from ..models.facts import ModelFacts, model_facts
from .schema import AXES, BACKENDS, DEVICES, FSDP_GRAD_SYNC, PP_SCHEDULES, PRECISIONS, RECOMPUTE, SP_MODES, RunConfig

INTERLEAVED = ("interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble")
V_SHAPED = ("zbv", "dualpipev")
BYTE_VOCAB = 256
MAX_WORLD = 1 << 18
"""Largest world size partrain lays out (the dry run lists every rank; beyond this it would take minutes)."""


@dataclass(frozen=True)
class ValidatedRun:
    """A run whose layout is known to be consistent: what the dry run prints and the runtime builds."""

    run: RunConfig
    layout: Layout
    facts: ModelFacts
    global_batch_size: int
    microbatches: int
    """Microbatches per optimizer step on one data-parallel rank."""

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.run.train.seq_len


class _Collector:
    def __init__(self) -> None:
        self.problems: List[Problem] = []

    def add(self, key: str, value, rule: str, fix: str = "") -> None:
        self.problems.append(Problem(key, value, rule, fix))

    def check(self, ok: bool, key: str, value, rule: str, fix: str = "") -> bool:
        if not ok:
            self.add(key, value, rule, fix)
        return ok


def _check_choices(c: _Collector, run: RunConfig) -> None:
    p, t, cl = run.parallel, run.train, run.cluster
    choices = [
        ("parallel.pp_schedule", p.pp_schedule, PP_SCHEDULES),
        ("parallel.sp_mode", p.sp_mode, SP_MODES),
        ("parallel.recompute", p.recompute, RECOMPUTE),
        ("parallel.fsdp_grad_sync", p.fsdp_grad_sync, FSDP_GRAD_SYNC),
        ("train.precision", t.precision, PRECISIONS),
        ("cluster.device", cl.device, DEVICES),
        ("cluster.backend", cl.backend, BACKENDS),
        ("optim.name", run.optim.name, ("adamw",)),
    ]
    for key, value, allowed in choices:
        c.check(value in allowed, key, value, f"must be one of {', '.join(allowed)}", f"set {key}={allowed[0]}")
    c.check(p.zero_stage in (0, 1, 2, 3), "parallel.zero_stage", p.zero_stage, "must be 0, 1, 2 or 3",
            "0 = DDP, 1 = sharded optimizer, 2/3 = FSDP")
    c.check(sorted(p.order) == sorted(AXES), "parallel.order", list(p.order), f"must list each of {', '.join(AXES)} once",
            f"e.g. parallel.order=[{','.join(AXES)}]")
    if cl.backend == "nccl":
        c.check(cl.device == "cuda", "cluster.backend", cl.backend, "nccl needs cluster.device=cuda", "use backend gloo on CPU")


def _check_ranges(c: _Collector, run: RunConfig) -> None:
    t, o, ck, d, p, cl = run.train, run.optim, run.checkpoint, run.data, run.parallel, run.cluster
    at_least = [
        ("cluster.nodes", cl.nodes, 1), ("cluster.devices_per_node", cl.devices_per_node, 1),
        ("train.seq_len", t.seq_len, 1), ("train.micro_batch_size", t.micro_batch_size, 1), ("train.steps", t.steps, 1),
        ("train.global_batch_size", t.global_batch_size, 0), ("train.microbatches", t.microbatches, 0),
        ("train.eval_every", t.eval_every, 0), ("train.eval_batches", t.eval_batches, 0), ("train.log_every", t.log_every, 1),
        ("train.threads_per_process", t.threads_per_process, 0), ("train.max_restarts", t.max_restarts, 0),
        ("train.timeout_s", t.timeout_s, 1), ("checkpoint.every_steps", ck.every_steps, 0), ("checkpoint.keep_last", ck.keep_last, 0),
        ("optim.warmup_steps", o.warmup_steps, 0), ("parallel.pp_virtual_stages", p.pp_virtual_stages, 1),
        ("parallel.recompute_every", p.recompute_every, 1), ("data.max_bytes", d.max_bytes, 0),
        ("train.loss_scale_window", t.loss_scale_window, 1),
    ]
    for key, value, low in at_least:
        c.check(value >= low, key, value, f"must be >= {low}", f"set {key} to {low} or more")
    c.check(o.lr > 0, "optim.lr", o.lr, "must be > 0", "e.g. optim.lr=3e-4")
    c.check(1 <= t.loss_scale_init <= 2.0 ** 64, "train.loss_scale_init", t.loss_scale_init,
            "must be within [1, 2**64] (a loss multiplier for fp16)", "e.g. train.loss_scale_init=65536")
    c.check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio, "must be within [0, 1]", "e.g. 0.1")
    for key, value in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        c.check(0 <= value < 1, key, value, "must be within [0, 1)", "e.g. 0.9 / 0.95")
    c.check(o.eps > 0, "optim.eps", o.eps, "must be > 0", "e.g. 1e-8")
    c.check(o.grad_clip >= 0, "optim.grad_clip", o.grad_clip, "must be >= 0 (0 = off)", "e.g. 1.0")
    c.check(o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "must be >= 0", "e.g. 0.1")
    c.check(0 < d.eval_fraction < 1, "data.eval_fraction", d.eval_fraction, "must be within (0, 1)", "e.g. 0.02")
    resume = ck.resume
    if resume not in ("none", "auto"):
        c.check(Path(resume).expanduser().exists(), "checkpoint.resume", resume, "is neither none, auto nor an existing checkpoint path",
                "use checkpoint.resume=auto to pick the newest complete checkpoint")


def _comm_profile_problems(c: _Collector, run: RunConfig) -> None:
    """cluster.comm_profile must be a readable profile of this partrain's format, measured with the
    cluster's backend on its device type: a gloo/CPU profile would make a GPU plan wrong by orders
    of magnitude, so a mismatch is an error, not a warning. Other differences (node count, cluster
    name) are allowed: measuring a few nodes to plan many is the point."""
    path = run.cluster.comm_profile
    if not path:
        return
    from ..bench.profile import ProfileError, load_profile, mismatch

    fix = "run `partrain bench comm` with this cluster to write one (then cluster.comm_profile=FILE), or unset cluster.comm_profile"
    try:
        profile = load_profile(path)
    except ProfileError as exc:
        c.add("cluster.comm_profile", path, str(exc), fix)
        return
    why = mismatch(profile, run.cluster.backend, run.cluster.device)
    if why:
        c.add("cluster.comm_profile", path, why, fix)


def _data_problems(c: _Collector, run: RunConfig, facts: Optional[ModelFacts]) -> None:
    d = run.data
    if d.source != "builtin":
        c.check(Path(d.source).expanduser().exists(), "data.source", d.source, "no such file or folder",
                "use data.source=builtin or a local text/jsonl/parquet path")
    if d.tokenizer == "byte":
        if facts is not None:
            vocab_key = "model.config.vocab_size"
            c.check(facts.vocab >= BYTE_VOCAB, vocab_key, facts.vocab, f"the byte tokenizer needs a vocabulary of at least {BYTE_VOCAB}",
                    f"set {vocab_key}={BYTE_VOCAB}")
    else:
        folder = Path(d.tokenizer).expanduser()
        c.check(folder.is_dir(), "data.tokenizer", d.tokenizer, "neither 'byte' nor a local tokenizer folder",
                "use data.tokenizer=byte or a folder written by tokenizer.save_pretrained")


def _degree_problems(c: _Collector, run: RunConfig, facts: Optional[ModelFacts]) -> Optional[Dict[str, int]]:
    """Check the world-size axes; return resolved degrees (dp, tp, pp, sp) or None."""
    p, cl = run.parallel, run.cluster
    world = cl.nodes * cl.devices_per_node
    if world > MAX_WORLD:
        key, value = ("cluster.devices_per_node", cl.devices_per_node) if cl.devices_per_node > MAX_WORLD else ("cluster.nodes", cl.nodes)
        c.add(key, value, f"the world size nodes x devices_per_node = {world} exceeds the {MAX_WORLD} ranks partrain lays out",
              "plan a smaller cluster")
        return None
    given = {a: getattr(p, a) for a in AXES}
    ok = True
    for axis, value in given.items():
        ok &= c.check(value >= 1 or value == -1, f"parallel.{axis}", value, "must be a positive integer or -1 (= the rest)",
                      f"set parallel.{axis}=1")
    if not ok:
        return None
    free = [a for a in AXES if given[a] == -1]
    if len(free) > 1:
        c.add(f"parallel.{free[1]}", -1, f"only one degree may be -1, but {', '.join('parallel.' + a for a in free)} are",
              f"give parallel.{free[1]} a number")
        return None
    known = math.prod(v for v in given.values() if v != -1)
    if free:
        if world % known:
            c.add(f"parallel.{free[0]}", -1,
                  f"the other degrees multiply to {known}, which does not divide the world size {world} "
                  f"(cluster.nodes={cl.nodes} x cluster.devices_per_node={cl.devices_per_node})",
                  _nearest_degrees_hint(run, world, facts))
            return None
        return resolve_degrees(given, world)
    if known != world:
        product = " x ".join(f"parallel.{a}={given[a]}" for a in AXES)
        c.add("parallel", {a: given[a] for a in ("dp", "tp", "pp", "sp")},
              f"the degrees multiply to {known} ({product}) but the world size is {world} "
              f"(cluster.nodes={cl.nodes} x cluster.devices_per_node={cl.devices_per_node})",
              _nearest_degrees_hint(run, world, facts) + f"; or run on {known} devices (cluster.devices_per_node={known // cl.nodes})"
              if known % cl.nodes == 0 else _nearest_degrees_hint(run, world, facts))
        return None
    return dict(given)


def _tp_ok(facts: Optional[ModelFacts], tp: int) -> bool:
    if facts is None:
        return True
    widths = [facts.heads, facts.kv_heads, facts.ffn, facts.vocab] + ([facts.shared_expert_ffn] if facts.shared_expert_ffn else [])
    return all(w % tp == 0 for w in widths)


def _sp_ok(run: RunConfig, facts: Optional[ModelFacts], tp: int, sp: int) -> bool:
    seq = run.train.seq_len
    if seq % (2 * sp if run.parallel.sp_mode == "ring" and sp > 1 else sp):
        return False
    if facts is not None and run.parallel.sp_mode == "ulysses":
        return facts.heads % (tp * sp) == 0
    return True


def _nearest_degrees_hint(run: RunConfig, world: int, facts: Optional[ModelFacts] = None) -> str:
    """The few valid (tp, sp, dp, pp) closest to what the user asked for, as a fix."""
    p, cl = run.parallel, run.cluster
    want = {a: max(getattr(p, a), 1) for a in AXES}
    if world > 1 << 16:
        return "choose degrees whose product is the world size"

    def valid(d: Dict[str, int]) -> bool:
        if facts is not None and (d["pp"] * p.pp_virtual_stages > facts.n_layers or not _tp_ok(facts, d["tp"])):
            return False
        if d["tp"] > cl.devices_per_node and not cl.allow_tp_across_nodes:
            return False
        return _sp_ok(run, facts, d["tp"], d["sp"])

    options = [d for d in factorizations(world, {}, AXES) if valid(d)]
    distance: Callable[[Dict[str, int]], float] = lambda d: sum(abs(math.log2(d[a] / want[a])) for a in AXES)
    options.sort(key=lambda d: (distance(d), -d["dp"]))
    if not options:
        return f"no layout of {world} devices fits this model; change the cluster size"
    shown = ["parallel." + " parallel.".join(f"{a}={d[a]}" for a in ("dp", "tp", "pp", "sp")) for d in options[:3]]
    return "nearest valid: " + " | ".join(shown)


def _model_problems(c: _Collector, run: RunConfig) -> Optional[ModelFacts]:
    try:
        return model_facts(run.model.arch, run.model.config, run.model.pretrained)
    except ConfigError as exc:
        c.problems.extend(exc.problems)
        return None


def _tp_problems(c: _Collector, run: RunConfig, facts: ModelFacts, d: Dict[str, int]) -> None:
    tp, world, cl = d["tp"], run.cluster.nodes * run.cluster.devices_per_node, run.cluster
    if tp == 1:
        return
    good = [t for t in divisors(world) if _tp_ok(facts, t) and (t <= cl.devices_per_node or cl.allow_tp_across_nodes)]
    fix = f"valid tp for this model and cluster: {', '.join(map(str, good))}"
    for name, width in (("attention heads", facts.heads), ("KV heads", facts.kv_heads), ("MLP width", facts.ffn),
                        ("shared-expert MLP width", facts.shared_expert_ffn)):
        if width and width % tp:
            c.add("parallel.tp", tp, f"must divide the model's {name} ({width}); {width} % {tp} = {width % tp}", fix)
            return
    if facts.vocab % tp:
        padded = -(-facts.vocab // tp) * tp
        c.add("parallel.tp", tp, f"must divide the vocabulary size ({facts.vocab}) for the vocabulary-parallel embedding and head",
              f"pad it: model.config.vocab_size={padded}, or {fix}")
    # ZeRO-1 x TP and Megatron-SP on learned positions are consistent layouts this version cannot train:
    # runtime_support.unsupported_features says so (the dry run plans them, `train` refuses them).
    # Megatron-SP splits each sp rank's tokens (seq_len / sp) again over tp.
    cut = tp * d["sp"]
    if run.parallel.tp_sequence_parallel and run.train.seq_len % cut:
        over = f"tp={tp} ranks" if cut == tp else f"tp x sp = {cut} ranks"
        c.add("train.seq_len", run.train.seq_len, f"sequence parallelism splits the sequence over {over}",
              f"use a multiple of {cut}, e.g. {-(-run.train.seq_len // cut) * cut}")
    if tp > cl.devices_per_node and not cl.allow_tp_across_nodes:
        c.add("parallel.tp", tp, f"a tensor-parallel group must fit in one node (cluster.devices_per_node={cl.devices_per_node})",
              f"use tp <= {cl.devices_per_node}, or set cluster.allow_tp_across_nodes=true")


def _pp_problems(c: _Collector, run: RunConfig, facts: ModelFacts, pp: int, microbatches: Optional[int]) -> None:
    p = run.parallel
    v, sched, layers = p.pp_virtual_stages, p.pp_schedule, facts.n_layers
    chunks = pp * v
    if pp == 1:
        c.check(v == 1, "parallel.pp_virtual_stages", v, "virtual stages need pipeline parallelism (parallel.pp > 1)",
                "set parallel.pp_virtual_stages=1")
        return
    if not c.check(pp <= layers, "parallel.pp", pp, f"cannot exceed the model's {layers} decoder layers",
                   f"use parallel.pp <= {layers}"):
        return
    c.check(chunks <= layers, "parallel.pp_virtual_stages", v,
            f"pp x virtual stages = {chunks} model chunks, more than the {layers} decoder layers",
            f"use parallel.pp_virtual_stages <= {layers // pp}")
    if sched in ("gpipe", "1f1b"):
        c.check(v == 1, "parallel.pp_virtual_stages", v, f"pp_schedule={sched} runs one stage per rank",
                "set parallel.pp_virtual_stages=1, or parallel.pp_schedule=interleaved-1f1b")
    elif sched in INTERLEAVED:
        c.check(v >= 2, "parallel.pp_virtual_stages", v, f"pp_schedule={sched} needs at least 2 virtual stages per rank",
                "set parallel.pp_virtual_stages=2")
    elif sched in V_SHAPED:
        c.check(v == 2, "parallel.pp_virtual_stages", v, f"pp_schedule={sched} places exactly 2 stages per rank (V shape)",
                "set parallel.pp_virtual_stages=2")
    if p.pp_layers_per_stage is not None:
        split = list(p.pp_layers_per_stage)
        if c.check(len(split) == chunks, "parallel.pp_layers_per_stage", split,
                   f"needs one entry per model chunk (pp x virtual stages = {chunks}), got {len(split)}",
                   f"give {chunks} numbers that add up to {layers}"):
            c.check(sum(split) == layers and all(n >= 0 for n in split) and all(n >= 1 for n in split[1:-1]),
                    "parallel.pp_layers_per_stage", split,
                    f"entries must be >= 0 (>= 1 for middle chunks) and add up to the {layers} decoder layers (got {sum(split)})",
                    f"e.g. {_even_split(layers, chunks)}")
    if microbatches is None:
        return
    m = microbatches
    if sched == "1f1b" or sched == "dualpipev":
        stages = chunks if sched == "dualpipev" else pp
        c.check(m >= stages, "train.microbatches", m, f"pp_schedule={sched} needs at least as many microbatches as stages ({stages})",
                f"raise train.global_batch_size to {stages * run.train.micro_batch_size} x dp or more, or lower train.micro_batch_size")
    if sched in ("interleaved-1f1b", "interleaved-zero-bubble"):
        rounds = max(1, m // pp)
        c.check(m % rounds == 0, "train.microbatches", m,
                f"pp_schedule={sched} needs the microbatches to be a multiple of the rounds (microbatches // pp = {rounds})",
                f"use a multiple of pp={pp} microbatches, e.g. {pp * max(1, rounds)}")


def _even_split(layers: int, chunks: int) -> List[int]:
    base, extra = divmod(layers, chunks)
    return [base + (1 if i < extra else 0) for i in range(chunks)]


def _batch(c: _Collector, run: RunConfig, dp: int) -> Optional[tuple]:
    t = run.train
    b, g, m = t.micro_batch_size, t.global_batch_size, t.microbatches
    if b < 1 or g < 0 or m < 0:
        return None
    if g == 0:
        m = m or 1
        return b * m * dp, m
    if g % (b * dp):
        good = [k * b * dp for k in range(1, 5)]
        c.add("train.global_batch_size", g,
              f"must be a multiple of micro_batch_size x dp = {b} x {dp} = {b * dp} (global = micro x microbatches x dp)",
              f"use train.global_batch_size in {good}, or change train.micro_batch_size")
        return None
    derived = g // (b * dp)
    if m and m != derived:
        c.add("train.microbatches", m, f"inconsistent: global_batch_size {g} / (micro_batch_size {b} x dp {dp}) = {derived}",
              f"set train.microbatches={derived} or 0 (derived)")
        return None
    return g, derived


def _ep_problems(c: _Collector, run: RunConfig, facts: Optional[ModelFacts], d: Dict[str, int]) -> int:
    ep = run.parallel.ep
    dpsp = d["dp"] * d["sp"]
    if ep == -1:
        ep = 1 if facts is None or not facts.is_moe else math.gcd(dpsp, facts.n_experts)  # -1 = as many as fit
    if not c.check(ep >= 1, "parallel.ep", run.parallel.ep, "must be a positive integer or -1", "set parallel.ep=1"):
        return 1
    if facts is not None and not facts.is_moe:
        c.check(ep == 1, "parallel.ep", ep, f"expert parallelism needs a mixture-of-experts model; {facts.arch} has no experts",
                "set parallel.ep=1, or pick a MoE model (model=mixtral-tiny)")
        return 1
    if facts is not None and facts.n_experts % ep:
        valid = [e for e in divisors(facts.n_experts) if dpsp % e == 0]
        c.add("parallel.ep", ep, f"must divide the number of experts ({facts.n_experts})", f"valid ep here: {', '.join(map(str, valid))}")
        return 1
    if dpsp % ep:
        c.add("parallel.ep", ep, f"expert groups are carved out of dp x sp = {dpsp} ranks, which {ep} does not divide",
              f"valid ep here: {', '.join(str(e) for e in divisors(dpsp) if facts is None or facts.n_experts % e == 0)}")
        return 1
    return ep


def _sp_problems(c: _Collector, run: RunConfig, facts: ModelFacts, d: Dict[str, int]) -> None:
    sp, tp, seq = d["sp"], d["tp"], run.train.seq_len
    if sp == 1:
        return
    need = 2 * sp if run.parallel.sp_mode == "ring" else sp
    why = "load-balanced causal ring attention splits the sequence into 2 x sp chunks" if need != sp else "each rank holds seq_len / sp tokens"
    c.check(seq % need == 0, "train.seq_len", seq, f"must be divisible by {need} ({why})",
            f"use train.seq_len={-(-seq // need) * need}")
    # Grouped-query K/V heads need not divide: Ulysses repeats them just enough (sequence_attention).
    if run.parallel.sp_mode == "ulysses":
        c.check(facts.heads % (tp * sp) == 0, "parallel.sp", sp,
                f"Ulysses gives each rank heads / (tp x sp); the model's {facts.heads} attention heads are not divisible by tp x sp = {tp * sp}",
                f"use parallel.sp_mode=ring, or a Ulysses sp in {_ulysses_sps(facts, tp)}")


def _ulysses_sps(facts: ModelFacts, tp: int) -> List[int]:
    """The sp degrees Ulysses allows with this tp: tp x sp divides the attention heads."""
    return [s for s in divisors(facts.heads) if facts.heads % (tp * s) == 0]


def _dp_shard(c: _Collector, run: RunConfig, dp: int) -> int:
    shard = run.parallel.dp_shard
    if shard == -1:
        return dp
    if not c.check(shard >= 1 and dp % shard == 0, "parallel.dp_shard", shard, f"must divide dp ({dp}) or be -1",
                   f"valid: {', '.join(map(str, divisors(dp)))}"):
        return dp
    if shard != dp:
        c.check(run.parallel.zero_stage >= 1, "parallel.dp_shard", shard, "hybrid sharding needs parallel.zero_stage >= 1",
                "set parallel.zero_stage=3 (or 1/2), or parallel.dp_shard=-1")
    return shard


def validate(run: RunConfig) -> ValidatedRun:
    c = _Collector()
    _check_choices(c, run)
    _check_ranges(c, run)
    facts = _model_problems(c, run)
    _data_problems(c, run, facts)
    _comm_profile_problems(c, run)
    degrees = _degree_problems(c, run, facts) if run.cluster.nodes >= 1 and run.cluster.devices_per_node >= 1 else None
    if facts is not None:
        c.check(run.train.seq_len <= facts.max_positions, "train.seq_len", run.train.seq_len,
                f"exceeds the model's maximum positions ({facts.max_positions})",
                f"use train.seq_len <= {facts.max_positions} or raise the model's max positions")
    batch = None
    if degrees is not None:
        batch = _batch(c, run, degrees["dp"])
        if facts is not None:
            _tp_problems(c, run, facts, degrees)
            _pp_problems(c, run, facts, degrees["pp"], batch[1] if batch else None)
            _sp_problems(c, run, facts, degrees)
        ep = _ep_problems(c, run, facts, degrees)
        shard = _dp_shard(c, run, degrees["dp"])
        if not c.problems and degrees["tp"] > 1 and not run.cluster.allow_tp_across_nodes:
            # Non-default axis orders can still scatter a TP group over nodes.
            probe = Layout(**{a: degrees[a] for a in AXES}, order=tuple(run.parallel.order), devices_per_node=run.cluster.devices_per_node)
            spread = [g for g in probe.groups("tp") if len({probe.node_of(r) for r in g}) > 1]
            c.check(not spread, "parallel.order", list(run.parallel.order), f"puts tensor-parallel group {spread[0] if spread else ''} across nodes",
                    "keep tp first in parallel.order, or set cluster.allow_tp_across_nodes=true")
    if c.problems:
        raise ConfigError(c.problems)
    assert degrees is not None and facts is not None and batch is not None
    layout = Layout(**{a: degrees[a] for a in AXES}, ep=ep, dp_shard=shard, order=tuple(run.parallel.order),
                    devices_per_node=run.cluster.devices_per_node)
    return ValidatedRun(run=run, layout=layout, facts=facts, global_batch_size=batch[0], microbatches=batch[1])

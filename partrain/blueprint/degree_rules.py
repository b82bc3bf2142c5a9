"""The rules each parallel degree must meet for a model and cluster (brief section 5): the world
size and -1 inference, tp (heads, KV heads, MLP, vocabulary, node size), pp (layers, virtual
stages, schedules, microbatches), sp (sequence length, Ulysses heads), ep (experts, dp x sp) and
hybrid sharding; with the nearest valid degrees as the fix."""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional

from partrain.blueprint.config.schema import AXES, RunConfig
from partrain.blueprint.layout import divisors, factorizations, resolve_degrees
from partrain.blueprint.model_facts import ModelFacts
from partrain.blueprint.problems import ProblemCollector

INTERLEAVED = ("interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble")
V_SHAPED = ("zbv", "dualpipev")
MAX_WORLD = 1 << 18
"""Largest world size partrain lays out (the dry run lists every rank; beyond this it would take minutes)."""


def degree_problems(c: ProblemCollector, run: RunConfig, facts: Optional[ModelFacts]) -> Optional[Dict[str, int]]:
    """Check the world-size axes; return resolved degrees (dp, tp, pp, sp) or None."""
    p, cl = run.parallel, run.cluster
    world = cl.nodes * cl.devices_per_node
    if world > MAX_WORLD:
        key, value = (
            ("cluster.devices_per_node", cl.devices_per_node)
            if cl.devices_per_node > MAX_WORLD
            else ("cluster.nodes", cl.nodes)
        )
        c.add(
            key,
            value,
            f"the world size nodes x devices_per_node = {world} exceeds the {MAX_WORLD} ranks partrain lays out",
            "plan a smaller cluster",
        )
        return None
    given = {a: getattr(p, a) for a in AXES}
    ok = True
    for axis, value in given.items():
        ok &= c.check(
            value >= 1 or value == -1,
            f"parallel.{axis}",
            value,
            "must be a positive integer or -1 (= the rest)",
            f"set parallel.{axis}=1",
        )
    if not ok:
        return None
    free = [a for a in AXES if given[a] == -1]
    if len(free) > 1:
        c.add(
            f"parallel.{free[1]}",
            -1,
            f"only one degree may be -1, but {', '.join('parallel.' + a for a in free)} are",
            f"give parallel.{free[1]} a number",
        )
        return None
    known = math.prod(v for v in given.values() if v != -1)
    if free:
        if world % known:
            c.add(
                f"parallel.{free[0]}",
                -1,
                f"the other degrees multiply to {known}, which does not divide the world size {world} "
                f"(cluster.nodes={cl.nodes} x cluster.devices_per_node={cl.devices_per_node})",
                _nearest_degrees_hint(run, world, facts),
            )
            return None
        return resolve_degrees(given, world)
    if known != world:
        product = " x ".join(f"parallel.{a}={given[a]}" for a in AXES)
        c.add(
            "parallel",
            {a: given[a] for a in ("dp", "tp", "pp", "sp")},
            f"the degrees multiply to {known} ({product}) but the world size is {world} "
            f"(cluster.nodes={cl.nodes} x cluster.devices_per_node={cl.devices_per_node})",
            _nearest_degrees_hint(run, world, facts)
            + f"; or run on {known} devices (cluster.devices_per_node={known // cl.nodes})"
            if known % cl.nodes == 0
            else _nearest_degrees_hint(run, world, facts),
        )
        return None
    return dict(given)


def _tp_ok(facts: Optional[ModelFacts], tp: int) -> bool:
    if facts is None:
        return True
    widths = [facts.heads, facts.kv_heads, facts.ffn, facts.vocab] + (
        [facts.shared_expert_ffn] if facts.shared_expert_ffn else []
    )
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


def tp_problems(c: ProblemCollector, run: RunConfig, facts: ModelFacts, d: Dict[str, int]) -> None:
    tp, world, cl = d["tp"], run.cluster.nodes * run.cluster.devices_per_node, run.cluster
    if tp == 1:
        return
    good = [t for t in divisors(world) if _tp_ok(facts, t) and (t <= cl.devices_per_node or cl.allow_tp_across_nodes)]
    fix = f"valid tp for this model and cluster: {', '.join(map(str, good))}"
    for name, width in (
        ("attention heads", facts.heads),
        ("KV heads", facts.kv_heads),
        ("MLP width", facts.ffn),
        ("shared-expert MLP width", facts.shared_expert_ffn),
    ):
        if width and width % tp:
            c.add("parallel.tp", tp, f"must divide the model's {name} ({width}); {width} % {tp} = {width % tp}", fix)
            return
    if facts.vocab % tp:
        padded = -(-facts.vocab // tp) * tp
        c.add(
            "parallel.tp",
            tp,
            f"must divide the vocabulary size ({facts.vocab}) for the vocabulary-parallel embedding and head",
            f"pad it: model.config.vocab_size={padded}, or {fix}",
        )
    # ZeRO-1 x TP and Megatron-SP on learned positions are consistent layouts this version cannot train:
    # trainable.unsupported_features says so (the dry run plans them, `train` refuses them).
    # Megatron-SP splits each sp rank's tokens (seq_len / sp) again over tp.
    cut = tp * d["sp"]
    if run.parallel.tp_sequence_parallel and run.train.seq_len % cut:
        over = f"tp={tp} ranks" if cut == tp else f"tp x sp = {cut} ranks"
        c.add(
            "train.seq_len",
            run.train.seq_len,
            f"sequence parallelism splits the sequence over {over}",
            f"use a multiple of {cut}, e.g. {-(-run.train.seq_len // cut) * cut}",
        )
    if tp > cl.devices_per_node and not cl.allow_tp_across_nodes:
        c.add(
            "parallel.tp",
            tp,
            f"a tensor-parallel group must fit in one node (cluster.devices_per_node={cl.devices_per_node})",
            f"use tp <= {cl.devices_per_node}, or set cluster.allow_tp_across_nodes=true",
        )


def pp_problems(c: ProblemCollector, run: RunConfig, facts: ModelFacts, pp: int, microbatches: Optional[int]) -> None:
    p = run.parallel
    v, sched, layers = p.pp_virtual_stages, p.pp_schedule, facts.n_layers
    chunks = pp * v
    if pp == 1:
        c.check(
            v == 1,
            "parallel.pp_virtual_stages",
            v,
            "virtual stages need pipeline parallelism (parallel.pp > 1)",
            "set parallel.pp_virtual_stages=1",
        )
        return
    if not c.check(
        pp <= layers,
        "parallel.pp",
        pp,
        f"cannot exceed the model's {layers} decoder layers",
        f"use parallel.pp <= {layers}",
    ):
        return
    c.check(
        chunks <= layers,
        "parallel.pp_virtual_stages",
        v,
        f"pp x virtual stages = {chunks} model chunks, more than the {layers} decoder layers",
        f"use parallel.pp_virtual_stages <= {layers // pp}",
    )
    _virtual_stage_problems(c, sched, v)
    if p.pp_layers_per_stage is not None:
        _layer_split_problems(c, list(p.pp_layers_per_stage), chunks, layers)
    if microbatches is not None:
        _microbatch_problems(c, run, sched, pp, chunks, microbatches)


def _virtual_stage_problems(c: ProblemCollector, sched: str, v: int) -> None:
    if sched in ("gpipe", "1f1b"):
        c.check(
            v == 1,
            "parallel.pp_virtual_stages",
            v,
            f"pp_schedule={sched} runs one stage per rank",
            "set parallel.pp_virtual_stages=1, or parallel.pp_schedule=interleaved-1f1b",
        )
    elif sched in INTERLEAVED:
        c.check(
            v >= 2,
            "parallel.pp_virtual_stages",
            v,
            f"pp_schedule={sched} needs at least 2 virtual stages per rank",
            "set parallel.pp_virtual_stages=2",
        )
    elif sched in V_SHAPED:
        c.check(
            v == 2,
            "parallel.pp_virtual_stages",
            v,
            f"pp_schedule={sched} places exactly 2 stages per rank (V shape)",
            "set parallel.pp_virtual_stages=2",
        )


def _layer_split_problems(c: ProblemCollector, split: List[int], chunks: int, layers: int) -> None:
    if c.check(
        len(split) == chunks,
        "parallel.pp_layers_per_stage",
        split,
        f"needs one entry per model chunk (pp x virtual stages = {chunks}), got {len(split)}",
        f"give {chunks} numbers that add up to {layers}",
    ):
        c.check(
            sum(split) == layers and all(n >= 0 for n in split) and all(n >= 1 for n in split[1:-1]),
            "parallel.pp_layers_per_stage",
            split,
            f"entries must be >= 0 (>= 1 for middle chunks) and add up to the {layers} decoder layers (got "
            f"{sum(split)})",
            f"e.g. {_even_split(layers, chunks)}",
        )


def _microbatch_problems(c: ProblemCollector, run: RunConfig, sched: str, pp: int, chunks: int, m: int) -> None:
    if sched == "1f1b" or sched == "dualpipev":
        stages = chunks if sched == "dualpipev" else pp
        c.check(
            m >= stages,
            "train.microbatches",
            m,
            f"pp_schedule={sched} needs at least as many microbatches as stages ({stages})",
            f"raise train.global_batch_size to {stages * run.train.micro_batch_size} x dp or more, or lower "
            "train.micro_batch_size",
        )
    if sched in ("interleaved-1f1b", "interleaved-zero-bubble"):
        rounds = max(1, m // pp)
        c.check(
            m % rounds == 0,
            "train.microbatches",
            m,
            f"pp_schedule={sched} needs the microbatches to be a multiple of the rounds (microbatches // pp = "
            f"{rounds})",
            f"use a multiple of pp={pp} microbatches, e.g. {pp * max(1, rounds)}",
        )


def _even_split(layers: int, chunks: int) -> List[int]:
    base, extra = divmod(layers, chunks)
    return [base + (1 if i < extra else 0) for i in range(chunks)]


def ep_problems(c: ProblemCollector, run: RunConfig, facts: Optional[ModelFacts], d: Dict[str, int]) -> int:
    ep = run.parallel.ep
    dpsp = d["dp"] * d["sp"]
    if ep == -1:
        ep = 1 if facts is None or not facts.is_moe else math.gcd(dpsp, facts.n_experts)  # -1 = as many as fit
    if not c.check(ep >= 1, "parallel.ep", run.parallel.ep, "must be a positive integer or -1", "set parallel.ep=1"):
        return 1
    if facts is not None and not facts.is_moe:
        c.check(
            ep == 1,
            "parallel.ep",
            ep,
            f"expert parallelism needs a mixture-of-experts model; {facts.arch} has no experts",
            "set parallel.ep=1, or pick a MoE model (model=mixtral-tiny)",
        )
        return 1
    if facts is not None and facts.n_experts % ep:
        valid = [e for e in divisors(facts.n_experts) if dpsp % e == 0]
        c.add(
            "parallel.ep",
            ep,
            f"must divide the number of experts ({facts.n_experts})",
            f"valid ep here: {', '.join(map(str, valid))}",
        )
        return 1
    if dpsp % ep:
        c.add(
            "parallel.ep",
            ep,
            f"expert groups are carved out of dp x sp = {dpsp} ranks, which {ep} does not divide",
            f"valid ep here: {', '.join(str(e) for e in divisors(dpsp) if facts is None or facts.n_experts % e == 0)}",
        )
        return 1
    return ep


def sp_problems(c: ProblemCollector, run: RunConfig, facts: ModelFacts, d: Dict[str, int]) -> None:
    sp, tp, seq = d["sp"], d["tp"], run.train.seq_len
    if sp == 1:
        return
    need = 2 * sp if run.parallel.sp_mode == "ring" else sp
    why = (
        "load-balanced causal ring attention splits the sequence into 2 x sp chunks"
        if need != sp
        else "each rank holds seq_len / sp tokens"
    )
    c.check(
        seq % need == 0,
        "train.seq_len",
        seq,
        f"must be divisible by {need} ({why})",
        f"use train.seq_len={-(-seq // need) * need}",
    )
    # Grouped-query K/V heads need not divide: Ulysses repeats them just enough (sequence_attention).
    if run.parallel.sp_mode == "ulysses":
        c.check(
            facts.heads % (tp * sp) == 0,
            "parallel.sp",
            sp,
            f"Ulysses gives each rank heads / (tp x sp); the model's {facts.heads} attention heads are not "
            f"divisible by tp x sp = {tp * sp}",
            f"use parallel.sp_mode=ring, or a Ulysses sp in {_ulysses_sps(facts, tp)}",
        )


def _ulysses_sps(facts: ModelFacts, tp: int) -> List[int]:
    """The sp degrees Ulysses allows with this tp: tp x sp divides the attention heads."""
    return [s for s in divisors(facts.heads) if facts.heads % (tp * s) == 0]


def dp_shard_degree(c: ProblemCollector, run: RunConfig, dp: int) -> int:
    shard = run.parallel.dp_shard
    if shard == -1:
        return dp
    if not c.check(
        shard >= 1 and dp % shard == 0,
        "parallel.dp_shard",
        shard,
        f"must divide dp ({dp}) or be -1",
        f"valid: {', '.join(map(str, divisors(dp)))}",
    ):
        return dp
    if shard != dp:
        c.check(
            run.parallel.zero_stage >= 1,
            "parallel.dp_shard",
            shard,
            "hybrid sharding needs parallel.zero_stage >= 1",
            "set parallel.zero_stage=3 (or 1/2), or parallel.dp_shard=-1",
        )
    return shard

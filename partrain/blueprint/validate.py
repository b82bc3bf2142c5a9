"""Check a composed RunConfig against every layout rule before any process or file exists.

`validate(run)` returns a `ValidatedRun` (resolved degrees, rank layout, model facts, batch
arithmetic) or raises ConfigError listing every problem, each with key, value, rule and a fix.
The rules are those of brief section 5; model facts come from the HF config class (see
`partrain.blueprint.model_facts`), so nothing is built.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from partrain.blueprint.config.hub_ids import reads_as_hub_id
from partrain.blueprint.config.names import nearest_name
from partrain.blueprint.config.path_limits import DEFAULT_RUNS, path_key_problems
from partrain.blueprint.config.paths import is_there
from partrain.blueprint.config.schema import AT_LEAST, AXES, CHOICES, TRACKERS, RunConfig
from partrain.blueprint.degree_rules import (
    degree_problems,
    dp_shard_degree,
    ep_problems,
    pp_problems,
    sp_problems,
    tp_problems,
)
from partrain.blueprint.layout import Layout
from partrain.blueprint.model_facts import ModelFacts, model_facts
from partrain.blueprint.problems import ProblemCollector
from partrain.blueprint.validate_data_format import data_format_problems
from partrain.blueprint.validate_dp_sync import dp_sync_problems
from partrain.blueprint.validate_elastic import elastic_problems
from partrain.blueprint.validate_float8 import float8_problems
from partrain.blueprint.validate_moe import moe_problems
from partrain.blueprint.validate_objective import objective_problems
from partrain.blueprint.validate_peft import peft_problems
from partrain.blueprint.validate_runtime import runtime_problems
from partrain.errors import ConfigError

BYTE_VOCAB = 256


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


def _choice_fix(key: str, value, allowed) -> str:
    near = nearest_name(value, allowed)
    return f"did you mean {key}={near}?" if near else f"set {key}={allowed[0]}"


def _check_choices(c: ProblemCollector, run: RunConfig) -> None:
    p, t, cl = run.parallel, run.train, run.cluster
    for key, allowed in CHOICES.items():
        section, _, name = key.partition(".")
        value = getattr(getattr(run, section), name)
        if key == "parallel.zero_stage":
            c.check(
                value in allowed,
                key,
                value,
                "must be 0, 1, 2 or 3",
                "0 = DDP, 1 = sharded optimizer, 2/3 = FSDP",
            )
            continue
        c.check(value in allowed, key, value, f"must be one of {', '.join(allowed)}", _choice_fix(key, value, allowed))
    c.check(
        sorted(p.order) == sorted(AXES),
        "parallel.order",
        list(p.order),
        f"must list each of {', '.join(AXES)} once",
        f"e.g. parallel.order=[{','.join(AXES)}]",
    )
    c.check(
        not (t.param_dtype == "16bit" and t.precision == "fp32"),
        "train.param_dtype",
        t.param_dtype,
        "16bit parameters need a 16-bit train.precision",
        "set train.precision=bf16 (or fp16), or train.param_dtype=auto",
    )
    if cl.backend == "nccl":
        c.check(
            cl.device == "cuda",
            "cluster.backend",
            cl.backend,
            "nccl needs cluster.device=cuda",
            "use backend gloo on CPU",
        )


def _check_loggers(c: ProblemCollector, run: RunConfig) -> None:
    loggers = list(run.train.loggers)
    for name in loggers:
        near = nearest_name(name, TRACKERS)
        c.check(
            name in TRACKERS,
            "train.loggers",
            loggers,
            f"{name!r} is not a tracker partrain logs to: choose among {', '.join(TRACKERS)}",
            f"write {near} instead of {name}" if near else "remove it, or name one of those",
        )
    c.check(
        len(set(loggers)) == len(loggers),
        "train.loggers",
        loggers,
        "names a tracker twice",
        "list each tracker once, e.g. train.loggers=[tensorboard,wandb]",
    )


def _check_optimizer(c: ProblemCollector, run: RunConfig) -> None:
    """The optimizer and schedule keys that depend on each other or on the layout."""
    o, steps = run.optim, run.train.steps
    c.check(0 <= o.momentum < 1, "optim.momentum", o.momentum, "must be within [0, 1)", "e.g. optim.momentum=0.9")
    c.check(
        0 < o.decay_fraction <= 1,
        "optim.decay_fraction",
        o.decay_fraction,
        "must be within (0, 1] (the fraction of train.steps the wsd schedule decays over)",
        "e.g. optim.decay_fraction=0.2",
    )
    if o.schedule == "wsd" and 0 < o.decay_fraction <= 1 and o.warmup_steps >= 0:
        decay = max(1, round(o.decay_fraction * steps))
        c.check(
            o.warmup_steps + decay <= steps,
            "optim.warmup_steps",
            o.warmup_steps,
            f"wsd: warmup {o.warmup_steps} + decay {decay} (decay_fraction x train.steps) exceed train.steps={steps}",
            f"use optim.warmup_steps <= {max(0, steps - decay)} or a smaller optim.decay_fraction",
        )
    if o.name == "sgd":
        c.check(
            run.parallel.zero_stage != 1,
            "optim.name",
            o.name,
            "parallel.zero_stage=1 shards AdamW's state only (its flat buffers and checkpoints hold AdamW's moments)",
            "use optim.name=adamw, or parallel.zero_stage=0, 2 or 3 with sgd",
        )


def _check_ranges(c: ProblemCollector, run: RunConfig) -> None:
    t, o, ck, d = run.train, run.optim, run.checkpoint, run.data
    for key, low in AT_LEAST.items():
        section, _, name = key.partition(".")
        value = getattr(getattr(run, section), name)
        c.check(value >= low, key, value, f"must be >= {low}", f"set {key} to {low} or more")
    c.check(o.lr > 0, "optim.lr", o.lr, "must be > 0", "e.g. optim.lr=3e-4")
    c.check(t.epochs >= 0, "train.epochs", t.epochs, "must be >= 0 (0 = train.steps decides)", "e.g. train.epochs=3")
    c.check(
        not (t.epochs > 0 and d.streaming),
        "train.epochs",
        t.epochs,
        "a streamed source's length is not known before training, so epochs cannot be turned into steps",
        "set train.steps=N instead, or data.streaming=false (the cache counts the data)",
    )
    c.check(
        1 <= t.loss_scale_init <= 2.0**64,
        "train.loss_scale_init",
        t.loss_scale_init,
        "must be within [1, 2**64] (a loss multiplier for fp16)",
        "e.g. train.loss_scale_init=65536",
    )
    c.check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio, "must be within [0, 1]", "e.g. 0.1")
    for key, value in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        c.check(0 <= value < 1, key, value, "must be within [0, 1)", "e.g. 0.9 / 0.95")
    c.check(o.eps > 0, "optim.eps", o.eps, "must be > 0", "e.g. 1e-8")
    c.check(o.grad_clip >= 0, "optim.grad_clip", o.grad_clip, "must be >= 0 (0 = off)", "e.g. 1.0")
    c.check(o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "must be >= 0", "e.g. 0.1")
    c.check(0 < d.eval_fraction < 1, "data.eval_fraction", d.eval_fraction, "must be within (0, 1)", "e.g. 0.02")
    resume = ck.resume
    if resume not in ("none", "auto"):
        c.check(
            is_there(resume),
            "checkpoint.resume",
            resume,
            "is neither none, auto nor an existing checkpoint path",
            "use checkpoint.resume=auto to pick the newest complete checkpoint",
        )


_NOT_FINITE = "must be a finite number (inf and nan are not values)"


def _check_finite(c: ProblemCollector, node, prefix: str = "") -> None:
    """Every float of the config (model.config's included) is finite. Runs after the key-specific
    rules and skips keys they already refused, so each key gets one problem, the specific one
    (with its example value) where there is one.

    Range checks such as `lr > 0` let inf through (and some let nan through), and a non-finite
    learning rate, beta or clip value makes the first step's weights nan."""
    items = (
        [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
        if dataclasses.is_dataclass(node)
        else list(node.items())
        if isinstance(node, dict)
        else []
    )
    for name, value in items:
        key = f"{prefix}.{name}" if prefix else str(name)
        if isinstance(value, float) and not math.isfinite(value):
            if any(p.key == key for p in c.problems):
                continue
            c.add(key, value, _NOT_FINITE, f"give {key} a finite value (see `partrain show --explain`)")
        elif dataclasses.is_dataclass(value) or isinstance(value, dict):
            _check_finite(c, value, key)


def _comm_profile_problems(c: ProblemCollector, run: RunConfig) -> None:
    """cluster.comm_profile must be a readable profile of this partrain's format, measured with the
    cluster's backend on its device type: a gloo/CPU profile would make a GPU plan wrong by orders
    of magnitude, so a mismatch is an error, not a warning. Other differences (node count, cluster
    name) are allowed: measuring a few nodes to plan many is the point."""
    path = run.cluster.comm_profile
    if not path:
        return
    from partrain.blueprint.comm_profile import ProfileError, load_profile, mismatch

    fix = (
        "run `partrain bench comm` with this cluster to write one (then cluster.comm_profile=FILE), "
        "or unset cluster.comm_profile"
    )
    try:
        profile = load_profile(path)
    except ProfileError as exc:
        c.add("cluster.comm_profile", path, str(exc), fix)
        return
    why = mismatch(profile, run.cluster.backend, run.cluster.device)
    if why:
        c.add("cluster.comm_profile", path, why, fix)


def _compute_profile_problems(c: ProblemCollector, run: RunConfig) -> None:
    """cluster.compute_profile must be a readable profile measured on the cluster's device type at
    the run's precision (rules in compute_profile.problem)."""
    if run.cluster.compute_profile:
        from partrain.blueprint.compute_profile import FIX, problem

        why = problem(run.cluster.compute_profile, run.cluster.device, run.train.precision)
        if why:
            c.add("cluster.compute_profile", run.cluster.compute_profile, why, FIX)


def _data_problems(c: ProblemCollector, run: RunConfig, facts: Optional[ModelFacts]) -> None:
    d = run.data
    if d.source not in ("builtin", "builtin-chat", "builtin-preference"):  # generated sources (partrain.data), no path
        c.check(  # a Hub id here is a dataset a dry run or `plan` did not download (train resolves it first)
            is_there(d.source) or reads_as_hub_id(d.source),
            "data.source",
            d.source,
            "no such file or folder",
            "use data.source=builtin or a local text/jsonl/parquet path",
        )
    if d.tokenizer in ("byte", "auto"):
        if facts is not None:
            vocab_key = "model.config.vocab_size"
            c.check(
                facts.vocab >= BYTE_VOCAB,
                vocab_key,
                facts.vocab,
                f"the byte tokenizer needs a vocabulary of at least {BYTE_VOCAB}",
                f"set {vocab_key}={BYTE_VOCAB}",
            )
    else:
        c.check(
            is_there(d.tokenizer, "dir"),
            "data.tokenizer",
            d.tokenizer,
            "neither 'byte' nor a local tokenizer folder",
            "use data.tokenizer=byte or a folder written by tokenizer.save_pretrained",
        )


def _model_problems(c: ProblemCollector, run: RunConfig) -> Optional[ModelFacts]:
    try:
        return model_facts(run.model.arch, run.model.config, run.model.pretrained)
    except ConfigError as exc:
        c.problems.extend(exc.problems)
        return None


def _batch(c: ProblemCollector, run: RunConfig, dp: int) -> Optional[tuple]:
    t = run.train
    b, g, m = t.micro_batch_size, t.global_batch_size, t.microbatches
    if b < 1 or g < 0 or m < 0:
        return None
    if g == 0:
        m = m or 1
        return b * m * dp, m
    if g % (b * dp):
        good = [k * b * dp for k in range(1, 5)]
        c.add(
            "train.global_batch_size",
            g,
            f"must be a multiple of micro_batch_size x dp = {b} x {dp} = {b * dp} (global = micro x microbatches x dp)",
            f"use train.global_batch_size in {good}, or change train.micro_batch_size",
        )
        return None
    derived = g // (b * dp)
    if m and m != derived:
        c.add(
            "train.microbatches",
            m,
            f"inconsistent: global_batch_size {g} / (micro_batch_size {b} x dp {dp}) = {derived}",
            f"set train.microbatches={derived} or 0 (derived)",
        )
        return None
    return g, derived


def validate(run: RunConfig) -> ValidatedRun:
    too_long = path_key_problems(run, DEFAULT_RUNS)
    if too_long:  # every check below that looks at these paths would fail with ENAMETOOLONG
        raise ConfigError(too_long)
    c = ProblemCollector()
    _check_choices(c, run)
    _check_ranges(c, run)
    _check_optimizer(c, run)
    _check_loggers(c, run)
    runtime_problems(c, run)
    facts = _model_problems(c, run)
    _data_problems(c, run, facts)
    moe_problems(c, run.parallel, facts)
    elastic_problems(c, run)
    _comm_profile_problems(c, run)
    _compute_profile_problems(c, run)
    degrees = degree_problems(c, run, facts) if run.cluster.nodes >= 1 and run.cluster.devices_per_node >= 1 else None
    peft_problems(c, run, facts, degrees)
    float8_problems(c, run, facts, degrees)
    data_format_problems(c, run, degrees)
    objective_problems(c, run, degrees)
    if facts is not None:
        c.check(
            run.train.seq_len <= facts.max_positions,
            "train.seq_len",
            run.train.seq_len,
            f"exceeds the model's maximum positions ({facts.max_positions})",
            f"use train.seq_len <= {facts.max_positions} or raise the model's max positions",
        )
    batch = None
    if degrees is not None:
        batch = _batch(c, run, degrees["dp"])
        if facts is not None:
            tp_problems(c, run, facts, degrees)
            pp_problems(c, run, facts, degrees["pp"], batch[1] if batch else None)
            sp_problems(c, run, facts, degrees)
        ep = ep_problems(c, run, facts, degrees)
        dp_sync_problems(c, run, degrees)
        shard = dp_shard_degree(c, run, degrees["dp"])
        if not c.problems and degrees["tp"] > 1 and not run.cluster.allow_tp_across_nodes:
            # Non-default axis orders can still scatter a TP group over nodes.
            probe = Layout(
                **{a: degrees[a] for a in AXES},
                order=tuple(run.parallel.order),
                devices_per_node=run.cluster.devices_per_node,
            )
            spread = [g for g in probe.groups("tp") if len({probe.node_of(r) for r in g}) > 1]
            c.check(
                not spread,
                "parallel.order",
                list(run.parallel.order),
                f"puts tensor-parallel group {spread[0] if spread else ''} across nodes",
                "keep tp first in parallel.order, or set cluster.allow_tp_across_nodes=true",
            )
    _check_finite(c, run)
    if c.problems:
        raise ConfigError(c.problems)
    assert degrees is not None and facts is not None and batch is not None
    layout = Layout(
        **{a: degrees[a] for a in AXES},
        ep=ep,
        dp_shard=shard,
        order=tuple(run.parallel.order),
        devices_per_node=run.cluster.devices_per_node,
    )
    return ValidatedRun(run=run, layout=layout, facts=facts, global_batch_size=batch[0], microbatches=batch[1])

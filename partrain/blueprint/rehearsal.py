"""What `partrain rehearse` runs: the user's run, shrunk to fit a laptop CPU, as plain override lists.

A rehearsal trains the user's configuration twice for a few steps, under its layout and in one process,
and compares them step by step. This module decides everything about those two runs from the validated
run alone (no torch): which model sizes shrink and to what, which parallel degrees shrink when the world
is too large, what the runs' cluster, precision, batch and steps are, and what a CPU run cannot rehearse.
Everything else of the user's run stays: family and architecture options (attention kind, windows, MoE
routing, tied embeddings, norms, rotary), data source, tokenizer, template, masking, packing, LoRA,
schedule, recompute, ZeRO.

Shrinking keeps every degree dividing what it splits: heads and K/V heads by tp (and by sp under
Ulysses), experts by ep, layers by the pipeline's stages x virtual stages, the sequence by sp.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from partrain.blueprint.families import family
from partrain.blueprint.families.generic_moe import EXPERT_FFN_KEYS, EXPERTS_KEYS, SHARED_FFN_KEYS
from partrain.blueprint.model_facts import load_snapshot, merged_kwargs
from partrain.blueprint.validate import ValidatedRun

DEFAULT_STEPS = 4
"""Steps of a rehearsal: the first compares forward and backward, the later ones the updates after it."""

DEFAULT_MAX_PROCESSES = 16
"""Most processes a rehearsal starts; a larger world is reduced axis by axis."""

REHEARSAL_SEQ_LEN = 128
"""Longest sequence a rehearsal trains (a longer one is cut to this, said so): a real vocabulary's head
(128k tokens) makes every token cost on CPU. The llama3-70b-h100 recipe's rehearsal (16 processes) took
78 s here at 128 tokens and 187 s at 256; longer examples are truncated, said so."""

HEAD_DIM = 16
"""Head width of a shrunk model."""

SMALL_HIDDEN, SMALL_LAYERS, SMALL_EXPERTS = 256, 8, 16
"""A model within all three is rehearsed at its own sizes."""

LOSS_RTOL = 1e-5
"""Relative tolerance on every step's loss: a rehearsal runs in fp32, where a layout differs from one process
only by the order of its sums (partrain.rehearse.parity.FP32_RTOL; measured below 3e-7 on every rehearsal
in tests/test_rehearse.py and on the shipped recipes). A fault shows at 1e-3 or more."""

GRAD_NORM_RTOL = 1e-4
"""Relative tolerance on every step's gradient norm. It sums the squares of every gradient element: a real
vocabulary's model (Llama 3's 128,256 tokens) under FSDP or Megatron-SP, which sum those squares in another
order, differs from one process by 3e-6 at step 1 and 1.6e-5 by step 4 (measured on the llama3-70b-h100
recipe's rehearsal; the suite's tiny vocabularies stay below 2e-6). A fault shows at 1e-3 or more."""

AXES = ("dp", "tp", "pp", "sp", "ep")

REFERENCE_OVERRIDES = (
    *(f"parallel.{axis}=1" for axis in AXES),
    "parallel.zero_stage=0",
    "parallel.dp_shard=-1",
    "parallel.pp_virtual_stages=1",
    "parallel.pp_layers_per_stage=null",
    "parallel.tp_sequence_parallel=false",
    "parallel.recompute=none",
    "parallel.dp_sync=allreduce",
    "parallel.ps_servers=1",
    "cluster.nodes=1",
    "cluster.devices_per_node=1",
)
"""What turns any layout into the single-process reference (later overrides win in Hydra): a rehearsal's,
and the suite's parity tests' (partrain.rehearse.parity)."""


@dataclass(frozen=True)
class Change:
    """One thing the rehearsal runs differently from the user's run, and why."""

    key: str
    before: Any
    after: Any
    why: str

    def to_json(self) -> dict:
        return {"key": self.key, "before": self.before, "after": self.after, "why": self.why}


@dataclass(frozen=True)
class RehearsalPlan:
    """The rehearsal's two runs, as overrides appended to the user's own."""

    layout_overrides: Tuple[str, ...]
    """Appended to the user's overrides: the shrunk model, the (reduced) layout on CPU processes."""
    reference_overrides: Tuple[str, ...]
    """Appended after layout_overrides: the same run in one process."""
    world: int
    """Processes of the layout run."""
    steps: int
    resume_step: int
    """The layout run saves here; its checkpoint is resumed under the layout and in one process for the
    steps after it; 0: no resume check (a one-step rehearsal)."""
    loss_rtol: float
    grad_norm_rtol: float
    changes: Tuple[Change, ...] = ()
    """What was shrunk or reduced, key by key."""
    not_rehearsed: Tuple[str, ...] = ()
    """What a CPU rehearsal cannot check, and why."""
    dropped_overrides: Tuple[str, ...] = ()
    """The user's overrides the rehearsal leaves out (a pretrained folder's weights: its config is kept)."""

    def to_json(self) -> dict:
        return {
            "world": self.world,
            "steps": self.steps,
            "resume_step": self.resume_step,
            "loss_rtol": self.loss_rtol,
            "grad_norm_rtol": self.grad_norm_rtol,
            "changes": [c.to_json() for c in self.changes],
            "not_rehearsed": list(self.not_rehearsed),
            "layout_overrides": list(self.layout_overrides),
            "reference_overrides": list(self.reference_overrides),
        }


@dataclass
class _Builder:
    overrides: List[str] = field(default_factory=list)
    changes: List[Change] = field(default_factory=list)

    def set(self, key: str, value: Any, before: Any = None, why: str = "") -> None:
        self.overrides.append(f"{key}={_hydra(value)}")
        if why:
            self.changes.append(Change(key.lstrip("+"), before, value, why))


def _hydra(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra(v)}" for k, v in value.items()) + "}"
    return str(value)


def plan_rehearsal(
    v: ValidatedRun, user_overrides: List[str], steps: int = DEFAULT_STEPS, max_processes: int = DEFAULT_MAX_PROCESSES
) -> RehearsalPlan:
    """The rehearsal of the validated run `v` (composed from `user_overrides`)."""
    b = _Builder()
    kept, dropped = _model_source(v, user_overrides, b)
    degrees = _degrees(v, max_processes, b)
    _shrink_model(v, degrees, b)
    seq = _sequence(v, degrees, b)
    _batch(v, degrees, b)
    world = degrees["dp"] * degrees["tp"] * degrees["pp"] * degrees["sp"]
    not_rehearsed = _cpu_run(v, world, b) + _no_dropout(v, b)
    b.set("train.steps", steps)
    b.set("train.seq_len", seq)
    resume_step = steps // 2
    for key, value in (
        ("train.eval_every", 0),
        ("train.eval_batches", 0),
        ("train.loggers", []),
        ("train.epochs", 0.0),
        ("checkpoint.every_steps", resume_step),  # 0 (none) for a one-step rehearsal
        ("checkpoint.keep_last", 0),
        ("checkpoint.dir", ""),
        ("checkpoint.save_final", False),
        ("checkpoint.export_hf", False),
        ("checkpoint.resume", "none"),
        ("checkpoint.init_from", ""),
        ("parallel.auto", False),
    ):
        b.set(key, value)
    reference = REFERENCE_OVERRIDES
    return RehearsalPlan(
        layout_overrides=tuple(kept + b.overrides),
        reference_overrides=reference,
        world=world,
        steps=steps,
        resume_step=resume_step,
        loss_rtol=LOSS_RTOL,
        grad_norm_rtol=GRAD_NORM_RTOL,
        changes=tuple(b.changes),
        not_rehearsed=tuple(not_rehearsed),
        dropped_overrides=tuple(dropped),
    )


# ---- the model ---------------------------------------------------------------------------------------


def _model_source(v: ValidatedRun, user_overrides: List[str], b: _Builder) -> Tuple[List[str], List[str]]:
    """The user's overrides the rehearsal keeps. A pretrained folder's weights cannot shrink: its config
    (every field of the family's config class) becomes the model's, built with random weights."""
    m = v.run.model
    if not m.pretrained:
        return list(user_overrides), []
    dropped = [o for o in user_overrides if o.split("=", 1)[0].lstrip("+") in ("model", "model.pretrained")]
    kept = [o for o in user_overrides if o not in dropped]
    values = merged_kwargs(m.arch, m.config or {}, m.pretrained, load_snapshot())
    b.set("model", "empty")
    b.set("model.arch", m.arch)
    b.set("model.name", f"{m.name or m.arch}-rehearsal")
    for key, value in sorted(values.items()):
        if _plain(value) and key not in NOT_ARCHITECTURE:
            b.overrides.append(f"++model.config.{key}={_hydra(value)}")
    b.set("data.tokenizer", v.run.data.tokenizer)
    b.changes.append(
        Change(
            "model.pretrained",
            m.pretrained,
            None,
            "a rehearsal trains the folder's architecture, shrunk, from random weights",
        )
    )
    return kept, dropped


NOT_ARCHITECTURE = frozenset(
    ("use_cache", "dtype", "torch_dtype", "return_dict", "output_hidden_states", "output_attentions")
)
"""A folder's config.json fields that say how it was saved or served, not what the model computes."""


def _plain(value: Any) -> bool:
    """A config value Hydra can take on the command line as it is."""
    if value is None or isinstance(value, (bool, int, float)):
        return True
    if isinstance(value, str):
        return value != "" and all(c.isalnum() or c in "_-." for c in value)
    if isinstance(value, list):
        return all(_plain(x) and not isinstance(x, (list, dict)) for x in value)
    if isinstance(value, dict):  # rope_parameters and the like: names as keys, plain values
        return all(isinstance(k, str) and _plain(k) and _plain(x) for k, x in value.items())
    return False


def _shrink_model(v: ValidatedRun, degrees: Dict[str, int], b: _Builder) -> None:
    """Small sizes of the same family and options, every degree still dividing what it splits."""
    m, f = v.run.model, v.facts
    if f.hidden <= SMALL_HIDDEN and f.n_layers <= SMALL_LAYERS and f.n_experts <= SMALL_EXPERTS:
        return  # already a CPU-sized model: rehearsed as it is
    fam = family(m.arch)
    values = merged_kwargs(m.arch, m.config or {}, m.pretrained, load_snapshot())
    tp, pp, sp = degrees["tp"], degrees["pp"], degrees["sp"]
    ulysses = sp > 1 and v.run.parallel.sp_mode == "ulysses"
    heads, kv = _heads(f.heads, f.kv_heads, tp, sp if ulysses else 1)
    hidden = heads * HEAD_DIM
    stages = pp * v.run.parallel.pp_virtual_stages
    layers = max(2, stages * max(1, -(-2 // stages)))
    dense = int(values.get("first_k_dense_replace") or 0)
    if dense:
        layers = max(layers, stages * -(-(min(dense, 1) + 1) // stages))
    sizes = {"hidden": hidden, "ffn": 2 * hidden, "layers": layers, "heads": heads, "kv_heads": kv}
    why = "a model of the same family and options, small enough for CPU processes; every degree still divides it"
    widths = {"ffn", *EXPERT_FFN_KEYS, *SHARED_FFN_KEYS}  # never widened
    for generic, key in fam.config_keys.items():
        if generic in sizes and values.get(key):
            size = min(sizes[generic], values[key]) if generic in widths else sizes[generic]
            if size != values[key]:
                b.set(f"++model.config.{key}", size, values[key], why)
    extra = {
        "head_dim": HEAD_DIM,
        **{key: min(hidden, values.get(key) or hidden) for key in ("moe_intermediate_size", *SHARED_FFN_KEYS)},
        "dense_intermediate_size": min(2 * hidden, values.get("dense_intermediate_size") or hidden),
        "first_k_dense_replace": min(dense, 1),
        "q_lora_rank": 2 * HEAD_DIM if values.get("q_lora_rank") else None,
        "kv_lora_rank": HEAD_DIM,
        "qk_nope_head_dim": HEAD_DIM,
        "qk_rope_head_dim": HEAD_DIM // 2,
        "v_head_dim": HEAD_DIM,
    }
    for key, value in extra.items():
        if values.get(key) and value is not None and value != values[key]:
            b.set(f"++model.config.{key}", value, values[key], why)
    if f.is_moe:
        _shrink_experts(values, f, degrees["ep"], b)
    if isinstance(values.get("layer_types"), list) and values["layer_types"]:
        types = values["layer_types"]
        b.set("++model.config.layer_types", [types[i % len(types)] for i in range(layers)], None, why)
    if isinstance(values.get("mlp_layer_types"), list) and values["mlp_layer_types"]:  # dense ones come first
        types = values["mlp_layer_types"]
        b.set("++model.config.mlp_layer_types", [types[min(i, len(types) - 1)] for i in range(layers)], None, why)
    for key in ("mlp_only_layers",):
        if values.get(key):
            b.set(f"++model.config.{key}", [i for i in values[key] if i < layers], values[key], why)


def _heads(heads: int, kv_heads: int, tp: int, ulysses_sp: int) -> Tuple[int, int]:
    """Few (heads, K/V heads) with the user's grouping where it fits (at most 4 query heads a K/V head):
    K/V heads divisible by tp, at least 2 where the user has 2; heads divisible by tp x (Ulysses) sp, at
    least 4 where the user has 4."""
    group = heads // max(kv_heads, 1)
    group = max(d for d in range(1, min(group, 4) + 1) if group % d == 0)
    kv = tp * -(-min(kv_heads, 2) // tp)
    while (kv * group) % (tp * ulysses_sp) or kv * group < min(heads, 4):
        kv += tp
    return kv * group, kv


def _shrink_experts(values: Dict[str, Any], f: Any, ep: int, b: _Builder) -> None:
    why = "fewer experts, still divisible by ep, at least top-k"
    top_k = f.experts_per_token
    experts = f.n_experts
    small = ep * max(1, -(-max(4, top_k) // ep))
    groups = values.get("n_group")
    if groups:  # group-limited routing: the groups split the experts, 2 or more each (a group's score sums
        groups = min(int(groups), max(1, small // 2))  # its best two: DeepSeek-V3, GLM-4.5), and hold top-k
        while small % groups:
            groups -= 1
        b.set("++model.config.n_group", groups, values["n_group"], why)
        top_groups = min(int(values.get("topk_group") or 1), groups)
        top_groups = max(top_groups, -(-top_k // (small // groups)))
        b.set("++model.config.topk_group", top_groups, values.get("topk_group"), why)
    if small < experts:
        for key in EXPERTS_KEYS:
            if key in values and values[key]:
                b.set(f"++model.config.{key}", small, experts, why)


# ---- layout, sequence, batch -------------------------------------------------------------------------


def _degrees(v: ValidatedRun, max_processes: int, b: _Builder) -> Dict[str, int]:
    """The user's degrees, or (world > max_processes) each axis over 2 cut to 2, dp first, until it fits."""
    lay = v.layout
    degrees = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "sp": lay.sp, "ep": lay.ep}
    for axis in ("dp", "tp", "pp", "sp"):
        world = degrees["dp"] * degrees["tp"] * degrees["pp"] * degrees["sp"]
        if world <= max_processes:
            break
        if degrees[axis] > 2:
            target = 2
            if axis == "dp":  # ep is carved out of dp x sp
                target = max(2, math.ceil(degrees["ep"] / degrees["sp"]))
            b.changes.append(
                Change(
                    f"parallel.{axis}", degrees[axis], target, f"{world} processes > --max-processes {max_processes}"
                )
            )
            degrees[axis] = target
    if (degrees["dp"] * degrees["sp"]) % degrees["ep"]:
        new_ep = math.gcd(degrees["dp"] * degrees["sp"], degrees["ep"])
        b.changes.append(Change("parallel.ep", degrees["ep"], new_ep, "ep must divide the reduced dp x sp"))
        degrees["ep"] = new_ep
    world = degrees["dp"] * degrees["tp"] * degrees["pp"] * degrees["sp"]
    for axis, value in degrees.items():
        b.set(f"parallel.{axis}", value)
    shard = v.run.parallel.dp_shard
    if shard not in (-1, None) and (degrees["dp"] % shard or shard > degrees["dp"]):
        b.set("parallel.dp_shard", -1, shard, "HSDP's shard group no longer divides the reduced dp")
    if v.run.parallel.pp_layers_per_stage:
        b.set(
            "parallel.pp_layers_per_stage",
            None,
            v.run.parallel.pp_layers_per_stage,
            "the shrunk model's layers split evenly",
        )
    b.set("cluster.devices_per_node", world)
    return degrees


def _sequence(v: ValidatedRun, degrees: Dict[str, int], b: _Builder) -> int:
    seq = v.run.train.seq_len
    short = min(seq, REHEARSAL_SEQ_LEN)
    unit = 2 * degrees["sp"] * degrees["tp"]  # ring's zig-zag halves, Megatron-SP's tp shards
    short = max(unit, short - short % unit)
    if short != seq:
        b.changes.append(Change("train.seq_len", seq, short, "shorter sequences keep CPU steps short"))
        if v.run.data.long_examples == "error":  # the user's examples fit their sequence, maybe not this one
            b.set("data.long_examples", "truncate", "error", "an example longer than the shorter sequence is cut")
    values = merged_kwargs(v.run.model.arch, v.run.model.config or {}, v.run.model.pretrained, load_snapshot())
    window = values.get("sliding_window")
    if window and window < seq:  # keep the window's share of the sequence, so its masks still bite
        scaled = max(1, window * short // seq)
        if scaled != window:
            b.set("++model.config.sliding_window", scaled, window, "the window keeps its share of the shorter sequence")
    return short


def _batch(v: ValidatedRun, degrees: Dict[str, int], b: _Builder) -> None:
    """One-row microbatches (one pair, two rows, under a preference objective): two per pipeline stage under
    pp (every schedule then has work to overlap), two where the user accumulates gradients, else one."""
    pp = degrees["pp"]
    microbatches = 2 * pp if pp > 1 else (2 if v.microbatches > 1 else 1)
    rows, unit = (1, "row") if v.run.train.objective == "lm" else (2, "pair")
    b.set("train.micro_batch_size", rows, v.run.train.micro_batch_size, f"one-{unit} microbatches")
    b.set("train.microbatches", 0)
    b.set("train.global_batch_size", degrees["dp"] * microbatches * rows)


def _cpu_run(v: ValidatedRun, world: int, b: _Builder) -> List[str]:
    """The runs' CPU cluster and fp32; what that leaves unchecked."""
    t, cl = v.run.train, v.run.cluster
    missing = []
    b.set("cluster.nodes", 1)
    b.set("cluster.device", "cpu")
    b.set("cluster.backend", "gloo")
    b.set("cluster.min_nodes", None)
    b.set("train.threads_per_process", 1)
    if cl.device != "cpu" or cl.backend != "gloo":
        missing.append(
            f"cluster.backend={cl.backend} on {cl.device}: the rehearsal runs gloo on CPU processes; NCCL's own "
            "behaviour (its algorithms, timeouts, GPU memory) is not rehearsed"
        )
    if cl.nodes > 1:
        missing.append(f"cluster.nodes={cl.nodes}: one machine's processes stand for the nodes (no network)")
    if t.precision != "fp32":
        b.set("train.precision", "fp32", t.precision, "fp32 on both sides: the comparison is then exact to 1e-5")
        b.set("train.param_dtype", "auto")
        missing.append(
            f"train.precision={t.precision}: rehearsed in fp32 (the layout's arithmetic; 16-bit rounding and loss "
            "scaling are the GPU's)"
        )
    if t.float8:
        b.set("train.float8", False, True, "float8 matmuls need a GPU")
        missing.append("train.float8: torchao's float8 kernels run on GPUs only")
    if t.compile != "false":
        b.set("train.compile", "false")
    return missing


def _no_dropout(v: ValidatedRun, b: _Builder) -> List[str]:
    """Dropout off: its random masks are drawn per rank, so a layout cannot match one process with it on."""
    m = v.run.model
    values = merged_kwargs(m.arch, m.config or {}, m.pretrained, load_snapshot())
    why = "dropout's random masks differ between layouts by design"
    on = {
        f"model.config.{k}": p
        for k, p in sorted(values.items())
        if ("dropout" in k or k.endswith("_pdrop"))
        and not k.startswith(("summary_", "classifier_"))  # heads a causal LM does not have
        and isinstance(p, (int, float))
        and not isinstance(p, bool)
        and p > 0
    }
    for key, p in on.items():
        b.set(f"++{key}", 0.0, p, why)
    if v.run.peft.method != "none" and v.run.peft.dropout > 0:
        on["peft.dropout"] = v.run.peft.dropout
        b.set("peft.dropout", 0.0, v.run.peft.dropout, why)
    if on:
        return [f"dropout ({', '.join(f'{k}={p}' for k, p in on.items())}): rehearsed without it"]
    return []


def summary_lines(plan: RehearsalPlan) -> List[str]:
    """What the dry run and the report say about a rehearsal's runs."""
    if plan.world == 1:
        lines = [
            f"layout run: 1 CPU process, as the layout has no parallel axis; reference: 1 process; {plan.steps} "
            "steps each (the rehearsal still checks its microbatching, its resume and plain transformers' loss)"
        ]
    else:
        lines = [f"layout run: {plan.world} CPU processes (gloo); reference: 1 process; {plan.steps} steps each"]
    if plan.resume_step:
        lines.append(f"the layout's step-{plan.resume_step} checkpoint is resumed under the layout and in one process")
    lines += [f"{c.key}: {c.before} -> {c.after} ({c.why})" for c in plan.changes if c.before != c.after]
    return lines


RUN_ONLY_KEYS = {
    "train": (
        "steps",
        "epochs",
        "run_dir",
        "run_id",
        "eval_every",
        "eval_batches",
        "log_every",
        "threads_per_process",
        "max_restarts",
        "timeout_s",
        "loggers",
        "tracker_project",
        "tracker_run_name",
        "mlflow_tracking_uri",
        "profile_steps",
        "memory_history",
    ),
}
"""Keys that change how long a run goes and what it records, not what a step computes."""


def rehearsal_key(v: ValidatedRun) -> str:
    """A digest of what a rehearsal proves about `v`: its model, data, layout, optimizer, step and
    adapters (not the cluster it runs on, nor how long). A rehearsal records its verdict under it; the dry
    run of the same configuration finds it."""
    run = dataclasses.asdict(v.run)
    kept = {name: run[name] for name in ("model", "parallel", "data", "optim", "train", "peft")}
    for section, keys in RUN_ONLY_KEYS.items():
        kept[section] = {k: val for k, val in kept[section].items() if k not in keys}
    kept["layout"] = {axis: getattr(v.layout, axis) for axis in AXES}
    text = json.dumps(kept, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]

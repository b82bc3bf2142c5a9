"""The estimate's notes in words: one renderer per code of `partrain.blueprint.planner.notes`.

The planner hands over figures ("note_data"); this module writes the sentences the report prints and
the JSON keeps as "notes". Units follow the report: memory in GiB (2**30 bytes), bandwidths in GB/s and
TB/s (10**9, 10**12 bytes/s), peaks in TFLOP/s.
"""

from __future__ import annotations

from typing import Callable, Dict, List

from partrain.blueprint.planner.spec import GB, GIB

MIB = 2**20


def _memory(f: dict) -> str:
    text = (
        f"memory in bytes and GiB (2**30); worst rank is pipeline rank {f['worst_pp_rank']} "
        f"({f['worst_bytes'] / GIB:.2f} GiB of {f['device_bytes'] / GIB:.2f} GiB, {f['usable_fraction']:.0%} usable"
    )
    if "node_bytes" in f:
        text += (
            f"; a CPU node's {f['node_bytes'] / GIB:.2f} GiB (cluster.device_memory_gib)"
            f" shared by its {f['processes']} processes"
        )
    return text + ")"


def _accounting_paper(_: dict) -> str:
    return (
        "paper accounting (--accounting paper): 16-bit states counted as ZeRO/Megatron do (2+2+12 "
        "bytes/param); partrain's runtime keeps fp32 weights under torch.autocast (4+4+8, plus 16-bit "
        "weight copies per in-flight microbatch), which the default --accounting runtime counts"
    )


def _accounting_master(f: dict) -> str:
    return (
        "runtime accounting: 16-bit parameters (train.param_dtype), an fp32 gradient buffer and fp32 master "
        f"weights + Adam state (2+4+12 bytes/param, the 12 sharded over {f['optimizer_shards']}"
        " rank(s)); no autocast copies"
    )


def _accounting_fsdp(f: dict) -> str:
    p, g, o = f["bytes_per_param"]
    return (
        f"runtime accounting: fp32 sharded weights and gradients ({p}+{g}+{o} bytes/param); "
        "FSDP2's mixed-precision policy gathers 16-bit weights and computes with them (no autocast copies)"
    )


def _accounting_autocast(f: dict) -> str:
    p, g, o = f["bytes_per_param"]
    return (
        f"runtime accounting: fp32 weights and gradients under autocast ({p}+{g}+{o} "
        "bytes/param) and a 16-bit copy of each weight saved per in-flight microbatch"
    )


def _context_parallel(f: dict) -> str:
    over = "dp_shard (partrain's ZeRO-1 optimizer shards over dp only)" if f["zero1"] else "dp_shard x sp"
    return (
        f"context parallel ({f['sp_mode']}): weights replicated over sp; model state sharded over {over}; "
        "activations of seq/sp tokens per rank"
    )


def _expert_parallel(f: dict) -> str:
    return (
        f"expert parallel: {f['local_experts']} of {f['experts']} experts per rank, their "
        f"states sharded over their {f['expert_shard']} replica(s) in dp x sp, gradients reduced over "
        f"edp = {f['edp']} ranks; all-to-all (dispatch + combine, forward + backward) at the ep link "
        f"({f['link']})"
    )


def _latent_attention(f: dict) -> str:
    return (
        f"latent attention: its activation memory and FLOPs are approximate (counted as heads of {f['head_dim']} "
        f"for queries, keys and values; its values are {f['v_head_dim']} wide and its latents are not counted); "
        "parameters are exact"
    )


def _moe_routing(f: dict) -> str:
    cf, slots = f["capacity_factor"], f["capacity_per_expert"]
    how = "dropless" if cf is None else f"capacity factor {cf:g}, {slots} slots per expert per rank and microbatch"
    return (
        f"MoE routing: {how}; expected volumes assume balanced routing (the dropped share is unknown before training)"
    )


def _comm(f: dict) -> str:
    if not f["measured"]:
        return "communication at the cluster's link speeds"
    text = f"communication at the bus bandwidths measured per op in {f['profile']}"
    if f["nominal_inter_bw"] is not None:
        text += (
            f"; inter-node links at the nominal cluster.inter_node_gbps ({f['nominal_inter_bw'] / GB:g} GB/s): "
            "the profile has no inter-node measurement (measured on one node)"
        )
    return text


def _compute_nominal(f: dict) -> str:
    return f"compute at {f['efficiency']:.0%} of peak {f['peak_flops'] / 1e12:g} TFLOP/s; {_comm(f['comm'])}"


def _compute_profile(f: dict) -> str:
    worst = f["layer_fit_worst_error"]
    warn = f" (WARNING: it reproduces the profile's layer times only within {worst:.0%})" if worst > 0.2 else ""
    fwd, bwd = f["host_s_per_op"]
    return (
        f"compute timed from the profile {f['profile']} ({f['device']}, {f['dtype']}): matmuls at the measured "
        f"rates by shape (saturating fit, peak {f['gemm_peak_flops'] / 1e12:.3g} TFLOP/s), attention at "
        f"{f['attn_fraction']:.2f} x that, elementwise bytes at {f['bw_fraction']:.0%} of "
        f"{f['bandwidth_bytes_per_s'] / 1e12:.3g} TB/s, host {fwd * 1e6:.1f} / {bwd * 1e6:.1f} us per op forward / "
        f"backward, and the optimizer update{warn}; {_comm(f['comm'])}"
    )


def _cpu_shared_cores(f: dict) -> str:
    counted = ["kernels"]
    if f["host_block"]:
        counted.append("the per-tensor optimizer and clip" + (" and the TP wrappers" if f["tp_wrappers"] else ""))
    counted.append("collective calls" if f["collective_cpu"] else "no collective CPU (the comm profile has none)")
    missing = "" if f["host_block"] else " (the compute profile has no host block: measure it again)"
    scaled = ""
    if f["rank_steps_layout"] is not None:
        scaled = f"; each rank's own work x{f['factor']:.2f}, the real rank steps of {f['rank_steps_layout']} measured"
        scaled += " all at once by bench compute over their count"
    bound = f"; it adds {f['cpu_shared_s']:.3g} s to the critical path" if f["cpu_shared_s"] > 0 else ""
    return (
        f"{f['processes']} processes per node share {f['cores']} CPU cores: the step is at least their CPU work "
        f"over the cores ({', '.join(counted)}{missing}){scaled}{bound}. A lower bound: ranks also wait for "
        "partners that are not scheduled"
    )


def _process(f: dict) -> str:
    source = (
        f"measured by the compute profile {f['profile']}"
        if f["profile"]
        else "nominal (torch 2.13 CPU, transformers 5)"
    )
    return (
        f"process: {f['bytes'] / MIB:.0f} MiB per rank that a CPU process holds beyond its tensors: the interpreter, "
        f"torch, transformers, partrain and the library code its steps run ({source}), and the heap glibc keeps "
        f"after freeing tensors ({f['heap_fixed_bytes'] / MIB:.0f} MiB + {f['heap_per_transient_byte']:g}x the "
        "activations and transients, an empirical rule)"
    )


def _does_not_fit(f: dict) -> str:
    return f"does not fit: needs {f['needs_bytes'] / GIB:.2f} GiB, usable {f['usable_bytes'] / GIB:.2f} GiB"


RENDERERS: Dict[str, Callable[[dict], str]] = {
    "memory": _memory,
    "accounting_paper": _accounting_paper,
    "accounting_master": _accounting_master,
    "accounting_fsdp": _accounting_fsdp,
    "accounting_autocast": _accounting_autocast,
    "context_parallel": _context_parallel,
    "expert_parallel": _expert_parallel,
    "latent_attention": _latent_attention,
    "moe_routing": _moe_routing,
    "compute_nominal": _compute_nominal,
    "compute_profile": _compute_profile,
    "cpu_shared_cores": _cpu_shared_cores,
    "process": _process,
    "does_not_fit": _does_not_fit,
}
"""Note code -> its sentence."""


def note_text(note: dict) -> str:
    """One note ({"code", "figures"}) in words; a code this version does not know, as its figures."""
    render = RENDERERS.get(note["code"])
    return render(note["figures"]) if render else f"{note['code']}: {note['figures']}"


def note_texts(est: dict) -> List[str]:
    """The estimate's notes in words, in the planner's order."""
    return [note_text(n) for n in est.get("note_data", [])]


def word_notes(est: dict) -> dict:
    """Set the estimate's "notes" (its words, what the JSON report carries beside "note_data"); returns it."""
    if "note_data" in est:
        est["notes"] = note_texts(est)
    return est

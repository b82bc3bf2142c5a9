"""What a training process holds on a CPU device beyond its tensors: the memory term "process".

On a GPU the planner counts tensors: the interpreter, torch, transformers and their code live in host
memory, and the CUDA context sits in the margin USABLE_MEMORY_FRACTION leaves. On a CPU the process
itself is on the device. Its resident memory (what the OS charges and an OOM kill counts, the "mem"
of the progress line) also holds:

- the runtime: the Python interpreter with torch, transformers (with the model's module), partrain
  and the process group, before the model's first tensor. It is about 350 MiB whatever the model's
  size, so for small models on CPU it is most of the process.
- the library code the steps run, paged in on first use (torch's CPU kernels, about 16 MiB).

`partrain bench compute` measures both on the machine that runs it (the profile's "process" block).
Without a profile, or with one that predates the block, the nominal figures below stand in. They were
measured with torch 2.13 (CPU) and transformers 5 on partrain's 2-core reference machine.

Not counted: what glibc's heap keeps after tensors are freed. It was measured at 1.6-4x the planned
activations of the same run, with no rule that held across pipeline stages (issue 15's notes).
"""

from __future__ import annotations

from typing import Optional, Tuple

from partrain.blueprint.planner.compute_model import ComputeModel

MIB = 2**20

NOMINAL_RUNTIME_BYTES = 350 * MIB
"""Resident bytes of a partrain worker before its model is built (torch 2.13 CPU, transformers 5;
measured: 348-352 MiB on gpt-dp's ranks)."""

NOMINAL_CODE_BYTES = 16 * MIB
"""Library code a CPU worker's steps page in after that (measured: 14-18 MiB of file-backed RSS)."""


def process_terms(device: str, model: Optional[ComputeModel]) -> Tuple[float, str]:
    """(bytes, where they come from) of the "process" term on one rank: 0 off CPU."""
    if device != "cpu":
        return 0.0, "none"
    if model is not None and model.device == "cpu" and model.process_bytes[0] > 0:
        runtime, code = model.process_bytes
        return runtime + code, f"measured by the compute profile {model.source}"
    return float(NOMINAL_RUNTIME_BYTES + NOMINAL_CODE_BYTES), "nominal (torch 2.13 CPU, transformers 5)"


def process_note(nbytes: float, source: str) -> str:
    """The report's line on the term (CPU only)."""
    return (
        f"process: {nbytes / MIB:.0f} MiB per rank that a CPU process holds beyond its tensors (the interpreter, "
        f"torch, transformers, partrain and the library code its steps run; {source}); the heap glibc keeps "
        "after freeing tensors is not counted"
    )


def oversubscribed_note(model: Optional[ComputeModel], processes_per_node: int) -> Optional[str]:
    """A warning when a CPU profile's cores are fewer than the ranks of a node (None otherwise).

    The compute model scales matmul and layer time by the share of a core each rank gets, but on such a layout
    a rank's CPU time is mostly per-call work the model does not count: DTensor dispatch around TP layers, gloo
    copying and waking for every collective, the per-tensor optimizer, gradient clipping. Measured for gpt-3d
    (8 ranks on 2 cores): 0.14 CPU-s per rank and step against 0.02 s of modelled compute; tokens/s 0.47x the plan."""
    if model is None or model.device != "cpu" or not model.cores or processes_per_node <= model.cores:
        return None
    return (
        f"{processes_per_node} processes per node share {model.cores} CPU cores: the step time is a lower bound "
        "(per-call CPU work of collectives, DTensor dispatch and the per-tensor optimizer is not modelled; "
        "gpt-3d, 8 ranks on 2 cores, measured 0.47x the planned tokens/s)"
    )

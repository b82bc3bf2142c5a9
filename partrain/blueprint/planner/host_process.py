"""What a training process holds on a CPU device beyond its tensors: the memory term "process".

On a GPU the planner counts tensors: the interpreter, torch, transformers and their code live in host
memory, and the CUDA context sits in the margin USABLE_MEMORY_FRACTION leaves. On a CPU the process
itself is on the device. Its resident memory (what the OS charges and an OOM kill counts, the "mem"
of the progress line) also holds:

- the runtime: the Python interpreter with torch, transformers (with the model's module), partrain
  and the process group, before the model's first tensor. It is about 350 MiB whatever the model's
  size, so for small models on CPU it is most of the process.
- the library code the steps run, paged in on first use (torch's CPU kernels, about 16 MiB);
- the heap glibc keeps after tensors are freed: its adaptive mmap threshold serves activation-sized
  buffers from the heap after the first step, and freed chunks there stay resident and fragment.

`partrain bench compute` measures the first two on the machine that runs it (the profile's "process"
block). Without a profile, or with one that predates the block, the nominal figures below stand in.
They were measured with torch 2.13 (CPU) and transformers 5 on partrain's 2-core reference machine.
The heap is an empirical rule, HEAP_FIXED_BYTES + HEAP_PER_TRANSIENT_BYTE x (activations + transients):
fitted to the peak RSS of 7 pipeline stages of the CPU recipes gpt-dp, gpt-3d, llama-fsdp-tp,
mixtral-ep, llama-long-sp and llama-long-ring: their whole peak RSS then came within 0.99-1.04 of
the plan (1.04-1.26 without the heap term). Three layouts left out of the fit (gpt-dp under ZeRO-3,
gpt-dp at micro 8 x seq 256, llama-fsdp-tp at seq 256) came within 0.89-1.03 (by rank): the heap grows less
than linearly with large activations (123.7 MiB planned kept 86.7 MiB).
"""

from __future__ import annotations

from typing import Optional

from partrain.blueprint.planner.compute_model import ComputeModel

MIB = 2**20

NOMINAL_RUNTIME_BYTES = 350 * MIB
"""Resident bytes of a partrain worker before its model is built (torch 2.13 CPU, transformers 5;
measured: 348-352 MiB on gpt-dp's ranks)."""

NOMINAL_CODE_BYTES = 16 * MIB
"""Library code a CPU worker's steps page in after that (measured: 13-18 MiB of file-backed RSS)."""

HEAP_FIXED_BYTES = 12 * MIB
"""The heap glibc keeps whatever the activations (the module docstring's fit)."""

HEAP_PER_TRANSIENT_BYTE = 1.0
"""Heap glibc keeps per byte of the rank's planned activations and transients (the module docstring's fit)."""


def _measured(model: Optional[ComputeModel]) -> bool:
    return model is not None and model.device == "cpu" and model.process_bytes[0] > 0


def process_bytes(device: str, model: Optional[ComputeModel], transient_bytes: float) -> float:
    """The "process" term of one rank whose activations and transients are `transient_bytes`: 0 off CPU."""
    if device != "cpu":
        return 0.0
    runtime, code = model.process_bytes if _measured(model) else (NOMINAL_RUNTIME_BYTES, NOMINAL_CODE_BYTES)
    return runtime + code + HEAP_FIXED_BYTES + HEAP_PER_TRANSIENT_BYTE * transient_bytes


def process_note(nbytes: float, model: Optional[ComputeModel]) -> str:
    """The report's line on the term (CPU only): what it holds and where its figures come from."""
    source = (
        f"measured by the compute profile {model.source}"
        if _measured(model)
        else "nominal (torch 2.13 CPU, transformers 5)"
    )
    return (
        f"process: {nbytes / MIB:.0f} MiB per rank that a CPU process holds beyond its tensors: the interpreter, "
        f"torch, transformers, partrain and the library code its steps run ({source}), and the heap glibc keeps "
        f"after freeing tensors ({HEAP_FIXED_BYTES / MIB:.0f} MiB + {HEAP_PER_TRANSIENT_BYTE:g}x the activations "
        "and transients, an empirical rule)"
    )

"""The GPUs of the machine a command runs on, and what they make of the default cluster.

The default cluster, `local-cpu`, describes this machine as CPU processes over gloo. On a machine with
GPUs that default would train a GPU user's model on the CPU, so composing with the machine's GPUs
(`LocalGpus`, found by the CLI with `nvidia-smi`; tests pass their own) turns it into `local-gpu`:
cuda, nccl, the GPUs' memory, and one process per GPU unless the recipe or the command line gives
the count. Naming a cluster (`cluster=local-cpu`, `cluster=h100x8`) or `cluster.device` keeps what is
named: the CPU default stays as it is wherever no GPU is found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple


@dataclass(frozen=True)
class LocalGpus:
    """The GPUs `nvidia-smi` lists on this machine (count 0: none, or no NVIDIA driver)."""

    count: int = 0
    """How many GPUs the machine has."""
    memory_gib: float = 0.0
    """Memory of the smallest one, GiB."""
    name: str = ""
    """The first one's product name (NVIDIA H100 80GB HBM3)."""


NO_GPUS = LocalGpus()

NVIDIA_SMI_QUERY = ("nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits")
"""The query whose output `parse_nvidia_smi` reads: one `name, MiB` line per GPU."""

GPU_FIGURES: Dict[str, Tuple[float, float]] = {
    "H200": (989.0, 450.0),
    "H100": (989.0, 450.0),
    "A100": (312.0, 300.0),
    "L40S": (362.0, 32.0),
    "L4": (121.0, 32.0),
}
"""Product-name word -> (bf16 dense peak TFLOP/s, per-direction GB/s between two GPUs of a node), the
figures the planner's nominal times use."""

UNLISTED_GPU_FIGURES = (100.0, 32.0)
"""A GPU not in GPU_FIGURES: a round peak and a PCIe 5 x16 link, so its plan is of the right order (the
CPU cluster's 0.1 TFLOP/s would not be); `cluster.peak_tflops` and `cluster.intra_node_gbps` set them."""


def parse_nvidia_smi(text: str) -> LocalGpus:
    """LocalGpus from NVIDIA_SMI_QUERY's output; NO_GPUS for output that is not one `name, MiB` a line."""
    rows = []
    for line in text.strip().splitlines():
        name, _, mib = line.rpartition(",")
        try:
            rows.append((name.strip(), float(mib)))
        except ValueError:
            return NO_GPUS
    if not rows or not all(name for name, _ in rows):
        return NO_GPUS
    return LocalGpus(count=len(rows), memory_gib=round(min(m for _, m in rows) / 1024, 1), name=rows[0][0])


def gpu_figures(name: str) -> Tuple[float, float]:
    """GPU_FIGURES's entry for a product name (the first listed word it contains), else UNLISTED_GPU_FIGURES."""
    words = name.upper().replace("-", " ").split()
    return next((figures for key, figures in GPU_FIGURES.items() if key in words), UNLISTED_GPU_FIGURES)


def local_gpu_cluster(cluster: dict, gpus: LocalGpus, count_given: bool) -> dict:
    """The default cluster's keys on a machine with `gpus`: cuda and nccl, their memory, one process a GPU
    unless `count_given` (a recipe's or the command line's cluster.devices_per_node), their peak and link
    speed (gpu_figures)."""
    out = dict(cluster, name="local-gpu", device="cuda", backend="nccl", device_memory_gib=gpus.memory_gib)
    if not count_given:
        out["devices_per_node"] = gpus.count
    out["peak_tflops"], out["intra_node_gbps"] = gpu_figures(gpus.name)
    return out

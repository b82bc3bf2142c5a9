"""What the best trainers set on CUDA (issue 16, part 5), in one place; nothing here changes CPU runs.

- TF32 for fp32 matmuls and convolutions: fp32 weights (the optimizer's, fp32 runs) multiply on
  tensor cores with a 10-bit mantissa, as torchtitan and Megatron do; bf16/fp16 compute is unaffected.
- NCCL async error handling: a rank whose collective failed or timed out tears the job down
  instead of hanging the others (torch's default on recent versions; set explicitly for older ones).
- Batches copied from pinned host memory without blocking, so the copy overlaps the previous step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Mapping

if TYPE_CHECKING:  # the launcher imports this module: no torch at import time
    import torch

NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
"""Environment the launcher gives NCCL workers (a value the user set wins)."""


def worker_env(environ: Mapping[str, str], backend: str) -> Dict[str, str]:
    """`environ` plus the NCCL defaults when the backend is nccl (the user's own values win)."""
    out = dict(environ)
    if backend == "nccl":
        for key, value in NCCL_ENV.items():
            out.setdefault(key, value)
    return out


def apply_device_defaults(device: "torch.device") -> None:
    """TF32 matmuls on CUDA; nothing on other devices."""
    if device.type != "cuda":
        return
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def to_device(t: "torch.Tensor", device: "torch.device") -> "torch.Tensor":
    """A host batch on `device`: pinned + non-blocking on CUDA (overlaps compute), a plain copy elsewhere."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)

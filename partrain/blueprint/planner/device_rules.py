"""Where the CUDA path keeps other tensors than the CPU path, for the activation counts of memory.py.

torch.autocast casts by per-device op lists. On CUDA, `pow`, `softmax`, `log_softmax`, `layer_norm`
and the like run in fp32 whatever their input; on CPU they run in the input's dtype. SDPA on CUDA
(flash or memory-efficient kernel) saves q, k, v, the output and an fp32 log-sum-exp per query
head and token, as the CPU kernels do, so attention needs no device rule; grouped-query K/V reach
the kernel unrepeated on both (calib: `tests/fixtures/gpu_h200_calib.jsonl`, Llama rows, exact).

The one rule the H200 measurements show (GPT-2 rows: 6 x ffn bytes per token and layer more than
on CPU) is GPT-2's tanh-GELU (`gelu_new`, written in Python as
0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * pow(x, 3))))): CUDA autocast runs `pow` in fp32,
so everything after it is fp32 and autograd keeps
- the fp32 copy of x (pow's input), tanh's fp32 output, the fp32 factor (1 + tanh): 3 x 4 bytes;
- 0.5 * x (compute dtype) and the 16-bit cast of the fp32 product that the down projection takes:
  2 x compute bytes;
where the CPU path keeps the same five tensors all in the compute dtype. Only under autocast: with
16-bit weights and no autocast (mixed="zero", Megatron style) every op runs in 16 bits on both.
"""

from __future__ import annotations


def cuda_autocast(device: str, autocast_copies: bool) -> bool:
    """Whether the layer runs under torch.autocast on a CUDA device (its fp32 op list applies)."""
    return device == "cuda" and autocast_copies


def gelu_saved_per_element(activation: str, compute: int, on_cuda_autocast: bool) -> int:
    """Bytes autograd keeps per MLP-intermediate element for GPT-2's activation (see module docstring):
    gelu_new keeps 5 tensors, fp32 from `pow` on under CUDA autocast; gelu/others keep their
    input and the down projection's input (2 tensors in the compute dtype)."""
    if activation != "gelu_new":
        return 2 * compute
    if on_cuda_autocast:
        return 3 * 4 + 2 * compute
    return 5 * compute

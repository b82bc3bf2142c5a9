"""Which model family is verified under which parallel layout: the parity matrix as data.

tests/test_family_parity.py trains every (family, layout) cell below for real against one process
of the same model, data and seed, and docs/families.md is rendered from the same data
(`python -m partrain.blueprint.families.support > docs/families.md`; tests/test_docs.py checks it is
current), so the page cannot claim a cell the suite does not run. The MoE families (mixtral,
qwen2_moe, qwen3_moe, gpt_oss, deepseek_v3) are verified under expert-parallel layouts by
tests/test_expert_parallel.py and tests/test_tensor_parallel.py; gpt_oss and deepseek_v3 are also rows
here, at ep=1.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from partrain.blueprint.families.generic import GENERIC_BASES, SNAPSHOT
from partrain.blueprint.families.generic_moe import GENERIC_MOE_RECORDS
from partrain.blueprint.families.generic_template import TEMPLATE_RECORDS

PARITY_STEPS = 2
"""Steps of every cell: the first compares the forward and the backward, the second the update that
followed (optimizer state included); more steps on the 2-core CI machine buy no other check."""

PARITY_LAYOUTS: Dict[str, Tuple[str, ...]] = {
    "ddp2": ("parallel.dp=2",),
    "fsdp2": ("parallel.dp=2", "parallel.zero_stage=3"),
    "tp2": ("parallel.tp=2",),
    "tp2-megatron-sp": ("parallel.tp=2", "parallel.tp_sequence_parallel=true"),
    "pp2-1f1b": ("parallel.pp=2", "parallel.pp_schedule=1f1b"),
    "sp2-ulysses": ("parallel.sp=2", "parallel.sp_mode=ulysses"),
    "sp2-ring": ("parallel.sp=2", "parallel.sp_mode=ring"),
    "lora-tp2": ("parallel.tp=2", "peft=lora"),
    "ddp2-chunked-loss": ("parallel.dp=2", "train.loss_chunk_tokens=32"),
    "pp2-chunked-loss": ("parallel.pp=2", "train.loss_chunk_tokens=32"),
}
"""Layout -> its overrides; each runs on 2 processes."""

PARITY_FAMILIES: Dict[str, Tuple[str, ...]] = {
    "llama": ("model=llama-tiny",),
    "qwen2": ("model=qwen2-tiny",),
    "qwen3": ("model=qwen3-tiny",),
    "mistral": ("model=mistral-tiny", "model.config.sliding_window=32"),
    "smollm3": ("model=smollm3-tiny",),
    "granite": ("model=granite-tiny",),
    "gemma2": (
        "model=gemma2-tiny",
        "model.config.sliding_window=64",
        "model.config.attn_logit_softcapping=0.5",
        "model.config.final_logit_softcapping=0.5",
    ),
    "gemma3_text": ("model=gemma3-tiny",),
    "olmo2": ("model=olmo2-tiny",),
    "phi3": ("model=phi3-tiny", "model.config.sliding_window=32"),
    "glm4": ("model=glm4-tiny",),
    "cohere2": ("model=cohere2-tiny",),
    "gpt2": ("model=gpt2-tiny",),
    "olmo3": ("model=olmo2-tiny", "model.arch=olmo3"),
    "seed_oss": (
        "model=qwen2-tiny",
        "model.arch=seed_oss",
        "model.config.head_dim=32",
        "model.config.attention_dropout=0.0",
        "model.config.residual_dropout=0.0",
    ),
    "gpt_oss": ("model=gpt-oss-tiny",),
    "deepseek_v3": ("model=deepseek-v3-tiny",),
    "glm4_moe": ("model=glm4-moe-tiny",),
    "phi": ("model=phi-tiny",),
    "gemma": (
        "model=llama-tiny",
        "model.arch=gemma",
        "model.config.head_dim=32",
        "model.config.tie_word_embeddings=true",
    ),
}
"""HF model_type -> the overrides of its tiny model (conf/model/); Mistral with a sliding window shorter
than the test's sequence, so its window masks are exercised; Gemma 2 with one as long as the sequence,
so that its capped attention scores run under Ulysses (Gemma 3 exercises the same window masks), and
caps low enough to bend a tiny model's scores and logits (a missing cap moves the loss by percents)."""

SP_WINDOW = "sequence parallelism needs a sliding window of at least train.seq_len (model.config.sliding_window)"
RING_SOFTCAP = "ring attention does not cap attention scores (model.config.attn_logit_softcapping)"
RING_SINKS = "ring attention does not add attention sink logits (parallel.sp_mode)"
TP_GATHERED = (
    "Megatron-SP is not derived where transformers' tp plan gathers column projections' outputs "
    "(parallel.tp_sequence_parallel)"
)
TP_WHOLE_ATTENTION = (
    "Megatron-SP is not derived where transformers' tp plan keeps attention whole (parallel.tp_sequence_parallel)"
)
TP_TEMPLATE = (
    "Megatron-SP is not derived where a template family's row projections are not o_proj / down_proj "
    "(parallel.tp_sequence_parallel)"
)
PARITY_REFUSED: Dict[Tuple[str, str], str] = {
    ("mistral", "sp2-ulysses"): SP_WINDOW,
    ("mistral", "sp2-ring"): SP_WINDOW,
    ("gemma2", "sp2-ring"): RING_SOFTCAP,
    ("gemma3_text", "sp2-ulysses"): SP_WINDOW,
    ("gemma3_text", "sp2-ring"): SP_WINDOW,
    ("olmo2", "tp2-megatron-sp"): TP_GATHERED,
    ("olmo3", "tp2-megatron-sp"): TP_GATHERED,
    ("phi3", "sp2-ulysses"): SP_WINDOW,
    ("phi3", "sp2-ring"): SP_WINDOW,
    ("phi3", "tp2-megatron-sp"): TP_GATHERED,
    ("glm4", "tp2-megatron-sp"): TP_GATHERED,
    ("gpt_oss", "tp2-megatron-sp"): TP_WHOLE_ATTENTION,
    ("deepseek_v3", "tp2-megatron-sp"): TP_WHOLE_ATTENTION,
    ("gpt_oss", "sp2-ulysses"): SP_WINDOW,
    ("gpt_oss", "sp2-ring"): RING_SINKS,
    ("cohere2", "sp2-ulysses"): SP_WINDOW,
    ("cohere2", "sp2-ring"): SP_WINDOW,
    ("phi", "tp2-megatron-sp"): TP_TEMPLATE,
}
"""(family, layout) cells refused before launch (exit 2), with the reason; the test checks each is."""

FAMILY_NOTES: Dict[str, str] = {
    "llama": "grouped-query attention",
    "qwen2": "q/k/v biases",
    "qwen3": "per-head q/k norms (replicated over tp, gradients summed)",
    "mistral": "sliding-window attention",
    "smollm3": "rotary skipped on every 4th layer; tied embeddings",
    "granite": "embedding, residual, attention and logits multipliers",
    "gemma2": "attention scores and logits capped by tanh (eager attention); four norms a layer; scaled tied embedding",
    "gemma3_text": "q/k norms, four norms a layer, scaled tied embeddings, local and global layers (own rotary bases)",
    "olmo2": "q/k norms over the whole projections (tp gathers q, k and v: transformers' plan); post-norms",
    "phi3": "fused qkv_proj and gate_up_proj (tp gathers their outputs: transformers' plan); sliding window",
    "glm4": "fused gate_up_proj (tp gathers its output); four norms a layer; partial rotary; q/k/v biases",
    "cohere2": "parallel attention and MLP on one LayerNorm; logit scale; tied embeddings; local and global layers",
    "gpt2": "fused q/k/v (Conv1D, partrain's own tp plan); learned positions; tied embeddings",
    "olmo3": "generic path on OLMo 2's tensors: local and global layers inside transformers' forward",
    "seed_oss": "generic path on Qwen2's tensors (q/k/v biases)",
    "gpt_oss": (
        "MoE (4 experts, top-2, ep=1 here) with biased transposed experts and a clamped SwiGLU; attention sinks; "
        "local and global layers"
    ),
    "deepseek_v3": (
        "multi-head latent attention; a dense layer, then 4 routed experts (top-2 of the best group, sigmoid"
        " router) beside a shared expert (ep=1 here)"
    ),
    "glm4_moe": (
        "generic MoE path: a dense layer, then 4 routed experts (top-2 of the best group, sigmoid router with a "
        "selection bias) beside a shared expert (ep=1 here); q/k/v biases, partial rotary"
    ),
    "phi": (
        "template path: attention and MLP in parallel on one LayerNorm with biases, partial rotary, GELU fc1/fc2, "
        "a head bias (Megatron-SP refused: its plan's row projections are dense and fc2)"
    ),
    "gemma": "generic path: scaled tied embedding, (1 + w) norms and a GELU MLP inside transformers' forward",
}
"""What each family's row exercises beyond Llama."""


def render() -> str:
    """docs/families.md: the family x layout matrix."""
    header = "| family | what it exercises | " + " | ".join(f"`{name}`" for name in PARITY_LAYOUTS) + " |"
    rule = "|---|---|" + "---|" * len(PARITY_LAYOUTS)
    rows = [
        f"| `{arch}` | {FAMILY_NOTES[arch]} | "
        + " | ".join("refused" if (arch, name) in PARITY_REFUSED else "verified" for name in PARITY_LAYOUTS)
        + " |"
        for arch in PARITY_FAMILIES
    ]
    refused = [f"- `{arch}` under `{name}`: {why}" for (arch, name), why in PARITY_REFUSED.items()]
    layouts = [f"- `{name}`: `{' '.join(overrides)}`" for name, overrides in PARITY_LAYOUTS.items()]
    return "\n".join(
        [
            "# Model families",
            "",
            "<!-- generated by `python -m partrain.blueprint.families.support > docs/families.md`;"
            " tests/test_docs.py checks it -->",
            "",
            "A family is `model.arch` (the Hugging Face `model_type`; a pretrained folder's `config.json`"
            " gives it). Every family below is trained by partrain's test suite under each layout,"
            f" {PARITY_STEPS} steps in fp32 on 2 CPU processes (gloo), against one process of the same model,"
            " data and seed running transformers' own forward: losses and gradient norms agree within 1e-5"
            " relative. *verified* means exactly that"
            " check; a family or layout not in the table has not been checked this way.",
            "",
            header,
            rule,
            *rows,
            "",
            "*refused*: exit 2 before any process starts, naming the key (the suite checks that too):",
            "",
            *refused,
            "",
            "The layouts (on top of fp32, 4 one-row microbatches of 64 tokens a step):",
            "",
            *layouts,
            "",
            "`gpt_oss`, `deepseek_v3` and `glm4_moe` are mixture-of-experts families: their rows run at"
            " `parallel.ep=1` (every"
            " rank holds every expert). The MoE families (`mixtral`, `qwen2_moe`, `qwen3_moe`, `gpt_oss`,"
            " `deepseek_v3`) are verified under expert"
            " parallelism and its combinations in [Expert parallelism](parallel/expert.md).",
            "",
            *_generic_paths(),
            "Any other `model_type` is refused before launch (exit 2, naming `model.arch`, or the pretrained"
            " folder's `config.json`, and the supported families).",
            "",
        ]
    )


def _generic_paths() -> List[str]:
    """docs/families.md's sections on the generic, generic MoE and template paths."""
    return [
        "## The generic path",
        "",
        "A family without a file of its own is trained when transformers builds it exactly as a verified"
        " family (its base: `llama`, `qwen2`, `qwen3` or `olmo2`): partrain built every causal-LM family of"
        " transformers " + _transformers_version() + " and kept those whose parameters are their base's"
        " (names and shapes), whose logits are the head applied to the base model's output, and which ship"
        " a tensor-parallel plan. Each runs transformers' own forward under dp, ZeRO/FSDP, tp (transformers'"
        " plan; Megatron-SP where its base has it), sp (through transformers' attention interface; a sliding"
        " window shorter than the sequence is refused) and LoRA. Pipeline parallelism replaces the base"
        " model's forward with partrain's own loop over the layers: it runs for the families whose forward"
        " that loop reproduces exactly on a tiny model (today all below) and is refused for the others"
        " (exit 2). `gemma`, `olmo3` and `seed_oss`"
        " above are checked as every family is. The families on this path, with their base:",
        "",
        ", ".join(f"`{arch}` ({base})" for arch, base in GENERIC_BASES.items()) + ".",
        "",
        "## The generic MoE path",
        "",
        "A mixture-of-experts family without a file of its own is trained when transformers builds it as a"
        " base (`llama` or `qwen3`) whose MLP is, in some layers, an MoE block around transformers' fused"
        " experts module (named by the config class's `base_model_ep_plan`): partrain built every MoE family"
        " at two sizes and kept those whose tensors outside that block are the base's and whose block's"
        " tensors it can name (routed experts, router, shared experts), whose router returns the router"
        " logits, whose `save_pretrained` folders it loads, and whose logits are the head applied to the"
        " base model's output. The routing runs in transformers' own block; partrain replaces only the"
        " experts module (expert parallelism), and the suite checks that the swap gives transformers' logits"
        " for each. They take every layout the dense generic path takes, and `parallel.ep`. `glm4_moe`"
        " above is checked as every family is. The families on this path, with their base:",
        "",
        ", ".join(f"`{arch}` ({r.base})" for arch, r in GENERIC_MOE_RECORDS.items()) + ".",
        "",
        "## The template path",
        "",
        "A dense family like none of the bases is trained from what partrain recorded of it: its every"
        " parameter as a name and a shape in symbols (hidden, vocabulary, MLP width, query and key/value"
        " widths, head width), the same at two sizes and equal to the meta-built model's, its module paths"
        " (embeddings, final norm, rotary, a layer's attention, MLP and norms) and the dimension transformers'"
        " tp plan splits in each tensor. A family qualifies when its config class ships a tp plan, its base"
        " model is at `model` with its layers at `model.layers`, and its logits are the head applied to the"
        " base model's output. A boolean config field that changes its tensors is held at the value"
        " recorded (another is exit 2, naming the key). It runs transformers' own forward under dp, ZeRO/FSDP,"
        " tp, sp (where its attention goes through transformers' attention interface), LoRA and pp (where"
        " partrain's stages reproduce it); Megatron-SP where its row projections are `o_proj` and"
        " `down_proj`. Its memory and FLOPs figures are Llama's formulas (approximate); its parameter counts"
        " are exact. `phi` above is checked as every family is. The families on this path:",
        "",
        ", ".join(f"`{arch}`" for arch in TEMPLATE_RECORDS) + ".",
        "",
    ]


def _transformers_version() -> str:
    import json

    return str(json.loads(SNAPSHOT.read_text()).get("transformers_version", ""))


if __name__ == "__main__":
    print(render(), end="")

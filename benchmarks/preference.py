"""Preference tuning against the SFT step of the same model: tokens/s and memory, one invocation.

    python benchmarks/preference.py               # 6 runs, 1 process, 12 steps each (about 4 min on 2 cores)
    python benchmarks/preference.py --steps 8 --procs 2

Model: a Llama from config (hidden 384, 4 layers, 6 heads / 2 KV heads, MLP 1024, byte vocabulary: 6.5M
parameters), sequence 128, micro batch 8 rows, global batch 16 rows, fp32, AdamW. Six runs through
`partrain train`:

- sft-lora: chat SFT (`data.source=builtin-chat`, one padded chat per row) with LoRA r 8;
- dpo-lora: `recipe=dpo-lora`'s objective on `builtin-preference` (8 pairs a step), the reference being the
  adapters switched off: one extra forward without gradients per microbatch, no second copy of the model;
- sft-full, dpo-full and simpo-full: the same without LoRA; dpo-full's reference is the table of the starting
  model's log-probabilities computed once before step 1 (partrain.train.reference_logps), SimPO needs none;
- dpo-copy: full fine-tuning DPO whose reference is a frozen copy of the starting model
  (train.preference_reference=copy): its parameters held again, one more forward per microbatch.

Printed per run: tokens/s (16 x 128 / the median step time, first 3 steps dropped), model state per rank
(parameters + gradients + optimizer state), peak RSS, the last loss and the 1-minute load average; then the
ratios dpo-lora / sft-lora, dpo-full / sft-full, dpo-copy / sft-full and simpo-full / sft-full.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import measure_training  # noqa: E402

MODEL = [
    "model=llama-tiny",
    "model.config.hidden_size=384",
    "model.config.intermediate_size=1024",
    "model.config.num_attention_heads=6",
    "model.config.num_key_value_heads=2",
]
TRAIN = [
    "train.seq_len=128",
    "train.micro_batch_size=8",
    "train.global_batch_size=16",
    "train.eval_every=0",
    "train.eval_batches=0",
    "train.loggers=[]",
    "train.threads_per_process=1",
    "optim.warmup_steps=0",
    "data.chat_template=chatml",
    "data.packing=false",
    "data.long_examples=truncate",
]
RUNS = {
    "sft-lora": ["data.source=builtin-chat", "data.format=chat", "peft=lora"],
    "dpo-lora": ["data.source=builtin-preference", "data.format=preference", "peft=lora", "train.objective=dpo"],
    "sft-full": ["data.source=builtin-chat", "data.format=chat"],
    "dpo-full": ["data.source=builtin-preference", "data.format=preference", "train.objective=dpo"],
    "dpo-copy": [
        "data.source=builtin-preference",
        "data.format=preference",
        "train.objective=dpo",
        "train.preference_reference=copy",
    ],
    "simpo-full": [
        "data.source=builtin-preference",
        "data.format=preference",
        "train.objective=simpo",
        "train.preference_beta=2.0",
    ],
}
SKIP = 3


def run(name: str, overrides: list, procs: int, steps: int, root: Path) -> dict:
    layout = [f"parallel.dp={procs}", "parallel.tp=1", "cluster=local-cpu", f"cluster.devices_per_node={procs}"]
    args = [*MODEL, *TRAIN, *layout, *overrides, f"train.steps={steps}"]
    return measure_training(args, root / name, 16 * 128, SKIP)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--procs", type=int, default=1)
    args = parser.parse_args(argv)
    mib = 1 << 20
    print(f"{'run':>10} {'tokens/s':>9} {'state MiB':>10} {'peak RSS MiB':>13} {'loss':>7} {'load avg':>9}")
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in RUNS.items():
            got[name] = r = run(name, overrides, args.procs, args.steps, Path(tmp))
            print(
                f"{name:>10} {r['tokens_per_s']:>9.0f} {r['state'] / mib:>10.1f} {r['rss'] / mib:>13.0f} "
                f"{r['loss']:>7.3f} {r['load']:>9.1f}"
            )
    pairs = (("dpo-lora", "sft-lora"), ("dpo-full", "sft-full"), ("dpo-copy", "sft-full"), ("simpo-full", "sft-full"))
    for pref, sft in pairs:
        a, b = got[pref], got[sft]
        print(
            f"{pref} / {sft}: tokens/s {a['tokens_per_s'] / b['tokens_per_s']:.2f}x, "
            f"model state {a['state'] / b['state']:.2f}x, peak RSS {a['rss'] / b['rss']:.2f}x"
        )
    print(
        "reference choices: LoRA adapters off (dpo-lora), precomputed log-probs (dpo-full, its one-time scoring "
        "pass not in tokens/s; a table cached by an earlier run is reused) and a frozen copy (dpo-copy: its "
        "parameters are in the peak RSS, not in the model state, which counts what the optimizer trains)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""LoRA (peft=lora) against full fine-tuning: tokens/s and memory, one process and dp2, in one invocation.

    python benchmarks/lora.py                 # 1 process and dp2 (DDP), 12 steps a run (about 1 min on 2 cores)
    python benchmarks/lora.py --only 1 --steps 8

Model: a Llama from config, small but not trivial for a CPU (hidden 384, 4 layers, 6 heads / 2 KV
heads, MLP 1024, vocabulary 256: 6.5M parameters), sequence 256, micro batch 4, global batch 8,
fp32, AdamW. Both runs go through `partrain train` with the same data and seed; the LoRA run adds
`peft=lora` (r 8 on every attention and MLP projection). Printed for each process count:

- tokens/s: median step time of the timed steps (the first 3 dropped), 8 x 256 / that;
- model state per rank (parameters + gradients + optimizer state, summary.json's model_state_bytes):
  LoRA keeps the frozen base's parameters but no gradient or Adam state for them;
- peak RSS per rank (summary.json's peak_rss_bytes: the whole process, interpreter and torch included);
- the LoRA / full ratio of each, and the machine's 1-minute load average at the run's end (summary.json:
  on a 2-core machine a load above about 2.5 makes the tokens/s figures noisy; the memory ones hold).
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
    "train.seq_len=256",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.eval_every=0",
    "train.eval_batches=0",
    "train.loggers=[]",
    "train.threads_per_process=1",
    "data.max_bytes=2000000",
    "optim.warmup_steps=0",
]
SKIP = 3


def layout(procs: int) -> list:
    return [
        f"parallel.dp={procs}",
        "parallel.tp=1",
        "parallel.zero_stage=0",
        "cluster=local-cpu",
        f"cluster.devices_per_node={procs}",
    ]


def run(name: str, overrides: list, steps: int, root: Path) -> dict:
    return measure_training([*MODEL, *TRAIN, *overrides, f"train.steps={steps}"], root / name, 8 * 256, SKIP)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", default="1,2", help="process counts, comma-separated")
    args = parser.parse_args(argv)
    mib = 1 << 20
    print(f"{'procs':>5} {'run':>5} {'tokens/s':>9} {'state MiB':>10} {'peak RSS MiB':>13} {'loss':>7} {'load avg':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for procs in (int(p) for p in args.only.split(",")):
            got = {}
            for kind, extra in (("full", []), ("lora", ["peft=lora"])):
                got[kind] = r = run(f"{kind}-{procs}", layout(procs) + extra, args.steps, Path(tmp))
                print(
                    f"{procs:>5} {kind:>5} {r['tokens_per_s']:>9.0f} {r['state'] / mib:>10.1f} "
                    f"{r['rss'] / mib:>13.0f} {r['loss']:>7.3f} {r['load']:>9.1f}"
                )
            full, lora = got["full"], got["lora"]
            print(
                f"{procs:>5} ratio LoRA/full: tokens/s {lora['tokens_per_s'] / full['tokens_per_s']:.2f}x, "
                f"model state {lora['state'] / full['state']:.2f}x, peak RSS {lora['rss'] / full['rss']:.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

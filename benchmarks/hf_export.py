"""Peak memory of `partrain checkpoint export`: each exporting process vs its own shard, and vs one
process gathering the whole model (what export did before it was sharded: load_model_weights +
save_pretrained) measured in the same invocation.

    python benchmarks/hf_export.py                 # Llama, 12 layers x 512 wide, vocab 8192: 44M params, 176 MB fp32
    python benchmarks/hf_export.py --layers 4      # smaller and quicker

A real run writes the checkpoint first (`recipe=llama-fsdp-tp`, dp2 x tp2, FSDP + TP, one step),
then the same checkpoint is exported with --nproc 4, with --nproc 1, and by the one-process
gather baseline; each in fresh processes. "held" is the process's peak RSS (VmHWM) minus its
RSS once its code was loaded, before any weight was read: what the export itself held. The bound
checked is held <= 1.5 x shard + 96 MiB (one read batch of 32 MiB plus DCP's buffers).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import worker_env  # noqa: E402
from partrain.testing.hf_check import export_with_cli, logits_difference  # noqa: E402
from partrain.testing.parity import run_training  # noqa: E402

MIB = 1 << 20
CONSTANT = 96 * MIB

_GATHER = """
import json, sys, time
from pathlib import Path
from partrain.checkpoint import load_model_weights
from partrain.runtime.resident import current_rss_bytes, peak_rss_bytes
import transformers  # loaded before the measurement starts, as the exporters' code is
before = current_rss_bytes()
start = time.perf_counter()
model, _ = load_model_weights(Path(sys.argv[1]))
model.save_pretrained(sys.argv[2])
size = sum(p.numel() * p.element_size() for p in model.state_dict().values() if p.data_ptr() != 0)
print(json.dumps({"bytes": size, "rss_before_bytes": before,
                  "peak_rss_bytes": peak_rss_bytes(),
                  "seconds": time.perf_counter() - start}))
"""


def _model_overrides(layers: int) -> list:
    return [
        "model.config.hidden_size=512",
        "model.config.intermediate_size=1408",
        f"model.config.num_hidden_layers={layers}",
        "model.config.num_attention_heads=8",
        "model.config.num_key_value_heads=4",
        "model.config.vocab_size=8192",
    ]


def _gather_baseline(ckpt: Path, out: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _GATHER, str(ckpt), str(out)], capture_output=True, text=True, env=worker_env()
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _row(name: str, procs: int, shard: dict) -> str:
    held = shard["peak_rss_bytes"] - shard["rss_before_bytes"]
    bound = 1.5 * shard["bytes"] + CONSTANT
    return (
        f"| {name} | {procs} | {shard['bytes'] / MIB:.1f} | {shard['rss_before_bytes'] / MIB:.0f} | "
        f"{shard['peak_rss_bytes'] / MIB:.0f} | {held / MIB:.1f} | {held / shard['bytes']:.2f} | "
        f"{'yes' if held <= bound else 'NO'} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--keep", type=Path, default=None, help="work folder to keep (default: a temporary one)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="export this checkpoint instead of training one")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="partrain-hf-export-"))
    ckpt = args.checkpoint
    if ckpt is None:
        t = time.perf_counter()
        overrides = ["recipe=llama-fsdp-tp", "train.seq_len=32", "data.max_bytes=100000", "checkpoint.every_steps=1"]
        run_training(overrides + _model_overrides(args.layers) + [f"data.cache_dir={work / 'cache'}"], work / "run", 1)
        ckpt = work / "run" / "checkpoints" / "step-00000001"
        print(f"checkpoint written by a 4-process run in {time.perf_counter() - t:.0f} s: {ckpt}")
    for old in work.glob("hf-*"):
        shutil.rmtree(old)

    rows, times = [], {}
    for procs in (4, 1):
        t = time.perf_counter()
        report = export_with_cli(ckpt, work / f"hf-{procs}", nproc=procs, timeout_s=1800)
        times[f"sharded, --nproc {procs}"] = time.perf_counter() - t
        for shard in report["shards"]:
            rows.append(_row(f"sharded, --nproc {procs}, shard {shard['index'] + 1}", procs, shard))
        diff = logits_difference(work / f"hf-{procs}", ckpt)
        print(f"--nproc {procs}: from_pretrained logits vs the checkpoint's model: max |diff| = {diff}")
    t = time.perf_counter()
    gathered = _gather_baseline(ckpt, work / "hf-gather")
    times["one process gathering the model (baseline)"] = time.perf_counter() - t
    rows.append(_row("one process gathering the model (baseline)", 1, gathered))

    print()
    print("| export | processes | shard MiB | RSS before MiB | peak RSS MiB | held MiB | held / shard | within bound |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    for name, seconds in times.items():
        print(f"wall time, {name}: {seconds:.1f} s (process starts included)")
    print(f"work folder: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

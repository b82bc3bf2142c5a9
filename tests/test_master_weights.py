"""16-bit parameters with fp32 master weights (train.param_dtype=16bit) against the autocast runtime
(train.param_dtype=fp32), for real in several gloo processes.

Reference semantics: the autocast runtime keeps fp32 weights and computes matmuls in 16 bits; the
16-bit runtime computes everything in 16 bits from 16-bit parameters, accumulates and reduces
gradients in fp32 and updates fp32 master weights. Both start from the same fp32 weights and run
the same loop (`Trainer.train_step`). Held to bf16 tolerance 2e-3 relative on losses and gradient
norms: the two runtimes round different tensors to bf16 (unit roundoff 2^-8 = 3.9e-3 per element,
averaging down over the many elements of a loss or a norm). Measured at most 5.6e-4 (dp2 gradient
norm): a margin of 3.6x.

One process launch holds several cases: every case builds both runtimes in the same processes
(dp2 zero 0, dp2 zero 1, tp2 zero 1 share a 2-process launch; gpt-3d zero 1 has its 8).
Model-state bytes per rank are measured from the real optimizer step (`loop.model_state_bytes`,
what the run summary records) and held within 2% of the design's formula
(2 + 4) P + 12 P / N bytes (P = parameters the rank holds, N = ZeRO-1 shard group, 1 under
zero 0) and of the planner's runtime accounting.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partrain.rehearse.runs import train_all
from partrain.runtime.spawn import run_spawned
from partrain.testing.parity import max_relative_difference, parity_args

RTOL = 2e-3
"""bf16 with 16-bit parameters (fp32 master weights) vs the autocast runtime, every step's loss and
gradient norm: the forward runs on weights rounded to bf16 once per step instead of per use, so the two
differ by bf16 rounding (2^-8) averaged over many elements. Measured (2026-12-07): at most 5.6e-4 (dp2,
gradient norm), a margin of 3.6x; the losses at most 6.9e-5."""
STEPS = 3
SMALL = ["train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_len=32", "train.precision=bf16"]
TWO = ["recipe=gpt-dp", "cluster.devices_per_node=2", *SMALL]
CASES_2 = [
    ("dp2-zero0", TWO + ["parallel.zero_stage=0"]),
    ("dp2-zero1", TWO + ["parallel.zero_stage=1"]),
    ("tp2-zero1", TWO + ["parallel.dp=1", "parallel.tp=2", "parallel.zero_stage=1"]),
]
CASES_8 = [("gpt-3d-zero1", ["recipe=gpt-3d", *SMALL, "parallel.zero_stage=1"])]


class _Batches:
    """The same random tokens every step (the loss must fall: memorised): rank dp_rank's rows."""

    def __init__(self, global_batch: int, seq: int, vocab: int) -> None:
        self.shape, self.vocab = (global_batch, seq + 1), vocab

    def rank_batch(self, step: int, dp_rank: int = 0, dp_size: int = 1):
        import torch

        tokens = torch.randint(0, self.vocab, self.shape, generator=torch.Generator().manual_seed(0))
        rows = tokens.chunk(dp_size)[dp_rank]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _both_runtimes(rank: int, world: int, cases, folder: str) -> dict:
    import torch

    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.planner import model_state_bytes_per_rank
    from partrain.blueprint.validate import validate
    from partrain.runtime.mesh import build_mesh
    from partrain.train.assemble import build_engine
    from partrain.train.loop import Trainer
    from partrain.train.metrics import MetricsWriter

    out = {}
    for name, overrides in cases:
        for mode in ("fp32", "16bit"):
            v = validate(compose([*overrides, f"train.param_dtype={mode}", "train.eval_batches=0"]))
            torch.manual_seed(v.run.train.seed)
            mesh = build_mesh(v.layout, "cpu")
            engine = build_engine(v, mesh, torch.device("cpu"))
            batches = _Batches(v.global_batch_size, v.run.train.seq_len, 256)
            trainer = Trainer(v, mesh, engine, batches, None, MetricsWriter(Path(folder), enabled=False), rank == 0)
            steps = [trainer.train_step() for _ in range(STEPS)]
            params = {id(p): p for part in engine.model_parts for p in part.parameters()}.values()
            shard = engine.optimizer.world if hasattr(engine.optimizer, "world") else 1
            out[f"{name}/{mode}"] = {
                "loss": [s.loss for s in steps],
                "grad_norm": [s.grad_norm for s in steps],
                "state_bytes": trainer.state.model_state_bytes,
                "planned_bytes": model_state_bytes_per_rank(v)[rank],
                "local_params": sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params),
                "shard": shard,
                "param_dtype": str(next(iter(params)).dtype),
            }
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    got = {}
    for world, cases in ((2, CASES_2), (8, CASES_8)):
        folder = tmp_path_factory.mktemp(f"mw{world}")
        got[world] = run_spawned(_both_runtimes, world, folder, cases, str(folder), timeout_s=900)
    return got


ALL = [(2, name) for name, _ in CASES_2] + [(8, name) for name, _ in CASES_8]


@pytest.mark.slow
@pytest.mark.parametrize("world, name", ALL)
def test_16_bit_parameters_match_the_autocast_runtime(results, world, name):
    for rank_result in results[world]:
        ref, got = rank_result[f"{name}/fp32"], rank_result[f"{name}/16bit"]
        assert got["param_dtype"] == "torch.bfloat16" and ref["param_dtype"] == "torch.float32"
        loss_diff = max_relative_difference(ref["loss"], got["loss"])
        norm_diff = max_relative_difference(ref["grad_norm"], got["grad_norm"])
        print(f"{name}: loss rel diff {loss_diff:.2e}, grad-norm rel diff {norm_diff:.2e} (tolerance {RTOL})")
        assert loss_diff <= RTOL and norm_diff <= RTOL, (ref, got)
        assert got["loss"][-1] < got["loss"][0]


@pytest.mark.slow
@pytest.mark.parametrize("world, name", ALL)
def test_model_state_bytes_follow_the_formula_and_the_planner(results, world, name):
    for rank_result in results[world]:
        got = rank_result[f"{name}/16bit"]
        p, n = got["local_params"], got["shard"]
        formula = (2 + 4) * p + 12 * p / n
        assert abs(got["state_bytes"] - formula) <= 0.02 * formula, (got, formula)
        assert abs(got["planned_bytes"] - got["state_bytes"]) <= 0.02 * got["state_bytes"], got
        if "zero1" in name and world == 2 and "tp" not in name:
            assert n == 2


def _checkpoint_model(folder: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder), str(folder.parent / "flat.pt"))
    return torch.load(folder.parent / "flat.pt", weights_only=False)["model"]


@pytest.mark.slow
def test_resume_restores_the_fp32_master_weights_exactly(tmp_path):
    overrides = [
        *TWO,
        "parallel.zero_stage=1",
        "train.param_dtype=16bit",
        "data.max_bytes=1000000",
        f"data.cache_dir={tmp_path / 'cache'}",
        "checkpoint.every_steps=2",
    ]
    # Both in real processes through the worker's code (testing.in_process.train_all).
    straight = train_all({"straight": parity_args(overrides, 4)}, tmp_path)["straight"]
    ckpt = straight.run_dir / "checkpoints" / "step-00000002"
    resumed = train_all({"resumed": parity_args([*overrides, f"checkpoint.resume={ckpt}"], 4)}, tmp_path)["resumed"]
    assert resumed.losses == straight.losses[2:], (resumed.losses, straight.losses)
    records = [json.loads(line) for line in (resumed.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [3, 4]
    # (Another layout and the autocast runtime resume the same checkpoint too: fp32 weights, per-fqn
    # Adam state; checked by hand at 2e-3, left out of the suite for time.)
    # The model state saved is the fp32 master copy, not the 16-bit parameters.
    model = _checkpoint_model(ckpt)
    weight = next(t for k, t in model.items() if k.endswith("c_attn.weight"))
    assert str(weight.dtype) == "torch.float32"
    assert (weight != weight.bfloat16().float()).any()

"""Expert parallelism for real (several gloo processes, the `partrain train` path) against ep=1.

Every layout is compared with the one-process run of the same model, data and seed (dropless,
router aux loss on as the HF config says, fp32, 5 steps, 1e-5 relative on loss and gradient norm).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from partrain.testing.multiproc import run_spawned
from partrain.testing.parity import check_parity, max_relative_difference, reference_overrides, run_training

pytestmark = pytest.mark.slow

STEPS = 5
COMMON = ["train.seq_len=64", "data.max_bytes=1000000"]
MIXTRAL = ["recipe=mixtral-ep"]  # tiny Mixtral, 4 experts top-2, dp2 x ep2
QWEN = ["recipe=mixtral-ep", "model=qwen2-moe-tiny"]  # 8 experts top-2 + shared expert
FOUR = ["parallel.dp=4", "cluster.devices_per_node=4"]

LAYOUTS = {
    "mixtral-ep4": (MIXTRAL, FOUR + ["parallel.ep=4"]),
    "mixtral-ep2-tp2": (MIXTRAL, ["parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "cluster.devices_per_node=4"]),
    "mixtral-ep2-pp2": (MIXTRAL, ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "cluster.devices_per_node=4"]),
    "mixtral-ep2-fsdp-zero3": (MIXTRAL, FOUR + ["parallel.ep=2", "parallel.zero_stage=3"]),  # edp=2: FSDP over edp
    "qwen2-moe-ep2": (QWEN, []),
}


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


def _base(model, data_cache):
    return model + COMMON + [f"data.cache_dir={data_cache}"]


@pytest.fixture(scope="module")
def references(tmp_path_factory, data_cache):
    cache = {}

    def get(model):
        key = tuple(model)
        if key not in cache:
            cache[key] = run_training(reference_overrides(_base(model, data_cache)), tmp_path_factory.mktemp("ref") / "run", STEPS)
        return cache[key]
    return get


@pytest.fixture(scope="module")
def mixtral_ep2(tmp_path_factory, data_cache):
    """The recipe as shipped (dp2 x ep2), saving a checkpoint at step 3."""
    return run_training(_base(MIXTRAL, data_cache) + ["checkpoint.every_steps=3"], tmp_path_factory.mktemp("ep2") / "run", STEPS)


def test_mixtral_ep2_matches_single_process_and_holds_half_the_experts(mixtral_ep2, references):
    ref = references(MIXTRAL)
    print("mixtral-ep2", check_parity(ref, mixtral_ep2, rtol=1e-5))
    total = ref.summary["ranks"][0]["expert_param_bytes"]  # one process holds every expert
    for rank in mixtral_ep2.summary["ranks"]:
        assert abs(rank["expert_param_bytes"] - total / 2) <= 0.02 * total / 2, (rank, total)
    # Expert-load metrics: every routed token copy counted once over the ep group, each step.
    records = [json.loads(line) for line in (mixtral_ep2.run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens_per_step = 8 * 64 * 2 * 2  # global batch x seq_len x top_k x MoE layers
    for rec in records:
        assert sum(rec["moe_tokens_per_expert"]) == tokens_per_step
        assert rec["moe_imbalance"] >= 1.0 and rec["moe_aux_loss"] > 0
    ref_records = [json.loads(line) for line in (ref.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["moe_tokens_per_expert"] for r in ref_records] == [r["moe_tokens_per_expert"] for r in records]
    load = mixtral_ep2.summary["moe"]
    assert len(load["tokens_per_expert"]) == 2 and len(load["tokens_per_expert"][0]) == 4


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, references, tmp_path, data_cache):
    model, layout = LAYOUTS[name]
    got = run_training(_base(model, data_cache) + layout, tmp_path / "run", STEPS)
    print(name, check_parity(references(model), got, rtol=1e-5))
    if name == "mixtral-ep4":
        total = references(model).summary["ranks"][0]["expert_param_bytes"]
        assert all(abs(r["expert_param_bytes"] - total / 4) <= 0.02 * total / 4 for r in got.summary["ranks"])


def test_capacity_drops_the_same_tokens_as_ep1(tmp_path, data_cache):
    """A capacity factor drops tokens; ep=2 drops exactly those ep=1 drops (decided per rank)."""
    base = _base(MIXTRAL, data_cache) + ["parallel.moe_capacity_factor=1.0"]
    ref = run_training(reference_overrides(base), tmp_path / "ref", 3)
    got = run_training(base, tmp_path / "ep2", 3)
    print("capacity 1.0", check_parity(ref, got, rtol=1e-5))
    shares = [json.loads(line)["moe_dropped_share"] for line in (got.run_dir / "metrics.jsonl").read_text().splitlines()]
    ref_shares = [json.loads(line)["moe_dropped_share"] for line in (ref.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert shares == ref_shares and all(0 < s < 0.5 for s in shares)


def _steps(run_dir: Path):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records if "loss" in r}


@pytest.mark.parametrize("layout", [FOUR + ["parallel.ep=4"], ["parallel.dp=1", "parallel.ep=1", "cluster.devices_per_node=1"]],
                         ids=["ep4", "ep1"])
def test_resume_under_another_ep_degree(layout, mixtral_ep2, tmp_path, data_cache):
    """Saved at ep=2 after step 3 (experts as Shard(0) DTensors under full FQNs), resumed at ep=4 or
    ep=1: steps 4 and 5 match the uninterrupted ep=2 run."""
    ckpt = mixtral_ep2.run_dir / "checkpoints" / "step-00000003"
    run_training(_base(MIXTRAL, data_cache) + layout + [f"checkpoint.resume={ckpt}"], tmp_path / "run", STEPS)
    straight, resumed = _steps(mixtral_ep2.run_dir), _steps(tmp_path / "run")
    assert sorted(resumed) == [4, 5]
    for i in (0, 1):
        diff = max_relative_difference([straight[s][i] for s in resumed], [resumed[s][i] for s in resumed])
        print(layout, "loss" if i == 0 else "grad_norm", diff)
        assert diff <= 1e-5


def test_export_of_an_ep_checkpoint_is_the_full_hf_model(mixtral_ep2, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from partrain.checkpoint import load_checkpoint
    from partrain.checkpoint.record import model_record
    from partrain.config.compose import load_resolved
    from partrain.models.build import build_meta_model
    from partrain.models.init import materialize
    from partrain.train.optim import make_adamw, param_groups

    ckpt = mixtral_ep2.run_dir / "checkpoints" / "step-00000003"
    ran = subprocess.run([sys.executable, "-m", "partrain.cli", "checkpoint", "export", str(ckpt), "--hf", str(tmp_path / "hf")],
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    run = load_resolved(mixtral_ep2.run_dir / "config.yaml")
    model = materialize(build_meta_model(run.model), run.model, 0, "cpu")
    load_checkpoint(ckpt, [model], make_adamw(param_groups(model, run.optim.weight_decay), run.optim), {"model": model_record(run.model)})
    for name, value in model.state_dict().items():
        if ".experts." in name:
            assert value.shape[0] == 4 and torch.equal(hf.state_dict()[name], value), name


def _mesh_groups(rank, world, degrees):
    import torch.distributed as dist

    from partrain.layout import Layout
    from partrain.runtime.mesh import build_mesh

    mesh = build_mesh(Layout(**degrees), "cpu")
    return {f: dist.get_process_group_ranks(mesh[f].get_group()) for f in ("ep", "edp")}


@pytest.mark.parametrize("degrees", [dict(dp=4, ep=2), dict(dp=2, tp=2, ep=2)], ids=["dp4-ep2", "dp2-tp2-ep2"])
def test_mesh_ep_and_edp_groups_are_the_layouts(degrees, tmp_path):
    from partrain.layout import Layout

    layout = Layout(**degrees)
    for rank, groups in enumerate(run_spawned(_mesh_groups, 4, tmp_path, degrees)):
        for family, members in groups.items():
            assert members == layout.group_of(family, rank), (family, rank)

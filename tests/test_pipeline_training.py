"""Pipeline parallelism through the real trainer (gloo processes, the worker's code) against the
one-process run, up to the full 3D layout of the README's main job; the runs of one process count
share a launch (testing.in_process.train_all)."""

from __future__ import annotations

import math

import pytest

from partrain.runtime.spawn import run_spawned
from partrain.testing.in_process import train_with_references
from partrain.testing.parity import check_parity

pytestmark = pytest.mark.slow

STEPS = 3
COMMON = ["train.seq_len=64", "data.max_bytes=1000000"]
GPT_PP = ["recipe=gpt-3d", "parallel.dp=1", "parallel.tp=1", "train.micro_batch_size=2", "train.global_batch_size=8"]
LLAMA_PP = [
    "recipe=llama-fsdp-tp",
    "parallel.dp=1",
    "parallel.tp=1",
    "parallel.zero_stage=0",
    "parallel.tp_sequence_parallel=false",
    "train.micro_batch_size=1",
    "train.global_batch_size=8",
]

LAYOUTS = {
    "gpt2-3d-dp2-tp2-pp2-1f1b": ["recipe=gpt-3d"],
    "gpt2-3d-fsdp": ["recipe=gpt-3d", "parallel.zero_stage=3"],
    "gpt2-pp4-gpipe": GPT_PP + ["parallel.pp=4", "parallel.pp_schedule=gpipe", "cluster.devices_per_node=4"],
    "llama-pp2-interleaved-v2": LLAMA_PP
    + [
        "parallel.pp=2",
        "parallel.pp_schedule=interleaved-1f1b",
        "parallel.pp_virtual_stages=2",
        "cluster.devices_per_node=2",
    ],
    "llama-pp2-zbv": LLAMA_PP
    + ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2", "cluster.devices_per_node=2"],
    # Megatron-SP hands the second stage a sequence shard: rotary positions must still be the whole sequence's
    "llama-tp2-sp-pp2-1f1b": LLAMA_PP
    + ["parallel.tp=2", "parallel.tp_sequence_parallel=true", "parallel.pp=2", "cluster.devices_per_node=4"],
}


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


def _reference(overrides) -> list:
    """What the one-process reference keeps of a layout: its recipe and batch sizes."""
    return [o for o in overrides if o.startswith(("recipe=", "train."))]


def _reference_name(overrides) -> str:
    return "reference-" + "-".join(o.split("=")[1] for o in _reference(overrides))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """Every layout and each reference it needs, trained once per module through the worker's code;
    the runs of one process count share a launch (testing.in_process.train_all)."""
    common = COMMON + [f"data.cache_dir={data_cache}"]
    layouts = {name: overrides + common for name, overrides in LAYOUTS.items()}

    def reference_of(name: str):
        return _reference_name(LAYOUTS[name]), _reference(LAYOUTS[name]) + common

    return train_with_references(layouts, reference_of, STEPS, tmp_path_factory.mktemp("runs"))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_layout_matches_single_process(name, runs):
    got = runs[name]
    print(name, check_parity(runs[_reference_name(LAYOUTS[name])], got))
    assert got.losses[-1] < got.losses[0]


def _eval_losses(rank: int, world: int) -> dict:
    """The pipeline's eval loss of one batch at initialisation, with Megatron-SP off and on (the same
    weights: SP only moves where the tokens are computed), through the real engine."""
    import torch

    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate
    from partrain.runtime.mesh import build_mesh
    from partrain.train.assemble import build_engine

    torch.set_num_threads(1)
    out = {}
    for sp in ("false", "true"):
        overrides = LAYOUTS["llama-tp2-sp-pp2-1f1b"] + ["train.seq_len=64", f"parallel.tp_sequence_parallel={sp}"]
        v = validate(compose(overrides))
        mesh = build_mesh(v.layout, "cpu")
        torch.manual_seed(v.run.train.seed)
        engine = build_engine(v, mesh, torch.device("cpu"))
        ids = torch.randint(0, 256, (v.global_batch_size, 64), generator=torch.Generator().manual_seed(5))
        out[sp] = engine.share_loss(engine.eval_loss(ids, ids.roll(-1, dims=1)))
    return out


def test_eval_under_megatron_sp_receives_sequence_shards(tmp_path):
    """Between stages Megatron-SP passes [b, s/tp, h]: the pipeline's eval must receive that shape (it
    received [b, s, h]: GPT-2 crashed at its loss, Llama at its rotary positions) and get the loss of
    the same weights without SP."""
    for result in run_spawned(_eval_losses, 4, tmp_path):
        assert math.isfinite(result["true"]) and abs(result["true"] - result["false"]) <= 1e-5 * result["false"]

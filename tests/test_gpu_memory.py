"""GPU memory help (train/gpu_memory.py) on CPU: the out-of-memory message from a synthetic
torch.OutOfMemoryError, the settings it suggests, and that CPU runs add no GPU fields."""

from __future__ import annotations

import pytest
import torch

from partrain.blueprint.config.compose import compose
from partrain.blueprint.validate import validate
from partrain.train.gpu_memory import GpuOutOfMemory, oom_message, settings_that_help, step_memory_fields

GiB = 2**30


def _run(*overrides):
    return validate(compose(["recipe=llama-fsdp-tp", *overrides]))


def test_oom_message_names_plan_measurement_and_fixes():
    v = _run("train.loss_chunk_tokens=0", "parallel.zero_stage=1", "cluster.devices_per_node=8", "parallel.dp=4")
    try:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    except torch.OutOfMemoryError as exc:
        err = GpuOutOfMemory(oom_message(v.run, 3, 20 * GiB, 70 * GiB, 75 * GiB, 80 * GiB, "errors/x.txt", 4))
        err.__cause__ = exc
    text = str(err)
    assert text.startswith("rank 3 ran out of GPU memory: planned 20.00 GiB, measured peak 70.00 GiB allocated")
    assert "75.00 GiB reserved of 80.00 GiB" in text and "errors/x.txt" in text
    for fix in (
        "train.loss_chunk_tokens=4096",
        "parallel.recompute=selective",
        "parallel.zero_stage=2",
        "parallel.tp=4",
        "train.micro_batch_size=1",
    ):
        assert fix in text, fix
    assert isinstance(err.__cause__, torch.OutOfMemoryError)


def test_nothing_left_to_lower_says_so():
    v = _run(
        "parallel.recompute=full",
        "train.micro_batch_size=1",
        "train.global_batch_size=2",
        "parallel.zero_stage=3",
        "cluster.devices_per_node=4",
    )
    assert settings_that_help(v.run, heads=6) == []  # tp=4 would not divide 6 heads
    assert "a larger device or more devices" in oom_message(v.run, 0, 0, GiB, GiB, 2 * GiB, "f", 6)
    assert "no plan" in oom_message(v.run, 0, 0, GiB, GiB, 2 * GiB, "f", 4)


def test_tp_suggestion_respects_heads_and_node():
    v = _run("cluster.devices_per_node=8", "parallel.dp=4")  # tp=2 of 8 devices
    assert any(s.startswith("parallel.tp=4") for s in settings_that_help(v.run, heads=4))
    assert not any(s.startswith("parallel.tp=") for s in settings_that_help(v.run, heads=6))


@pytest.mark.parametrize("device", ["cpu"])
def test_no_gpu_fields_off_cuda(device):
    assert step_memory_fields(torch.device(device)) == {}

"""The default cluster on a machine with GPUs (issue 45 item 2): nvidia-smi's answer read through an
injectable query, and compose turning local-cpu into those GPUs unless the user named a cluster or a
device. This machine has no GPU: the queries here are stand-ins, the composition is the real one."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest

from partrain.blueprint.config.compose import compose
from partrain.blueprint.config.local_gpus import NO_GPUS, UNLISTED_GPU_FIGURES, LocalGpus, parse_nvidia_smi
from partrain.cli.common import local_gpus

H100S = "NVIDIA H100 80GB HBM3, 81559\n" * 8
EIGHT_H100 = parse_nvidia_smi(H100S)


def test_nvidia_smi_output_gives_count_smallest_memory_and_name():
    assert EIGHT_H100 == LocalGpus(count=8, memory_gib=79.6, name="NVIDIA H100 80GB HBM3")
    mixed = parse_nvidia_smi("NVIDIA A100-SXM4-80GB, 81920\nNVIDIA A100-SXM4-40GB, 40960\n")
    assert (mixed.count, mixed.memory_gib) == (2, 40.0)
    for text in ("", "No devices were found", "NVIDIA H100, [N/A]", ", 81559"):
        assert parse_nvidia_smi(text) == NO_GPUS, text


def test_the_query_finds_no_gpu_without_nvidia_smi_or_when_it_fails():
    def never(*args, **kwargs):
        raise AssertionError("no process may start without nvidia-smi")

    assert local_gpus(which=lambda name: None, run=never) == NO_GPUS
    found = lambda name: "/usr/bin/" + name  # noqa: E731

    def answer(code, out):
        return lambda *a, **k: SimpleNamespace(returncode=code, stdout=out)

    assert local_gpus(which=found, run=answer(0, H100S)) == EIGHT_H100
    assert local_gpus(which=found, run=answer(9, "NVIDIA-SMI has failed")) == NO_GPUS

    def hangs(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], 10)

    assert local_gpus(which=found, run=hangs) == NO_GPUS


def _cluster(overrides, gpus=EIGHT_H100):
    c = compose(overrides, gpus=gpus).cluster
    return c.name, c.device, c.backend, c.devices_per_node, c.device_memory_gib, c.peak_tflops


def test_the_default_cluster_becomes_the_machines_gpus():
    assert _cluster([]) == ("local-gpu", "cuda", "nccl", 8, 79.6, 989.0)
    # The default batch (8 over 2 CPU processes) keeps each process's share: 32 over 8 GPUs.
    assert compose([], gpus=EIGHT_H100).train.global_batch_size == 32
    assert compose(["train.global_batch_size=16"], gpus=EIGHT_H100).train.global_batch_size == 16
    # A recipe describes a layout: its process count stays (gpt-dp: dp2 on 2 of the 8 GPUs).
    assert _cluster(["recipe=gpt-dp"]) == ("local-gpu", "cuda", "nccl", 2, 79.6, 989.0)
    assert _cluster(["cluster.devices_per_node=4"])[3] == 4
    assert _cluster(["cluster.device_memory_gib=40"])[4] == 40.0
    unlisted = LocalGpus(count=2, memory_gib=23.6, name="NVIDIA GeForce RTX 4090")
    assert _cluster([], unlisted) == ("local-gpu", "cuda", "nccl", 2, 23.6, UNLISTED_GPU_FIGURES[0])


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["cluster=local-cpu"],
        ["cluster.device=cpu"],
        ["cluster.backend=gloo"],
        ["recipe=gpt-dp", "cluster=local-cpu"],
    ],
)
def test_a_named_cluster_or_device_or_no_gpu_keeps_the_cpu(overrides):
    gpus = NO_GPUS if not overrides else EIGHT_H100
    assert _cluster(overrides, gpus)[:3] == ("local-cpu", "cpu", "gloo")


def test_a_recipes_own_machine_is_not_replaced():
    assert _cluster(["recipe=sft-lora-h100x8"])[:4] == ("h100x8", "cuda", "nccl", 8)
    assert _cluster(["cluster=h100x8"])[:2] == ("h100x8", "cuda")


def test_a_device_named_by_a_recipe_brings_its_backend(tmp_path):
    (tmp_path / "on-gpus.yaml").write_text("# @package _global_\ncluster:\n  device: cuda\n")
    (tmp_path / "gloo-on-gpus.yaml").write_text("# @package _global_\ncluster:\n  device: cuda\n  backend: gloo\n")
    assert compose(["recipe=on-gpus"], [str(tmp_path)]).cluster.backend == "nccl"
    assert compose(["recipe=gloo-on-gpus"], [str(tmp_path)]).cluster.backend == "gloo"  # both named: kept
    assert compose(["recipe=on-gpus", "cluster.backend=gloo"], [str(tmp_path)]).cluster.backend == "gloo"


def test_the_dry_run_shows_the_gpus_it_found(cli, monkeypatch):
    monkeypatch.setattr("partrain.cli.common.local_gpus", lambda: EIGHT_H100)
    ran = cli("train", "--dry-run")
    assert ran.code == 0, ran.stdout + ran.stderr
    assert "local-gpu: 1 node(s) x 8 devices" in ran.stdout

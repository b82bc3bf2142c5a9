"""Checkpoint faults: same-size corruption, torch's own read failures, damaged folders, full disks.

In-process (one process, no process group): a tiny GPT-2 saved twice; its files are then damaged
the ways a disk, a copy or a person damage them, and load, fallback, export and `checkpoint verify`
must each name the file. A full disk is a real 1 MiB tmpfs where this machine lets the test mount
one, and always a fault-injecting file system under DCP's writer (ENOSPC, EACCES, EROFS).

Multi-process: one 2-process training run saves steps 2, 4 and 6; a copy of its checkpoints gets
a sign-flipped shard (step 6), a same-named copy whose rng file has a damaged zip header on rank 1
only and no checksums (step 7: only rank 1 fails, after dcp.load; the ranks must agree) and a folder
without partrain.json (step 8). resume=auto must warn about each on the terminal, resume from
step 4, and train exactly as the clean run did.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from partrain.blueprint.config.schema import ModelConfig, OptimConfig
from partrain.checkpoint import (
    CorruptCheckpoint,
    SaveFailed,
    export_hf,
    load_checkpoint,
    load_with_fallback,
    model_record,
    save_checkpoint,
    verify_path,
)
from partrain.errors import ConfigError
from partrain.testing.parity import max_relative_difference

TIED = ("wte.weight", "lm_head.weight")
GPT2 = dict(vocab_size=256, n_embd=32, n_layer=1, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0)


def _model(seed: int):
    from partrain.models.build import build_meta_model
    from partrain.models.materialize import materialize
    from partrain.parallel.optimizer import make_torch_optimizer, param_groups

    mc = ModelConfig(arch="gpt2", config=dict(GPT2))
    model = materialize(build_meta_model(mc), mc, seed=seed, device="cpu")
    opt = make_torch_optimizer(param_groups(model, OptimConfig().weight_decay), OptimConfig())
    x = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(seed))
    model(input_ids=x[:, :-1], labels=x[:, 1:]).loss.backward()
    opt.step()
    return mc, model, opt


@pytest.fixture
def two_saves(tmp_path):
    """Checkpoints step-1 and step-2 of different weights, and a fresh model to load into."""
    root = tmp_path / "ckpt"
    for step in (1, 2):
        mc, model, opt = _model(seed=step)
        save_checkpoint(root, step, [model], opt, {"step": step}, {"model": model_record(mc)}, keep_last=0)
    mc, model, opt = _model(seed=9)
    return root, model, opt, {"model": model_record(mc)}


def _largest_item(folder: Path, name: str):
    """(offset, length) of the largest model tensor chunk DCP stored in data file `name`, leaving out
    GPT-2's tied embedding and head (both are stored; loading one overwrites a change to the other)."""
    from partrain.checkpoint.safe_io import read_metadata

    items = [
        s
        for index, s in read_metadata(folder).storage_data.items()
        if s.relative_path == name and index.fqn.startswith("model.") and not index.fqn.endswith(TIED)
    ]
    best = max(items, key=lambda s: s.length)
    return best.offset, best.length


def flip_sign_bits(folder: Path, name: str = "__0_0.distcp", count: int = 256) -> None:
    """Negate `count` float32 values in the middle of the largest tensor of a shard: same size, plausible data."""
    offset, length = _largest_item(folder, name)
    path = folder / name
    data = bytearray(path.read_bytes())
    start = offset + (length // 2) // 4 * 4
    for i in range(count):
        data[start + 4 * i + 3] ^= 0x80  # the sign bit of a little-endian float32
    path.write_bytes(bytes(data))


def damage_zip_header(path: Path, at: int = 0) -> None:
    """Overwrite the local-file-header signature ("PK\\x03\\x04") of the torch.save blob at byte `at`."""
    data = bytearray(path.read_bytes())
    assert data[at : at + 4] == b"PK\x03\x04", "not a torch.save zip"
    data[at : at + 4] = b"XXXX"
    path.write_bytes(bytes(data))


def strip_checksums(folder: Path) -> None:
    """Turn a checkpoint into the format_version 1 of older partrain (sizes only)."""
    record_path = folder / "partrain.json"
    record = json.loads(record_path.read_text())
    record.pop("sha256")
    record["format_version"] = 1
    record_path.write_text(json.dumps(record))


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- same-size corruption ---------------------------------------------------------------------------


def load_and_get(ckpt: Path, model, opt, meta):
    load_checkpoint(ckpt, [model], opt, meta)
    return model


def test_sign_flip_is_loaded_silently_without_checksums_and_refused_with_them(two_saves, caplog):
    root, model, opt, meta = two_saves
    ckpt = root / "step-00000002"
    clean = _weights(load_and_get(ckpt, model, opt, meta))
    flip_sign_bits(ckpt)
    shard = ckpt / "__0_0.distcp"
    with pytest.raises(CorruptCheckpoint) as err:
        load_checkpoint(ckpt, [model], opt, meta)
    assert f"checksum mismatch: {shard} was changed after it was saved" in str(err.value)
    assert err.value.problems[0].key == "checkpoint.resume" and err.value.problems[0].value == str(shard)

    with caplog.at_level(logging.WARNING, logger="partrain"):
        path, extra = load_with_fallback(root, [model], opt, meta)
    assert path == root / "step-00000001" and extra == {"step": 1}
    warned = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(warned) == 1 and "step-00000001" in warned[0] and "checksum mismatch" in warned[0]

    # What the probe saw: without checksums (a format_version 1 checkpoint) the same bytes load
    # silently as other weights, with one warning that nothing but sizes could be checked.
    strip_checksums(ckpt)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="partrain"):
        load_checkpoint(ckpt, [model], opt, meta)
    assert [r.getMessage() for r in caplog.records if "carries no checksums" in r.getMessage()]
    changed = [k for k, v in _weights(model).items() if not torch.equal(v, clean[k])]
    assert changed, "the sign flips did not reach any weight: the corruption is not the silent kind"


def test_export_and_verify_refuse_a_changed_file_naming_it(two_saves, cli, tmp_path):
    root, _, _, _ = two_saves
    ckpt = root / "step-00000002"
    flip_sign_bits(ckpt)
    shard = ckpt / "__0_0.distcp"
    with pytest.raises(CorruptCheckpoint) as err:
        export_hf(ckpt, tmp_path / "hf")
    assert err.value.problems[0].key == "PATH" and "checksum mismatch" in err.value.problems[0].rule
    assert not (tmp_path / "hf").exists()

    ran = cli("checkpoint", "export", str(ckpt), "--hf", str(tmp_path / "hf"))
    assert ran.code == 2 and str(shard) in ran.stderr and "checksum mismatch" in ran.stderr, ran.stderr
    assert "checkpoint.resume" not in ran.stderr

    ran = cli("checkpoint", "verify", str(ckpt))
    assert ran.code == 1, ran.stdout + ran.stderr
    assert ran.stdout.strip().splitlines() == [f"checksum mismatch: {shard} was changed after it was saved"]

    ran = cli("checkpoint", "verify", str(root / "step-00000001"))
    assert ran.code == 0 and ran.stdout.startswith("ok: 3 files,") and "MiB verified" in ran.stdout, ran.stdout

    # A folder of checkpoints: each one judged; --json carries the same verdicts.
    (root / "step-00000003").mkdir()
    ran = cli("checkpoint", "verify", str(root), "--json")
    report = json.loads(ran.stdout)
    assert ran.code == 1 and report["ok"] is False
    by_step = {c["step"]: c for c in report["checkpoints"]}
    assert sorted(by_step) == [1, 2, 3] and by_step[1]["ok"] and by_step[1]["checksums"]
    assert by_step[1]["files"] == 3 and by_step[1]["bytes"] > 0
    assert by_step[2]["problems"] == [f"checksum mismatch: {shard} was changed after it was saved"]
    assert "partrain.json" in by_step[3]["problems"][0]

    ran = cli("checkpoint", "verify", str(tmp_path / "nowhere"))
    assert ran.code == 2 and "PATH" in ran.stderr


def test_verify_finds_truncation_a_lost_file_and_a_bad_index(two_saves, cli):
    root, _, _, _ = two_saves
    ckpt = root / "step-00000002"
    (ckpt / "rng" / "rank-0.pt").unlink()
    index = ckpt / ".metadata"
    index.write_bytes(b"\0" * index.stat().st_size)
    ran = cli("checkpoint", "verify", str(ckpt))
    lines = ran.stdout.strip().splitlines()
    assert ran.code == 1
    assert f"{ckpt / 'rng' / 'rank-0.pt'} is missing from the checkpoint" in lines
    assert f"checksum mismatch: {index} was changed after it was saved" in lines
    assert any(line.startswith(f"{index} cannot be read") for line in lines)

    older = root / "step-00000001"
    strip_checksums(older)  # older checkpoints: sizes only, said so, still ok
    ran = cli("checkpoint", "verify", str(older))
    assert ran.code == 0 and "sizes only" in ran.stdout
    damage_zip_header(older / "rng" / "rank-0.pt")  # ... and every file must at least parse
    ran = cli("checkpoint", "verify", str(older))
    assert ran.code == 1 and ran.stdout.startswith(f"{older / 'rng' / 'rank-0.pt'} cannot be read: "), ran.stdout


# ---- torch's own read failures -----------------------------------------------------------------------


def test_damaged_zip_header_is_a_one_line_failure_and_auto_falls_back(two_saves, caplog):
    """No checksums to catch it first: dcp.load's CheckpointException (a BaseException) must be caught."""
    root, model, opt, meta = two_saves
    ckpt = root / "step-00000002"
    strip_checksums(ckpt)
    offset, _ = _largest_item(ckpt, "__0_0.distcp")
    damage_zip_header(ckpt / "__0_0.distcp", offset)
    with pytest.raises(CorruptCheckpoint) as err:
        load_checkpoint(ckpt, [model], opt, meta)
    assert err.value.problems[0].value == str(ckpt / "__0_0.distcp")
    assert len(str(err.value).splitlines()) == 1 and "Traceback" not in str(err.value)
    with caplog.at_level(logging.WARNING, logger="partrain"):
        path, _ = load_with_fallback(root, [model], opt, meta)
    assert path == root / "step-00000001"

    # Every checkpoint unusable: one ConfigError naming each one's cause, never a fresh start.
    strip_checksums(root / "step-00000001")
    damage_zip_header(root / "step-00000001" / "rng" / "rank-0.pt")
    with pytest.raises(ConfigError) as err:
        load_with_fallback(root, [model], opt, meta)
    named = [p.value for p in err.value.problems]
    assert named == [str(ckpt / "__0_0.distcp"), str(root / "step-00000001" / "rng" / "rank-0.pt")]


def test_incomplete_step_folder_is_skipped_with_a_warning_and_never_a_fresh_start(two_saves, caplog):
    root, model, opt, meta = two_saves
    (root / "step-00000002" / "partrain.json").unlink()
    with caplog.at_level(logging.WARNING, logger="partrain"):
        path, _ = load_with_fallback(root, [model], opt, meta)
    assert path == root / "step-00000001"
    assert any(
        "skipping" in r.getMessage() and "step-00000002" in r.getMessage() and "partrain.json" in r.getMessage()
        for r in caplog.records
    )
    # Nothing usable left: an error naming both, never a fresh start that would lose the run.
    (root / "step-00000001" / ".metadata").unlink()
    with pytest.raises(ConfigError) as err:
        load_with_fallback(root, [model], opt, meta)
    assert [p.value for p in err.value.problems] == [str(root / "step-00000001"), str(root / "step-00000002")]
    assert "lacks .metadata" in err.value.problems[0].rule


def test_info_and_export_errors_name_the_argument(two_saves, cli, tmp_path):
    root, _, _, _ = two_saves
    (root / "step-00000002" / "partrain.json").write_text("{not json")
    for args in (["info", str(root / "step-00000002")], ["export", str(root / "step-00000002"), "--hf", "x"]):
        ran = cli("checkpoint", *args, "--json")
        problems = json.loads(ran.stdout)["errors"]
        assert ran.code == 2 and problems[0]["key"] == "PATH", ran.stdout
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    ran = cli("checkpoint", "export", str(root / "step-00000001"), "--hf", str(blocker / "hf"), "--json")
    assert ran.code == 2 and json.loads(ran.stdout)["errors"][0]["key"] == "--hf", ran.stdout
    ran = cli("checkpoint", "export", str(root / "step-00000001"), "--hf", str(blocker))
    assert ran.code == 2 and "--hf" in ran.stderr and "Traceback" not in ran.stderr + ran.stdout


# ---- full disks and unwritable folders ------------------------------------------------------------------


def _failing_streams(monkeypatch, code: int, after_bytes: int) -> None:
    """DCP's file system writes `after_bytes` bytes in all, then every write fails with errno `code`."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    budget = [after_bytes]
    original = FileSystem.create_stream

    class Failing:
        def __init__(self, stream):
            self.stream = stream

        def write(self, data):
            if len(data) > budget[0]:
                raise OSError(code, os.strerror(code))
            budget[0] -= len(data)
            return self.stream.write(data)

        def __getattr__(self, name):
            return getattr(self.stream, name)

    import contextlib

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with original(self, path, mode) as stream:
            yield Failing(stream) if "w" in mode else stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)


@pytest.mark.parametrize(
    "code,named",
    [
        (errno.ENOSPC, "no space left on device writing {partial}: free space or set checkpoint.dir elsewhere"),
        (errno.EACCES, "permission denied writing {partial}"),
        (errno.EROFS, "read-only file system writing {partial}"),
    ],
)
def test_a_failing_disk_is_named_and_leaves_no_checkpoint(two_saves, monkeypatch, code, named):
    root, model, opt, meta = two_saves
    _failing_streams(monkeypatch, code, after_bytes=20_000)
    with pytest.raises(SaveFailed) as err:
        save_checkpoint(root, 3, [model], opt, {"step": 3}, meta, keep_last=1)
    assert str(err.value).startswith(named.format(partial=root / "step-00000003.partial"))
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000002"]  # nothing pruned either
    assert all(v.ok for v in verify_path(root))


def test_a_full_disk_under_async_save_is_named_when_waited_for(two_saves, monkeypatch):
    from partrain.checkpoint import wait_pending_save

    root, model, opt, meta = two_saves
    _failing_streams(monkeypatch, errno.ENOSPC, after_bytes=20_000)
    save_checkpoint(root, 3, [model], opt, {"step": 3}, meta, keep_last=1, async_save=True)
    with pytest.raises(SaveFailed, match=r"^no space left on device writing .*step-00000003\.partial: free space"):
        wait_pending_save()
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000002"]


def _one_rank_fails(rank: int, world: int, root: str) -> dict:
    """2 processes: rank 1's disk fills during a save; then rank 1 alone cannot read its RNG file."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    mc, model, opt = _model(seed=1)
    meta = {"model": model_record(mc)}
    save_checkpoint(Path(root), 1, [model], opt, {}, meta, keep_last=0)
    out = {}
    original = FileSystem.create_stream
    if rank == 1:
        _failing_streams(pytest.MonkeyPatch(), errno.ENOSPC, after_bytes=1000)
    try:
        save_checkpoint(Path(root), 2, [model], opt, {}, meta, keep_last=0)
    except SaveFailed as err:
        out["save"] = str(err)
    FileSystem.create_stream = original
    out["left"] = sorted(p.name for p in Path(root).iterdir())
    if rank == 0:
        strip_checksums(Path(root) / "step-00000001")  # so that only rank 1's own read can find it
        damage_zip_header(Path(root) / "step-00000001" / "rng" / "rank-1.pt")
    torch.distributed.barrier()
    try:
        load_checkpoint(Path(root) / "step-00000001", [model], opt, meta)
    except CorruptCheckpoint as err:
        out["load"] = [p.value for p in err.problems]
    return out


@pytest.mark.slow
def test_a_failure_on_one_rank_stops_every_rank_alike(tmp_path):
    """No rank may raise alone while the others wait in a collective (or load on): all raise the same."""
    from partrain.runtime.spawn import run_spawned

    root = tmp_path / "ckpt"
    spawn = tmp_path / "spawn"
    spawn.mkdir()
    results = run_spawned(_one_rank_fails, 2, spawn, str(root), timeout_s=120)
    partial = root / "step-00000002.partial"
    named = f"no space left on device writing {partial}: free space or set checkpoint.dir elsewhere"
    assert [r["save"] for r in results] == [named, named]
    assert [r["left"] for r in results] == [["step-00000001"]] * 2
    assert [r["load"] for r in results] == [[str(root / "step-00000001" / "rng" / "rank-1.pt")]] * 2


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir()
    if shutil.which("mount") is None:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    return done.returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB tmpfs, where this machine allows mounting one."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "1m"):
        pytest.skip("cannot mount a tmpfs here (test_a_failing_disk_is_named... covers ENOSPC with a failing writer)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_real_full_and_read_only_disk(small_disk):
    mc, model, opt = _model(seed=1)
    meta = {"model": model_record(mc)}
    save_checkpoint(small_disk, 1, [model], opt, {}, meta, keep_last=0)  # ~0.3 MiB: fits
    free = shutil.disk_usage(small_disk).free
    (small_disk / "ballast").write_bytes(b"\0" * max(0, free - 100_000))  # leave 100 kB: the next save cannot fit
    with pytest.raises(SaveFailed, match=r"^no space left on device writing .*step-00000002\.partial: free space"):
        save_checkpoint(small_disk, 2, [model], opt, {}, meta, keep_last=0)
    assert sorted(p.name for p in small_disk.iterdir()) == ["ballast", "step-00000001"]
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    with pytest.raises(SaveFailed, match=r"^read-only file system writing "):
        save_checkpoint(small_disk, 2, [model], opt, {}, meta, keep_last=0)


# ---- through the real trainer: 2 processes -----------------------------------------------------------------

TRAIN = [
    "recipe=gpt-dp",
    "train.seq_len=64",
    "data.max_bytes=1000000",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.eval_every=0",
    "train.eval_batches=0",
]


def _train(args, run_dir: Path, steps: int) -> tuple:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "partrain.cli",
            "train",
            *TRAIN,
            *args,
            f"train.steps={steps}",
            f"train.run_dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "1000"},  # rich would wrap the long warning lines
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return proc.stdout, {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """6 steps on 2 processes, checkpoints at 2, 4, 6 (real processes through the worker's code,
    testing.in_process; the damaged resume below goes through `partrain train`)."""
    from partrain.rehearse.runs import train_all
    from partrain.testing.parity import parity_args

    base = tmp_path_factory.mktemp("faults")
    extra = [f"data.cache_dir={base / 'cache'}", "checkpoint.every_steps=2", "checkpoint.keep_last=0"]
    run = train_all({"straight": parity_args([*TRAIN, *extra], 6)}, base)["straight"]
    return run.run_dir, dict(enumerate(run.losses, start=1)), base / "cache"


@pytest.mark.slow
def test_resume_auto_falls_back_past_damage_and_trains_exactly(straight, tmp_path):
    run_dir, clean_losses, cache = straight
    ckpts = tmp_path / "ckpts"
    shutil.copytree(run_dir / "checkpoints", ckpts)
    six, seven, eight = (ckpts / f"step-0000000{s}" for s in (6, 7, 8))
    shutil.copytree(six, seven)
    shutil.copytree(six, eight)
    flip_sign_bits(six, "__1_0.distcp")  # same size: only the checksum tells
    strip_checksums(seven)
    damage_zip_header(seven / "rng" / "rank-1.pt")  # read by rank 1 alone, after dcp.load
    (eight / "partrain.json").unlink()

    resumed = tmp_path / "resumed"
    out, losses = _train([f"data.cache_dir={cache}", f"checkpoint.dir={ckpts}", "checkpoint.resume=auto"], resumed, 6)
    warnings = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert any(str(eight) in w and "lacks partrain.json" in w for w in warnings), out
    assert any(str(seven) in w and "rank-1.pt" in w and "falling back" in w for w in warnings), out
    assert any(f"checksum mismatch: {six / '__1_0.distcp'} was changed after it was saved" in w for w in warnings), out
    assert any("no checksums" in w for w in warnings), out
    assert sorted(losses) == [5, 6]
    # Resumed from step 4 (exact resume: tests/test_resume.py), not from the damaged weights.
    assert max_relative_difference([clean_losses[s] for s in (5, 6)], [losses[s] for s in (5, 6)]) <= 1e-6

"""Config errors found before any process starts (issue 14, items 5-7): exit 2, every problem in one
message, no traceback, no worker started, no run folder, no empty cache folder left behind.

The launcher runs in-process with process starts refused and recorded, so "nothing started" is
proven, not assumed. Read-only and full disks are real small tmpfs mounts where this machine allows
them (root); elsewhere chmod stands in for read-only and a writer failing with ENOSPC for a full disk.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import List

import pytest
from conftest import refuse_process_starts

from partrain.blueprint.config.compose import compose
from partrain.blueprint.validate import validate
from partrain.errors import ConfigError

TINY = ["cluster.devices_per_node=1", "train.seq_len=32", "data.max_bytes=20000", "train.eval_batches=0"]
"""One process, short windows, a small slice of the builtin corpus."""


@dataclass
class Result:
    code: int
    out: str
    spawned: List[str]


@pytest.fixture
def partrain(tmp_path, monkeypatch):
    """The real CLI and launcher in-process, in tmp_path/cwd, with every process start refused."""
    from typer.testing import CliRunner

    from partrain.cli import app

    spawned, _ = refuse_process_starts(monkeypatch)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "PARTRAIN_RECIPES"):
        monkeypatch.delenv(var, raising=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "250")

    def run(*args: str) -> Result:
        result = CliRunner().invoke(app, list(args), catch_exceptions=True)
        out = result.stdout + result.stderr
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            out += "".join(traceback.format_exception(result.exception))
        return Result(result.exit_code, out, list(spawned))

    return run


def refused(ran: Result, *words: str) -> str:
    """Exit 2, each of `words` in the message, no traceback, no process started."""
    assert ran.code == 2, ran.out
    assert "Traceback" not in ran.out, ran.out
    assert not ran.spawned, ran.spawned
    flat = " ".join(ran.out.split())
    for word in words:
        assert word in flat, (word, ran.out)
    return flat


def _mount(folder: Path, options: str) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    return mount.returncode == 0


# Fixtures that mount come before `partrain` in a test's arguments: pytest sets fixtures up in that
# order, so the mount runs before process starts are refused and the unmount after they are allowed again.
@pytest.fixture
def read_only(tmp_path):
    """(folder nobody can write in, the words naming why): a read-only tmpfs, else a chmod 555 folder."""
    folder = tmp_path / "ro"
    if _mount(folder, "ro,size=64k"):
        yield folder, "read-only file system"
        subprocess.run(["umount", str(folder)], check=True)
    elif os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder, "permission denied"
        folder.chmod(0o755)
    else:
        pytest.skip("root without mount: no way to make a read-only folder here")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real 2-step, 1-process run with a checkpoint at step 2: (checkpoints folder, the step folder)."""
    base = tmp_path_factory.mktemp("trained")
    ran = subprocess.run(
        [sys.executable, "-m", "partrain.cli", "train", *TINY, "train.steps=2", "checkpoint.every_steps=2"]
        + [f"train.run_dir={base / 'run'}", f"data.cache_dir={base / 'cache'}"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, HOME=str(base)),
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    root = base / "run" / "checkpoints"
    return root, root / "step-00000002"


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """save_pretrained folders of gpt2-tiny (as partrain's gpt2-tiny config) and of a narrower model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    base = tmp_path_factory.mktemp("pretrained")
    sizes = dict(vocab_size=256, n_positions=512, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(GPT2Config(n_embd=128, **sizes)).save_pretrained(base / "good")
    GPT2LMHeadModel(GPT2Config(n_embd=64, **sizes)).save_pretrained(base / "narrow")
    return base


# ---- paths and data: all problems listed, nothing created ---------------------------------------


def test_bad_paths_and_short_eval_split_are_listed_together_before_anything_starts(partrain, tmp_path):
    Path("afile").write_text("in the way")
    flat = refused(
        partrain(
            "train",
            *TINY,
            "train.run_dir=afile",
            "checkpoint.dir=afile/checkpoints",
            "checkpoint.every_steps=1",
            "data.max_bytes=2000",
            "train.eval_batches=1",
            f"data.cache_dir={tmp_path / 'cache'}",
        ),
        "train.run_dir='afile': is a file; a folder is expected",
        "checkpoint.dir='afile/checkpoints': afile is a file",
        "eval.bin holds 40 tokens",
        "fewer than one batch of",
    )
    assert flat.count("error:") == 3
    assert sorted(os.listdir(".")) == ["afile"]


def test_read_only_checkpoint_dir_is_fine_when_the_run_does_not_save(read_only, partrain):
    """Resuming from an archive nobody may write to: only a run that saves needs checkpoint.dir writable."""
    from partrain.preflight import check_before_launch

    folder, _ = read_only
    no_save = ["checkpoint.every_steps=0", "checkpoint.save_final=false"]
    check_before_launch(validate(compose([*TINY, f"checkpoint.dir={folder}", *no_save])))
    Path("afile").write_text("")
    with pytest.raises(ConfigError, match="checkpoint.dir='afile': is a file"):
        check_before_launch(validate(compose([*TINY, "checkpoint.dir=afile", *no_save])))


def test_train_split_too_short_exits_2_without_a_run_folder(partrain, tmp_path):
    refused(
        partrain("train", *TINY, "data.max_bytes=200", "train.run_dir=run", f"data.cache_dir={tmp_path / 'cache'}"),
        "train.seq_len=32",
        "train.bin holds",
        "fewer than one batch of 8 sequences",
    )
    assert not Path("run").exists()


def test_streaming_refusals_exit_2_before_anything_starts(partrain, tmp_path):
    """data.streaming tokenizes nothing ahead, but a missing or empty source and a vocabulary larger
    than the model's are still found before any process or folder exists."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n')
    for source, words in ((tmp_path / "nope.jsonl", ["data.source="]), (empty, ["data.source=", "no text"])):
        refused(partrain("train", *TINY, "data.streaming=true", f"data.source={source}", "train.run_dir=run"), *words)
    refused(
        partrain("train", *TINY, "data.streaming=true", "model.config.vocab_size=100", "train.run_dir=run"),
        "model.config.vocab_size=100",
        "256",
    )
    assert not Path("run").exists()


@pytest.mark.parametrize("eval_batches", [0, 1])
def test_preflight_length_rule_is_the_loaders_rule(tmp_path, eval_batches):
    """batch_problems refuses exactly what TokenBatches / EvalBatches refuse, at the boundary."""
    from partrain.data import EvalBatches, PackedData, TokenBatches, batch_problems

    seq_len, batch = 16, 4
    for n in (batch * seq_len, batch * seq_len + 1):  # one token short of one batch, then exactly one
        for name in ("train.bin", "eval.bin"):
            (tmp_path / name).write_bytes(bytes(2 * n))
        packed = PackedData(tmp_path / "train.bin", tmp_path / "eval.bin", "uint16", 256, 0, n, n, "byte", tmp_path)
        found = batch_problems(packed, seq_len, batch, with_eval=bool(eval_batches))
        try:
            TokenBatches.from_packed(packed, seq_len, batch, seed=0)
            if eval_batches:
                EvalBatches.from_packed(packed, seq_len, batch)
            loader_ok = True
        except ConfigError:
            loader_ok = False
        assert loader_ok == (not found) == (n == batch * seq_len + 1)


def test_data_error_leaves_no_cache_folder(partrain, tmp_path):
    Path("bad.jsonl").write_text('{"body": "no text field"}\n')
    cache = tmp_path / "new" / "deeper" / "cache"
    refused(
        partrain("train", *TINY, "data.source=bad.jsonl", "train.run_dir=run", f"data.cache_dir={cache}"),
        "has no field 'text'",
    )
    assert not (tmp_path / "new").exists() and not Path("run").exists()


def test_read_only_paths_are_named(read_only, partrain):
    folder, words = read_only
    flat = refused(
        partrain(
            "train",
            *TINY,
            f"train.run_dir={folder / 'run'}",
            f"checkpoint.dir={folder / 'ckpt'}",
            "checkpoint.every_steps=1",
            f"data.cache_dir={folder / 'cache'}",
        ),
        f"train.run_dir='{folder / 'run'}': cannot write in {folder}: {words}",
        f"checkpoint.dir='{folder / 'ckpt'}'",
        "data.cache_dir=",
    )
    assert flat.count(words) == 3
    assert os.listdir(folder) == []


@pytest.fixture
def full_disk(tmp_path):
    """(folder, whether it is a real 16 KiB tmpfs)."""
    folder = tmp_path / "full"
    mounted = _mount(folder, "size=16k")
    yield folder, mounted
    if mounted:
        subprocess.run(["umount", str(folder)], check=True)


def test_full_disk_is_named_and_leaves_no_cache(full_disk, partrain, monkeypatch):
    full, mounted = full_disk
    if not mounted:  # a writer that fails as a full disk does, where no small filesystem can be made
        import partrain.data.packing as packing

        def no_space(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(packing, "_write_stream", no_space)
    refused(
        partrain("train", *TINY, "train.run_dir=run", f"data.cache_dir={full / 'cache'}"),
        "data.cache_dir=",
        "cannot write the token cache: no space left on device",
    )
    assert os.listdir(full) == [] and not Path("run").exists()


# ---- pretrained weights -------------------------------------------------------------------------


def _damage(folder: Path, how: str) -> None:
    weights = folder / "model.safetensors"
    if how == "truncated":
        os.truncate(weights, weights.stat().st_size - 100)
    elif how == "header":
        with open(weights, "r+b") as f:
            f.seek(8)
            f.write(b"\x00garbage")
    elif how == "missing":
        weights.unlink()
        (folder / "pytorch_model.bin").write_bytes(b"pickled")
    elif how == "config":
        (folder / "config.json").write_text("{not json")


@pytest.mark.parametrize(
    "how, words",
    [
        ("truncated", ["model.safetensors is truncated"]),
        ("header", ["model.safetensors has a damaged safetensors header"]),
        ("missing", ["no safetensors weights", "pytorch_model.bin"]),
        ("config", ["config.json is not readable JSON"]),
    ],
)
def test_damaged_pretrained_folder_exits_2(partrain, pretrained, tmp_path, how, words):
    folder = tmp_path / "weights"
    shutil.copytree(pretrained / "good", folder)
    _damage(folder, how)
    refused(partrain("train", *TINY, f"model.pretrained={folder}", "train.run_dir=run"), "model.pretrained=", *words)
    assert not Path("run").exists()


def test_pretrained_shapes_must_match_the_model(pretrained):
    from partrain.preflight import weight_problems

    assert weight_problems(validate(compose([f"model.pretrained={pretrained / 'good'}"])).run.model) == []
    # The folder's own config is the model (the gpt2-tiny group's n_embd=128 does not apply) ...
    narrow = validate(compose([f"model.pretrained={pretrained / 'narrow'}"]))
    assert weight_problems(narrow.run.model) == [] and narrow.facts.hidden == 64
    # ... and a size key given on the command line overrides it, so the weights no longer fit.
    wide = compose([f"model.pretrained={pretrained / 'narrow'}", "model.config.n_embd=128"])
    (problem,) = weight_problems(validate(wide).run.model)
    assert "transformer.wte.weight has shape (256, 64) in the weight files, the model expects (256, 128)" in (
        problem.rule
    )


def test_sharded_and_per_expert_weights(tmp_path):
    """An index of shards with one shard lost; experts stored one Linear per expert with another width."""
    import yaml
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from partrain.blueprint.config.paths import conf_dir
    from partrain.preflight import weight_problems

    def saved(name: str, **changes):
        spec = yaml.safe_load((conf_dir() / "model" / f"{name}.yaml").read_text())
        folder = tmp_path / name
        model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[spec["arch"]](**{**spec["config"], **changes}))
        model.save_pretrained(folder, max_shard_size="100KB")
        # The group's sizes restated on the command line: a folder saved with other sizes no longer fits.
        restated = [f"model.config.{k}={v}" for k, v in spec["config"].items() if k in changes]
        return validate(compose([f"model={name}", f"model.pretrained={folder}", *restated])).run.model, folder

    llama, folder = saved("llama-tiny")
    assert weight_problems(llama) == []
    lost = sorted(folder.glob("model-*.safetensors"))[1]
    lost.unlink()
    assert [p.rule for p in weight_problems(llama)] == [f"{lost} is missing"]
    moe, _ = saved("qwen3-moe-tiny", moe_intermediate_size=128)
    (problem,) = weight_problems(moe)
    assert "experts.gate_up_proj has shape (4, 256, 64) in the weight files" in problem.rule


# ---- resume -------------------------------------------------------------------------------------


def test_resume_problems_exit_2_before_anything_starts(partrain, checkpoint, tmp_path):
    root, step = checkpoint
    partial = root / "step-00000004.partial"
    shutil.copytree(step, partial)
    damaged = tmp_path / "damaged"
    shutil.copytree(step, damaged / step.name)
    (damaged / step.name / "partrain.json").write_text("{")
    cut = tmp_path / "cut" / step.name  # a named checkpoint has no fallback: a cut shard stops the launch
    shutil.copytree(step, cut)
    shard = next(cut.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    try:
        cases = [
            ([f"checkpoint.resume={partial}"], ["unfinished save", f"checkpoint.resume={step}"]),
            ([f"checkpoint.resume={root}"], ["a folder of checkpoints (1 complete)"]),
            ([f"checkpoint.resume={step}", "model.config.n_layer=3"], ["model.config.n_layer=3", "n_layer=4"]),
            (["checkpoint.resume=auto", f"checkpoint.dir={root}", "model.config.n_layer=2"], ["n_layer=4"]),
            (["checkpoint.resume=auto", f"checkpoint.dir={damaged}"], ["partrain.json", "cannot be parsed"]),
            ([f"checkpoint.resume={cut}"], [f"{shard} is truncated or changed: 100 bytes"]),
        ]
        for overrides, words in cases:
            refused(partrain("train", *TINY, "train.run_dir=run", *overrides), *words)
            assert not Path("run").exists()
    finally:
        shutil.rmtree(partial)


def test_resume_of_the_same_model_passes(checkpoint, tmp_path):
    from partrain.preflight import check_before_launch

    root, step = checkpoint
    v = validate(compose([*TINY, f"checkpoint.resume={step}", f"train.run_dir={tmp_path / 'run'}"]))
    check_before_launch(v)  # raises on any problem
    assert not (tmp_path / "run").exists()


def test_export_to_a_bad_path_exits_2(read_only, partrain, checkpoint):
    _, step = checkpoint
    folder, words = read_only
    Path("afile").write_text("")
    refused(partrain("checkpoint", "export", str(step), "--hf", "afile/out"), "--hf='afile/out'", "afile is a file")
    refused(partrain("checkpoint", "export", str(step), "--hf", str(folder / "out")), words)


def test_export_onto_a_full_disk_is_one_line(full_disk, partrain, checkpoint, monkeypatch):
    _, step = checkpoint
    full, mounted = full_disk
    if not mounted:  # safetensors reports a full disk as text only: inject that where no tmpfs can be made
        import partrain.checkpoint as ckpt

        def no_space(*args, **kwargs):
            raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

        monkeypatch.setattr(ckpt, "export_hf_report", no_space)
    ran = partrain("checkpoint", "export", str(step), "--hf", str(full / "out"))
    assert ran.code == 1 and "Traceback" not in ran.out, ran.out
    assert f"export to {full / 'out'} failed: no space left on device" in " ".join(ran.out.split())


# ---- other commands' paths ----------------------------------------------------------------------


def test_schedule_svg_bad_paths_exit_2(partrain):
    Path("folder").mkdir()
    for svg, words in (("missing/x.svg", "no such file or folder"), ("folder", "is a folder, a file is expected")):
        for command in (["plan"], ["train", "--dry-run"]):
            refused(partrain(*command, "recipe=gpt-3d", "--schedule-svg", svg), "--schedule-svg=", words)


def test_bench_out_not_writable_exits_2(read_only, partrain):
    folder, words = read_only
    refused(partrain("bench", "comm", "--out", str(folder / "p.json")), f"--out='{folder / 'p.json'}'", words)
    Path("afile").write_text("")
    refused(partrain("bench", "comm", "--out", "afile/p.json"), "afile is a file")


# ---- minor config items -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["hydra.job.name=x"], ["hydra.job.name='x'", "Hydra's own settings", "drop it"]),
        (["recipe=gpt-3d", "recipe=gpt-dp"], ["recipe='gpt-dp'", "chosen twice"]),
        (["model=gpt2-tiny", "model=llama-tiny"], ["model='llama-tiny'", "chosen twice"]),
        (["optim.lr=inf"], ["optim.lr=inf", "finite"]),
        (["optim.lr=nan", "optim.beta2=inf", "optim.grad_clip=inf"], ["optim.lr=nan", "optim.beta2", "grad_clip"]),
    ],
)
def test_minor_config_items_exit_2(partrain, overrides, words):
    flat = refused(partrain("train", *overrides, "--dry-run"), *words)
    if "optim.lr=nan" in overrides:  # one problem per key: the range check does not repeat it
        assert flat.count("error:") == 3


def test_plain_key_given_twice_keeps_hydras_later_wins():
    assert compose(["parallel.tp=2", "parallel.tp=1"]).parallel.tp == 1
    assert compose(["recipe=gpt-3d", "recipe=gpt-3d"]).recipe == "gpt-3d"


def test_parquet_fix_names_pyarrow(tmp_path, monkeypatch):
    from partrain.data.formats import read_documents

    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConfigError) as err:
        list(read_documents(tmp_path / "x.parquet", "text"))
    assert err.value.problems[0].fix == "pip install pyarrow"


def test_user_started_torchrun_rank0_checks_before_preparing(tmp_path):
    """Under torchrun or srun started by the user, rank 0 runs the same checks before the run folder."""
    from partrain.launch import launch

    blocker = tmp_path / "afile"
    blocker.write_text("")
    v = validate(compose([*TINY, f"train.run_dir={blocker / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"]))
    # As a worker, launch() blocks SIGINT/SIGTERM in this thread for its stop watcher; every process
    # this test session starts afterwards would inherit that mask (a bash trap then never fires).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    try:
        with pytest.raises(ConfigError) as err:
            launch(v, console=None, environ={"RANK": "0", "WORLD_SIZE": "1"})
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    assert [p.key for p in err.value.problems] == ["train.run_dir"]

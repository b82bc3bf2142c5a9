"""Distributed checkpoints: resharding across layouts, atomic commits, damaged files, HF export.

One 4-process run (gloo) trains one AdamW step under FSDP2 (zero3, dp=2) x TP=2 for a tied GPT-2
and a Llama, saves, and writes the gathered full weights and optimizer state next to the
checkpoint. That checkpoint is then loaded into a one-process plain model, into ZeRO-1 over 2
processes (which saves again, asynchronously) and into pipeline-style stage modules, and exported to
Hugging Face format. Everything is compared bit for bit (torch.equal), logits within 1e-5.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
from pathlib import Path

import pytest
import torch

from partrain.blueprint.config.schema import ModelConfig, OptimConfig
from partrain.checkpoint import (
    CorruptCheckpoint,
    checkpoint_info,
    complete_checkpoints,
    export_hf,
    find_resume,
    load_checkpoint,
    load_with_fallback,
    model_record,
    save_checkpoint,
    step_dir,
)
from partrain.errors import ConfigError
from partrain.runtime.spawn import run_spawned

CFGS = {
    "gpt2": dict(
        vocab_size=256,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "llama": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
    ),
}
ARCHS = tuple(CFGS)


def _model_cfg(arch: str, **override) -> ModelConfig:
    return ModelConfig(arch=arch, config={**CFGS[arch], **override})


def _batch(rows: int = 4, seq: int = 16, seed: int = 0):
    ids = torch.randint(0, 256, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _snapshot(parts, optimizer) -> dict:
    """Full (gathered) weights and optimizer tensors keyed like the checkpoint ("model.<fqn>", "optim.state...")."""
    from partrain.checkpoint.state import model_state, optimizer_state

    out = {f"model.{k}": _full(v).detach().clone() for k, v in model_state(parts).items()}
    for k, v in optimizer_state(parts, optimizer).items():
        if torch.is_tensor(v):
            out[f"optim.{k}"] = _full(v).detach().clone()
    return out


def _compare(expected: dict, got: dict) -> list:
    """Keys whose tensors are not bit-identical (or missing)."""
    bad = [k for k in expected if k not in got or not torch.equal(expected[k], got[k])]
    return bad + [k for k in got if k not in expected]


# ---- child processes ------------------------------------------------------------------------------


def _save_fsdp_tp(rank: int, world: int, root: str) -> dict:
    """dp=2 (FSDP2, zero3) x tp=2: one AdamW step, save, and the gathered originals."""
    from partrain.blueprint.layout import Layout
    from partrain.models.adapters import get_adapter
    from partrain.models.build import build_meta_model
    from partrain.models.loss import forward_loss
    from partrain.models.materialize import materialize
    from partrain.parallel import data_parallel
    from partrain.parallel.tensor_parallel import apply_tp, loss_context
    from partrain.runtime.mesh import build_mesh

    mesh = build_mesh(Layout(tp=2, dp=2, dp_shard=2), "cpu")
    placements = {}
    for arch in ARCHS:
        mc = _model_cfg(arch)
        model = build_meta_model(mc)
        adapter = get_adapter(model)
        apply_tp(model, adapter, mesh["tp"], sequence_parallel=False)
        data_parallel.apply_fsdp(model, adapter, mesh, 3)
        materialize(model, mc, seed=7, device="cpu")
        dp = data_parallel.wrap(model, mesh, 3, OptimConfig())
        x, y = _batch()
        rows = slice(mesh.local("dp") * 2, mesh.local("dp") * 2 + 2)
        with loss_context(2, True)():
            forward_loss(dp.module, x[rows], y[rows]).backward()
        dp.optimizer.step()
        save_checkpoint(
            Path(root) / arch, 1, [model], dp.optimizer, {"data": {"step": 1}}, {"model": model_record(mc)}, keep_last=2
        )
        snap = _snapshot([model], dp.optimizer)
        if rank == 0:
            torch.save(snap, Path(root) / f"{arch}-originals.pt")
        placements[arch] = str(model.get_parameter(adapter.embedding_paths[0] + ".weight").placements)
    return placements


def _load_under(layout: dict, zero_stage: int, arch: str, ckpt: Path):
    """A fresh model (other seed) and optimizer under `layout`, with `ckpt` loaded into them."""
    from partrain.blueprint.layout import Layout
    from partrain.models.adapters import get_adapter
    from partrain.models.build import build_meta_model
    from partrain.models.materialize import materialize
    from partrain.parallel import data_parallel
    from partrain.parallel.tensor_parallel import apply_tp
    from partrain.runtime.mesh import build_mesh

    mesh = build_mesh(Layout(**layout), "cpu")
    mc = _model_cfg(arch)
    model = build_meta_model(mc)
    adapter = get_adapter(model)
    apply_tp(model, adapter, mesh["tp"], sequence_parallel=False)
    if data_parallel.uses_fsdp(zero_stage):
        data_parallel.apply_fsdp(model, adapter, mesh, zero_stage)
    materialize(model, mc, seed=99, device="cpu")  # other weights: the load must overwrite them
    dp = data_parallel.wrap(model, mesh, zero_stage, OptimConfig())
    record = load_checkpoint(ckpt, [model], dp.optimizer, {"model": model_record(mc)})
    return model, dp, record


def _zero1_then_other_layouts(rank: int, world: int, root: str) -> dict:
    """2 processes. ZeRO-1 (dp=2) loads the FSDP x TP checkpoint, takes a step and saves
    asynchronously (step 2); then TP=2 and FSDP zero2 (dp=2) load that ZeRO-1 checkpoint."""
    from partrain.checkpoint import wait_pending_save
    from partrain.models.loss import forward_loss
    from partrain.parallel.zero1_optimizer import ShardedOptimizer

    out = {}
    for arch in ARCHS:
        model, dp, record = _load_under(dict(dp=2, dp_shard=2), 1, arch, step_dir(Path(root) / arch, 1))
        assert isinstance(dp.optimizer, ShardedOptimizer)
        expected = torch.load(Path(root) / f"{arch}-originals.pt", weights_only=True)
        out[f"{arch}/zero1"] = {
            "mismatch": _compare(expected, _snapshot([model], dp.optimizer)),
            "extra": record["extra"],
        }
        x, y = _batch(seed=1)
        rows = slice(rank * 2, rank * 2 + 2)
        dp.optimizer.zero_grad()
        forward_loss(dp.module, x[rows], y[rows]).backward()
        dp.finish_gradients()
        dp.optimizer.step()
        snap = _snapshot([model], dp.optimizer)
        if rank == 0:
            torch.save(snap, Path(root) / f"{arch}-zero1-originals.pt")
        save_checkpoint(
            Path(root) / arch,
            2,
            [model],
            dp.optimizer,
            {"data": {"step": 2}},
            {"model": model_record(_model_cfg(arch))},
            keep_last=2,
            async_save=True,
        )
        wait_pending_save()
        expected = snap
        for name, layout, zero in (("tp2", dict(tp=2), 0), ("fsdp-zero2", dict(dp=2, dp_shard=2), 2)):
            model, dp, record = _load_under(layout, zero, arch, step_dir(Path(root) / arch, 2))
            out[f"{arch}/{name}"] = {
                "mismatch": _compare(expected, _snapshot([model], dp.optimizer)),
                "extra": record["extra"],
            }
    return out


# ---- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The 4-process FSDP2 x TP checkpoints (step 1), then the ZeRO-1 ones (step 2)."""
    root = tmp_path_factory.mktemp("ckpt")
    placements = run_spawned(_save_fsdp_tp, 4, tmp_path_factory.mktemp("spawn4"), str(root))
    zero1 = run_spawned(_zero1_then_other_layouts, 2, tmp_path_factory.mktemp("spawn2"), str(root))
    return root, placements[0], zero1


def _plain(arch: str, seed: int = 99):
    from partrain.models.build import build_meta_model
    from partrain.models.materialize import materialize
    from partrain.parallel.optimizer import make_torch_optimizer, param_groups

    mc = _model_cfg(arch)
    model = materialize(build_meta_model(mc), mc, seed=seed, device="cpu")
    return mc, model, make_torch_optimizer(param_groups(model, OptimConfig().weight_decay), OptimConfig())


# ---- (a) resharding ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_fsdp_tp_checkpoint_loads_into_plain_model_bit_exact(saved, arch):
    root, placements, _ = saved
    assert "Shard" in placements[arch]  # the saved embedding really was sharded over dp and tp
    mc, model, opt = _plain(arch)
    record = load_checkpoint(step_dir(root / arch, 1), [model], opt, {"model": model_record(mc)})
    assert record["extra"] == {"data": {"step": 1}} and record["world_size"] == 4
    expected = torch.load(root / f"{arch}-originals.pt", weights_only=True)
    assert _compare(expected, _snapshot([model], opt)) == []
    assert float(expected[f"optim.state.{next(iter(dict(model.named_parameters())))}.step"]) == 1.0


@pytest.mark.slow
def test_fsdp_tp_checkpoint_loads_into_zero1_and_zero1_saves_back(saved):
    root, _, results = saved
    for arch in ARCHS:
        for rank_result in results:  # every rank of every layout holds exactly its part of the saved state
            for name, step in (("zero1", 1), ("tp2", 2), ("fsdp-zero2", 2)):
                assert rank_result[f"{arch}/{name}"]["mismatch"] == [], (arch, name)
                assert rank_result[f"{arch}/{name}"]["extra"] == {"data": {"step": step}}, (arch, name)
        # The asynchronous ZeRO-1 save of step 2 loads into one plain process, equal to ZeRO-1's gathered state.
        mc, model, opt = _plain(arch)
        load_checkpoint(step_dir(root / arch, 2), [model], opt, {"model": model_record(mc)})
        expected = torch.load(root / f"{arch}-zero1-originals.pt", weights_only=True)
        assert _compare(expected, _snapshot([model], opt)) == []
        assert [s for s, _ in complete_checkpoints(root / arch)] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_loads_into_pipeline_stage_modules(saved, arch):
    """Two pipeline chunks on one rank (as ZBV places them) with one optimizer over both."""
    from partrain.models.adapters import get_adapter
    from partrain.models.build import build_meta_model
    from partrain.models.materialize import materialize
    from partrain.parallel.pipeline import build_stage_module

    root, _, _ = saved
    mc = _model_cfg(arch)
    meta = build_meta_model(mc)
    adapter = get_adapter(meta)
    parts = [
        materialize(build_stage_module(meta, adapter, c, 2, range(c, c + 1)), mc, seed=99, device="cpu") for c in (0, 1)
    ]
    opt = torch.optim.AdamW([p for part in parts for p in part.parameters()], foreach=False)
    load_checkpoint(step_dir(root / arch, 1), parts, opt, {"model": model_record(mc)})
    expected = torch.load(root / f"{arch}-originals.pt", weights_only=True)
    seen = set()
    for part in parts:  # a tied copy in the last chunk must hold the same weights and state as the first
        for name, p in part.named_parameters():
            assert torch.equal(p.detach(), expected[f"model.{name}"]), name
            for state_name, value in opt.state[p].items():
                assert torch.equal(value, expected[f"optim.state.{name}.{state_name}"]), (name, state_name)
                seen.add(f"optim.state.{name}.{state_name}")
    assert seen == {k for k in expected if k.startswith("optim.state.")}


@pytest.mark.parametrize("arch", ARCHS)
def test_pipeline_parts_save_and_load_like_the_plain_model(arch, tmp_path):
    """One optimizer over two stage modules (own FQN mapping, the tied copy saved once) round-trips
    through a plain one-process model both ways."""
    from partrain.models.adapters import get_adapter
    from partrain.models.build import build_meta_model
    from partrain.models.loss import forward_loss
    from partrain.models.materialize import materialize
    from partrain.parallel.pipeline import build_stage_module

    mc, model, opt = _plain(arch, seed=1)
    x, y = _batch()
    forward_loss(model, x, y).backward()
    opt.step()
    expected = _snapshot([model], opt)
    meta = {"model": model_record(mc)}
    plain_ckpt = save_checkpoint(tmp_path / "plain", 1, [model], opt, {}, meta, keep_last=0)

    full = build_meta_model(mc)
    adapter = get_adapter(full)
    parts = [
        materialize(build_stage_module(full, adapter, c, 2, range(c, c + 1)), mc, seed=5, device="cpu") for c in (0, 1)
    ]
    parts_opt = torch.optim.AdamW([p for part in parts for p in part.parameters()], foreach=False)
    load_checkpoint(plain_ckpt, parts, parts_opt, meta)
    assert _compare(expected, _snapshot(parts, parts_opt)) == []
    parts_ckpt = save_checkpoint(tmp_path / "parts", 1, parts, parts_opt, {}, meta, keep_last=0)

    mc, again, again_opt = _plain(arch, seed=2)
    load_checkpoint(parts_ckpt, [again], again_opt, meta)
    assert _compare(expected, _snapshot([again], again_opt)) == []


# ---- (b) atomicity and lookup -----------------------------------------------------------------------


def _fake_checkpoint(folder: Path, record: bool = True, metadata: bool = True) -> Path:
    folder.mkdir(parents=True)
    if record:
        (folder / "partrain.json").write_text("{}")
    if metadata:
        (folder / ".metadata").write_bytes(b"")
    return folder


def test_find_resume_ignores_partial_and_incomplete_folders(tmp_path):
    _fake_checkpoint(tmp_path / "step-00000010")
    _fake_checkpoint(tmp_path / "step-00000030.partial")  # a crash during a save
    _fake_checkpoint(tmp_path / "step-00000020", record=False)  # partrain.json never written
    _fake_checkpoint(tmp_path / "step-00000025", metadata=False)
    _fake_checkpoint(tmp_path / "step-00000040.deleting")
    assert find_resume(tmp_path, "auto") == tmp_path / "step-00000010"
    assert find_resume(tmp_path, "none") is None
    assert find_resume(tmp_path / "nothing-yet", "auto") is None
    assert find_resume(tmp_path, str(tmp_path / "step-00000010")) == tmp_path / "step-00000010"
    for bad, words in [
        ("step-00000030.partial", "unfinished save"),
        ("step-00000020", "partrain.json is missing"),
        ("step-00000025", ".metadata"),
        ("missing", "no such folder"),
        ("", "checkpoint folder"),
    ]:
        with pytest.raises(ConfigError) as err:
            find_resume(tmp_path, str(tmp_path / bad) if bad != "" else "")
        assert err.value.problems[0].key == "checkpoint.resume" and words in str(err.value), bad
    with pytest.raises(ConfigError, match="folder of checkpoints"):
        find_resume(tmp_path, str(tmp_path))


def test_save_commits_by_rename_and_keeps_last(tmp_path):
    mc, model, opt = _plain("llama", seed=1)
    meta = {"model": model_record(mc)}
    (tmp_path / "step-00000005.partial").mkdir()  # left by an earlier crash: cleared by the next save
    for step in (1, 2, 3):
        path = save_checkpoint(tmp_path, step, [model], opt, {"step": step}, meta, keep_last=2)
        assert path == tmp_path / f"step-{step:08d}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]
    record = json.loads((tmp_path / "step-00000003" / "partrain.json").read_text())
    assert record["step"] == 3 and record["extra"] == {"step": 3} and record["world_size"] == 1
    assert "rng/rank-0.pt" in record["files"] and ".metadata" in record["files"]
    info = checkpoint_info(tmp_path / "step-00000003")
    assert info["step"] == 3 and info["n_model_tensors"] == len(model.state_dict()) and info["size_bytes"] > 0
    with pytest.raises(TypeError):  # extra must be JSON; nothing is written
        save_checkpoint(tmp_path, 4, [model], opt, {"bad": object()}, meta, keep_last=2)
    assert not (tmp_path / "step-00000004.partial").exists()


def test_async_save_writes_the_state_of_the_moment_it_was_called(tmp_path):
    from partrain.checkpoint import wait_pending_save

    mc, model, opt = _plain("llama", seed=1)
    meta = {"model": model_record(mc)}
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    path = save_checkpoint(tmp_path, 7, [model], opt, {"step": 7}, meta, keep_last=1, async_save=True)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # training goes on while the save is written
    assert wait_pending_save() == path and path.is_dir()
    _, fresh, fresh_opt = _plain("llama", seed=2)
    assert load_checkpoint(path, [fresh], fresh_opt, meta)["extra"] == {"step": 7}
    assert all(torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())


def test_rng_state_restored_with_same_world_size(tmp_path):
    mc, model, opt = _plain("llama", seed=1)
    torch.manual_seed(123)
    path = save_checkpoint(tmp_path, 1, [model], opt, {}, {"model": model_record(mc)}, keep_last=0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    load_checkpoint(path, [model], opt, {"model": model_record(mc)})
    assert torch.equal(torch.rand(3), expected)


def test_run_meta_records_layout_model_and_data():
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate
    from partrain.checkpoint import run_meta

    meta = run_meta(
        validate(compose(["recipe=gpt-dp", "parallel.dp=2", "parallel.zero_stage=1", "cluster.devices_per_node=2"]))
    )
    assert meta["layout"]["dp"] == 2 and meta["layout"]["zero_stage"] == 1 and meta["world_size"] == 2
    assert (
        meta["model"]["arch"] == "gpt2" and meta["model"]["hf_config"]["n_layer"] == meta["model"]["config"]["n_layer"]
    )
    assert meta["data"]["tokenizer"] == "byte"
    json.dumps(meta)


# ---- (c) damaged checkpoints ------------------------------------------------------------------------


@pytest.fixture
def two_saves(tmp_path):
    mc, model, opt = _plain("gpt2", seed=1)
    meta = {"model": model_record(mc)}
    for step in (1, 2):
        save_checkpoint(tmp_path, step, [model], opt, {"step": step}, meta, keep_last=0)
    return tmp_path, model, opt, meta


def test_truncated_file_falls_back_under_auto_and_is_named_for_a_path(two_saves, caplog):
    root, model, opt, meta = two_saves
    data = root / "step-00000002" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])
    assert find_resume(root, "auto") == root / "step-00000002"  # looks complete by name: only loading finds out
    with caplog.at_level(logging.WARNING, logger="partrain"):
        path, extra = load_with_fallback(root, [model], opt, meta)
    assert path == root / "step-00000001" and extra == {"step": 1}
    assert any("step-00000002" in r.getMessage() and "falling back" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError) as err:
        load_checkpoint(root / "step-00000002", [model], opt, meta)
    assert str(data) in str(err.value) and "truncated" in str(err.value)


def test_unreadable_files_are_named(two_saves):
    root, model, opt, meta = two_saves
    ckpt = root / "step-00000002"
    (ckpt / "partrain.json").write_text("{not json")
    with pytest.raises(ConfigError, match="partrain.json.*not a partrain checkpoint / unknown layout"):
        load_checkpoint(ckpt, [model], opt, meta)
    (ckpt / "partrain.json").unlink()
    with pytest.raises(ConfigError, match="partrain.json.*missing"):
        load_checkpoint(ckpt, [model], opt, meta)
    # Same size, other bytes: the size check passes, reading the index fails.
    ckpt = root / "step-00000001"
    index = ckpt / ".metadata"
    index.write_bytes(b"\0" * index.stat().st_size)
    with pytest.raises(CorruptCheckpoint, match=r"\.metadata"):
        load_checkpoint(ckpt, [model], opt, meta)
    with pytest.raises(ConfigError, match="step-00000001"):  # every checkpoint damaged: an error, not a fresh start
        load_with_fallback(root, [model], opt, meta)


def test_metadata_that_would_run_code_is_refused(two_saves, tmp_path):
    root, model, opt, meta = two_saves
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    index = root / "step-00000002" / ".metadata"
    payload = pickle.dumps(Evil())
    index.write_bytes(payload)
    record_path = root / "step-00000002" / "partrain.json"
    record = json.loads(record_path.read_text())
    record["files"][".metadata"] = len(payload)
    record["sha256"][".metadata"] = hashlib.sha256(payload).hexdigest()  # a forger rewrites the record too
    record_path.write_text(json.dumps(record))
    with pytest.raises(CorruptCheckpoint, match="refusing to load"):
        load_checkpoint(root / "step-00000002", [model], opt, meta)
    assert not marker.exists()


# ---- (d) another model ------------------------------------------------------------------------------


def test_checkpoint_of_another_model_names_the_key(two_saves):
    from partrain.models.build import build_meta_model
    from partrain.models.materialize import materialize

    root, _, _, _ = two_saves
    mc = _model_cfg("gpt2", n_layer=3)
    model = materialize(build_meta_model(mc), mc, seed=1, device="cpu")
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError) as err:
        load_checkpoint(root / "step-00000002", [model], opt, {"model": model_record(mc)})
    problem = err.value.problems[0]
    assert problem.key == "model.config.n_layer" and problem.value == 3
    assert "step-00000002/partrain.json" in problem.rule and "n_layer=2" in problem.rule
    assert not isinstance(err.value, CorruptCheckpoint)  # resume=auto must not fall back past this
    llama = _model_cfg("llama")
    with pytest.raises(ConfigError) as err:
        load_checkpoint(root / "step-00000002", [model], opt, {"model": model_record(llama)})
    assert err.value.problems[0].key == "model.arch"


# ---- (e) Hugging Face export ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_export_hf_round_trip(saved, arch, tmp_path):
    from transformers import AutoModelForCausalLM

    root, _, _ = saved
    mc, model, opt = _plain(arch)
    load_checkpoint(step_dir(root / arch, 1), [model], opt, {"model": model_record(mc)})
    out = export_hf(step_dir(root / arch, 1), tmp_path / "hf", tokenizer_folder=None)
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert hf.config.tie_word_embeddings == (arch == "gpt2")
    x, _ = _batch()
    model.eval()
    with torch.no_grad():
        diff = (hf(input_ids=x).logits - model(input_ids=x).logits).abs().max().item()
    assert diff <= 1e-5, diff


def test_export_copies_the_runs_hf_tokenizer(two_saves, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        PreTrainedTokenizerFast,
    )

    core = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.train_from_iterator(["the cat sat on the mat"], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tok_dir = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", unk_token="[UNK]").save_pretrained(tok_dir)

    root, model, _, _ = two_saves
    out = export_hf(root / "step-00000002", tmp_path / "hf", tokenizer_folder=str(tok_dir))
    assert (
        AutoTokenizer.from_pretrained(out, local_files_only=True)("the cat")["input_ids"]
        == AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)("the cat")["input_ids"]
    )
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    x, _ = _batch()
    model.eval()
    with torch.no_grad():
        assert (hf(input_ids=x).logits - model(input_ids=x).logits).abs().max().item() <= 1e-5
    with pytest.raises(ConfigError, match="tokenizer"):
        export_hf(root / "step-00000002", tmp_path / "hf2", tokenizer_folder=str(tmp_path / "nope"))


def test_a_failed_export_leaves_the_earlier_export_whole_and_no_partial_files(two_saves, tmp_path, monkeypatch):
    """The export is written into OUT/.partial and moved up only when complete: a shard write that
    fails (a full disk here) leaves the earlier export's files byte for byte, and a new folder is
    not left behind at all."""
    import errno

    import partrain.checkpoint.hf_shards as hf_shards

    root = two_saves[0]
    out = export_hf(root / "step-00000001", tmp_path / "hf", tokenizer_folder=None)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    real = hf_shards.write_shard

    def full_disk(job):
        Path(job.file).write_bytes(b"half a shard")
        raise OSError(errno.ENOSPC, "No space left on device", job.file)

    monkeypatch.setattr(hf_shards, "write_shard", full_disk)
    for target in (out, tmp_path / "new"):
        with pytest.raises(OSError, match="No space"):
            export_hf(root / "step-00000002", target, tokenizer_folder=None)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert not (tmp_path / "new").exists()
    monkeypatch.setattr(hf_shards, "write_shard", real)
    again = export_hf(root / "step-00000002", out, tokenizer_folder=None)
    assert sorted(f.name for f in again.iterdir()) == sorted(before)

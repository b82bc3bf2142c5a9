"""Tests of partrain.data: tokenizers, corpus, packing cache, batches. Fast, no downloads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from partrain.blueprint.config.schema import DataConfig
from partrain.data import (
    ByteTokenizer,
    Corpus,
    EvalBatches,
    PackedData,
    TokenBatches,
    load_tokenizer,
    open_packed,
    packing,
    prepare_tokens,
    token_dtype,
)
from partrain.errors import ConfigError

SMALL = 200_000  # bytes of builtin corpus: enough for many batches, packs in milliseconds


def write_tokens(path: Path, n: int, dtype: str = "uint16") -> Path:
    """A token file whose token at position p is p % 60000: windows are recognisable by content."""
    (np.arange(n) % 60000).astype(dtype).tofile(path)
    return path


def rows_as_set(t: torch.Tensor) -> set:
    return {tuple(r) for r in t.tolist()}


# --- tokenizers ---------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.name) == (256, 0, "byte")
    text = "def f(x):\n    return 'héllo ✓ 𝛑'\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert 0 not in tok.encode("a\x00b")  # NUL would collide with the separator
    assert [a.tolist() for a in tok.encode_batch(["ab", "c"])] == [[97, 98], [99]]


def test_missing_tokenizer_folder_is_config_error(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_tokenizer(str(tmp_path / "nope"))
    assert err.value.problems[0].key == "data.tokenizer"


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    """A tiny word-level HF tokenizer trained offline and saved with save_pretrained."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = ["the cat sat on the mat", "a dog ate the cat food", "hello world of cats and dogs"]
    core.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    folder = tmp_path_factory.mktemp("tinytok")
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", unk_token="[UNK]").save_pretrained(folder)
    return folder


def test_hf_tokenizer_from_local_folder(hf_tokenizer_dir, tmp_path):
    tok = load_tokenizer(str(hf_tokenizer_dir))
    assert tok.eos_id == 1 and tok.vocab_size >= 10
    assert tok.name.startswith("hf:") and tok.name == load_tokenizer(str(hf_tokenizer_dir)).name
    ids = tok.encode("the cat sat")
    assert len(ids) == 3 and tok.eos_id not in ids and all(0 <= i < tok.vocab_size for i in ids)

    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in ["the cat sat", "hello world"]) + "\n")
    cfg = DataConfig(source=str(data), tokenizer=str(hf_tokenizer_dir), max_bytes=0, eval_fraction=0.0)
    packed = prepare_tokens(cfg, tmp_path / "cache")
    stream = np.fromfile(packed.train_path, dtype=packed.dtype).tolist()
    assert stream == tok.encode("the cat sat") + [1] + tok.encode("hello world") + [1]
    assert (packed.tokenizer, packed.eos_id, packed.dtype) == (tok.name, 1, "uint16")


def test_token_dtype():
    assert token_dtype(256) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(152064) == np.uint32


# --- corpus -------------------------------------------------------------------------------------


def test_builtin_corpus_is_deterministic_and_capped():
    cfg = DataConfig(source="builtin", max_bytes=50_000)
    a, b = Corpus.from_config(cfg), Corpus.from_config(cfg)
    assert a.files == b.files and a.identity() == b.identity()
    rel = [f.relative_to(a.root).as_posix() for f in a.files]
    assert rel == sorted(rel)
    assert not any(part in ("test", "tests", "site-packages") for r in rel for part in r.split("/"))
    docs = list(a.documents())
    assert docs == list(b.documents())
    assert sum(len(d.encode("utf-8")) for d in docs) == 50_000
    assert docs[0] == a.files[0].read_text(encoding="utf-8")


def test_txt_and_jsonl_files_and_folder(tmp_path):
    (tmp_path / "a.txt").write_text("first document\n\nstill the first\n")
    (tmp_path / "b.jsonl").write_text('{"body": "second"}\n\n{"body": "third", "x": 1}\n')
    (tmp_path / "notes.md").write_text("ignored: not a data suffix")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("fourth")
    cfg = DataConfig(source=str(tmp_path), text_field="body", max_bytes=0)
    docs = list(Corpus.from_config(cfg).documents())
    assert docs == ["first document\n\nstill the first\n", "second", "third", "fourth"]

    capped = DataConfig(source=str(tmp_path), text_field="body", max_bytes=40)
    assert "".join(Corpus.from_config(capped).documents()) == "".join(docs).encode()[:40].decode()


def _file(name, content):
    """A setup step for test_bad_sources: write `content` (str or bytes) to `name` in the test folder."""

    def make(folder: Path) -> Path:
        path = folder / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
        return path

    return make


@pytest.mark.parametrize(
    "setup, key, words",
    [
        (_file("missing.jsonl", None), "data.source", "no such file"),
        (_file("empty.txt", ""), "data.source", "empty"),
        (_file("data.csv", "a,b"), "data.source", "unsupported"),
        (_file("bad.jsonl", '{"text": "ok"}\nnot json\n'), "data.source", "line 2"),
        (_file("other.jsonl", '{"body": "x"}\n'), "data.text_field", "no field"),
        (_file("blank.jsonl", '{"text": ""}\n'), "data.source", "no text"),
        (_file("latin1.txt", "caf\xe9".encode("latin-1")), "data.source", "UTF-8"),
    ],
    ids=["missing", "empty", "suffix", "bad-json", "no-field", "no-text", "not-utf8"],
)
def test_bad_sources_are_config_errors(tmp_path, setup, key, words):
    source = setup(tmp_path)
    with pytest.raises(ConfigError) as err:
        prepare_tokens(DataConfig(source=str(source), max_bytes=0), tmp_path / "cache")
    problem = err.value.problems[0]
    assert problem.key == key and words in problem.rule and problem.fix
    assert not list((tmp_path / "cache").rglob("*.bin"))  # nothing half-built is left to trust


def test_parquet_without_pyarrow_names_the_package(tmp_path):
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        path = tmp_path / "data.parquet"
        path.write_bytes(b"PAR1 not really")
        with pytest.raises(ConfigError) as err:
            prepare_tokens(DataConfig(source=str(path), max_bytes=0), tmp_path / "cache")
        assert "pyarrow" in err.value.problems[0].fix and str(path) in str(err.value)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "data.parquet"
        pq.write_table(pa.table({"text": ["one", None, "two"]}), path)
        assert list(Corpus.from_config(DataConfig(source=str(path), max_bytes=0)).documents()) == ["one", "two"]


# --- packing ------------------------------------------------------------------------------------


def test_packing_layout_and_split(tmp_path):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ["abc", "de", "f" * 16]))
    cfg = DataConfig(source=str(tmp_path / "d.jsonl"), max_bytes=0, eval_fraction=0.25)
    packed = prepare_tokens(cfg, tmp_path / "cache")
    train = np.fromfile(packed.train_path, dtype=packed.dtype)
    evals = np.fromfile(packed.eval_path, dtype=packed.dtype)
    expected = list(b"abc\0de\0" + b"f" * 16 + b"\0")
    assert train.tolist() + evals.tolist() == expected
    assert (packed.n_train_tokens, packed.n_eval_tokens) == (18, 6)  # 24 tokens, last quarter held out
    assert packed.meta_path.parent.parent == tmp_path / "cache"


def test_cache_is_reused_and_keyed_by_inputs(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cfg = DataConfig(source="builtin", max_bytes=SMALL)
    first = prepare_tokens(cfg, cache)
    mtime = first.train_path.stat().st_mtime_ns

    def no_build(*args, **kwargs):
        raise AssertionError("cache hit expected, but the corpus was packed again")

    monkeypatch.setattr(packing, "_build", no_build)
    assert prepare_tokens(cfg, cache) == first
    assert first.train_path.stat().st_mtime_ns == mtime
    assert open_packed(first.meta_path) == first == open_packed(first) == open_packed(first.meta_path.parent)
    monkeypatch.undo()

    other = prepare_tokens(DataConfig(source="builtin", max_bytes=SMALL, eval_fraction=0.1), cache)
    assert other.meta_path.parent != first.meta_path.parent

    # data.cache_dir is used when no explicit root is given
    via_cfg = prepare_tokens(DataConfig(source="builtin", max_bytes=SMALL, cache_dir=str(cache)))
    assert via_cfg == first


def test_changed_source_file_rebuilds(tmp_path):
    data = tmp_path / "d.txt"
    data.write_text("version one")
    cfg = DataConfig(source=str(data), max_bytes=0, eval_fraction=0.0)
    a = prepare_tokens(cfg, tmp_path / "cache")
    data.write_text("version two, longer")
    b = prepare_tokens(cfg, tmp_path / "cache")
    assert a.meta_path != b.meta_path
    assert bytes(np.fromfile(b.train_path, dtype=b.dtype).astype(np.uint8)) == b"version two, longer\0"


def test_meta_is_written_last_and_crash_leaves_nothing_trusted(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cfg = DataConfig(source="builtin", max_bytes=SMALL)
    order = []
    real_replace = os.replace

    def recording_replace(src, dst):
        order.append(Path(dst).name)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", recording_replace)
    packed = prepare_tokens(cfg, cache)
    assert order[-1] == "meta.json" and set(order[:-1]) == {"train.bin", "eval.bin"}
    assert not [p for p in packed.meta_path.parent.iterdir() if p.name.endswith(".tmp")]

    # A crash before meta.json is renamed into place: the entry must not count as present.
    entry = packed.meta_path.parent
    for p in entry.iterdir():
        p.unlink()

    def crash_on_meta(src, dst):
        if Path(dst).name == "meta.json":
            raise KeyboardInterrupt("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_meta)
    with pytest.raises(KeyboardInterrupt):
        prepare_tokens(cfg, cache)
    assert not (entry / "meta.json").exists()
    assert not [p for p in entry.iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(FileNotFoundError):
        open_packed(entry)

    monkeypatch.setattr(os, "replace", real_replace)
    assert prepare_tokens(cfg, cache) == packed  # rebuilt from scratch, same result


def test_damaged_entry_is_rejected_and_rebuilt(tmp_path):
    cfg = DataConfig(source="builtin", max_bytes=SMALL)
    packed = prepare_tokens(cfg, tmp_path / "cache")
    with open(packed.train_path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError):
        open_packed(packed.meta_path)
    assert prepare_tokens(cfg, tmp_path / "cache") == packed


def test_unwritable_cache_and_stale_temps(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError) as err:
        prepare_tokens(DataConfig(source="builtin", max_bytes=1000), blocker / "cache")
    assert err.value.problems[0].key == "data.cache_dir"

    packed = prepare_tokens(DataConfig(source="builtin", max_bytes=1000), tmp_path / "cache")
    entry = packed.meta_path.parent
    # Builds happen in temporary folders beside the entry: a killed build's old one is removed, a
    # recent one (a build running elsewhere) is left alone.
    old, fresh = entry.with_name(f".{entry.name}.dead.tmp"), entry.with_name(f".{entry.name}.busy.tmp")
    for folder in (old, fresh):
        folder.mkdir()
        (folder / "train.bin").write_bytes(b"half a build")
    os.utime(old, (0, 0))
    packed.meta_path.unlink()
    assert prepare_tokens(DataConfig(source="builtin", max_bytes=1000), tmp_path / "cache") == packed
    assert not old.exists() and fresh.exists()


def _flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "no checksums"])
def test_a_damaged_cache_entry_is_detected_and_rebuilt_with_a_line(tmp_path, caplog, damage):
    """Sizes are checked on every open (workers), SHA-256 when a run prepares the entry; either way a
    damaged entry is rebuilt whole, saying so, and its tokens are the original ones again."""
    cfg = DataConfig(source="builtin", max_bytes=SMALL)
    packed = prepare_tokens(cfg, tmp_path / "cache")
    tokens = packed.train_path.read_bytes()
    meta = json.loads(packed.meta_path.read_text())
    assert set(meta["files"]) == {"train.bin", "eval.bin"} and len(meta["files"]["train.bin"]["sha256"]) == 64
    if damage == "flipped byte":
        _flip_one_byte(packed.train_path)
        assert open_packed(packed.meta_path) == packed  # sizes alone cannot tell: cheap for workers
        with pytest.raises(ValueError, match="SHA-256"):
            open_packed(packed.meta_path, verify=True)
    elif damage == "truncated":
        with open(packed.train_path, "r+b") as f:
            f.truncate(len(tokens) - 2)
        with pytest.raises(ValueError, match="bytes"):
            open_packed(packed.meta_path)
    else:  # an entry of an older partrain: trusted only with checksums
        packed.meta_path.write_text(json.dumps({k: v for k, v in meta.items() if k != "files"}))
        with pytest.raises(ValueError, match="no checksums"):
            open_packed(packed.meta_path)
    with caplog.at_level("WARNING", logger="partrain.data.packing"):
        assert prepare_tokens(cfg, tmp_path / "cache") == packed
    assert any("rebuilding the damaged data cache entry" in r.getMessage() for r in caplog.records)
    assert packed.train_path.read_bytes() == tokens and open_packed(packed.meta_path, verify=True) == packed
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [packed.meta_path.parent.name]  # nothing left aside


def test_a_builder_that_loses_the_race_uses_the_winners_entry(tmp_path, monkeypatch):
    """Two runs build the same entry at once: each builds in its own temporary folder; the second
    to finish finds the first one's whole entry in place, keeps it and drops its own."""
    cfg = DataConfig(source="builtin", max_bytes=SMALL)
    cache = tmp_path / "cache"
    winner = prepare_tokens(cfg, cache)
    winner_inode = winner.train_path.stat().st_ino
    real_exists = Path.exists

    def not_there_yet(path):  # the loser looked before the winner's rename
        return False if path == winner.meta_path else real_exists(path)

    monkeypatch.setattr(Path, "exists", not_there_yet)
    loser = prepare_tokens(cfg, cache)
    monkeypatch.undo()
    assert loser == winner and winner.train_path.stat().st_ino == winner_inode
    assert [p.name for p in cache.iterdir()] == [winner.meta_path.parent.name]  # the loser's folder is gone


def test_bad_numbers_are_config_errors(tmp_path):
    for cfg, key in (
        (DataConfig(max_bytes=-2), "data.max_bytes"),
        (DataConfig(eval_fraction=1.0), "data.eval_fraction"),
    ):
        with pytest.raises(ConfigError) as err:
            prepare_tokens(cfg, tmp_path)
        assert err.value.problems[0].key == key


# --- batches ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def packed_builtin(tmp_path_factory) -> PackedData:
    return prepare_tokens(
        DataConfig(source="builtin", max_bytes=SMALL, eval_fraction=0.05), tmp_path_factory.mktemp("cache")
    )


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_union_of_ranks_is_the_global_batch(packed_builtin, dp):
    batches = TokenBatches.from_packed(packed_builtin, seq_len=32, global_batch_size=8, seed=7)
    for step in (0, 1, batches.steps_per_epoch - 1, batches.steps_per_epoch + 3):
        full = batches.global_batch(step)
        assert full.shape == (8, 33) and full.dtype == torch.long
        parts = [batches.rank_batch(step, r, dp) for r in range(dp)]
        assert all(x.shape == (8 // dp, 32) for x, _ in parts)
        assert torch.equal(torch.cat([x for x, _ in parts]), full[:, :-1])
        assert torch.equal(torch.cat([y for _, y in parts]), full[:, 1:])


def test_windows_cover_an_epoch_once_and_reshuffle(tmp_path):
    path = write_tokens(tmp_path / "t.bin", 10 * 16 + 1)  # exactly 16 windows of seq_len 10
    batches = TokenBatches(path, "uint16", seq_len=10, global_batch_size=4, seed=3)
    assert (batches.n_windows, batches.steps_per_epoch) == (16, 4)
    epoch0 = np.concatenate([batches.windows(s) for s in range(4)])
    epoch1 = np.concatenate([batches.windows(s) for s in range(4, 8)])
    assert sorted(epoch0) == sorted(epoch1) == list(range(16))
    assert not np.array_equal(epoch0, epoch1)
    row = batches.global_batch(0)[0]
    start = int(batches.windows(0)[0]) * 10
    assert row.tolist() == list(range(start, start + 11))  # window k = tokens [10k, 10k + 11)
    # same inputs, same order; another seed, another order
    assert torch.equal(TokenBatches(path, "uint16", 10, 4, seed=3).global_batch(5), batches.global_batch(5))
    assert not torch.equal(TokenBatches(path, "uint16", 10, 4, seed=4).global_batch(0), batches.global_batch(0))


def test_resume_continues_identically(packed_builtin):
    def make():
        return TokenBatches.from_packed(packed_builtin, seq_len=16, global_batch_size=4, seed=11)

    reference = make()
    expected = [reference.next_batch(1, 2) for _ in range(7)]
    interrupted = make()
    for _ in range(3):
        interrupted.next_batch(1, 2)
    state = json.loads(json.dumps(interrupted.state_dict()))  # survives a checkpoint round trip
    resumed = make()
    resumed.load_state_dict(state)
    for x, y in expected[3:]:
        rx, ry = resumed.next_batch(1, 2)
        assert torch.equal(rx, x) and torch.equal(ry, y)

    changed = TokenBatches.from_packed(packed_builtin, seq_len=8, global_batch_size=4, seed=11)
    with pytest.raises(ConfigError) as err:
        changed.load_state_dict(state)
    assert err.value.problems[0].key == "train.seq_len"


def test_loader_reads_through_memmap(packed_builtin):
    batches = TokenBatches.from_packed(packed_builtin, seq_len=16, global_batch_size=4, seed=0)
    assert isinstance(batches._windows.tokens, np.memmap)


def test_too_short_file_and_bad_dp_are_config_errors(tmp_path):
    path = write_tokens(tmp_path / "t.bin", 100)
    with pytest.raises(ConfigError) as err:
        TokenBatches(path, "uint16", seq_len=64, global_batch_size=4, seed=0)
    problem = err.value.problems[0]
    assert problem.key == "train.seq_len" and "100 tokens" in problem.rule and "seq_len <= 24" in problem.fix
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError):
        TokenBatches(empty, "uint16", seq_len=4, global_batch_size=1, seed=0)
    batches = TokenBatches(path, "uint16", seq_len=4, global_batch_size=6, seed=0)
    with pytest.raises(ConfigError) as err:
        batches.rank_batch(0, 0, 4)
    assert err.value.problems[0].key == "train.global_batch_size"


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_eval_batches_are_fixed_and_layout_independent(packed_builtin, dp):
    evals = EvalBatches.from_packed(packed_builtin, seq_len=32, global_batch_size=8)
    assert evals.num_batches >= 2
    single = [evals.eval_batch(i) for i in range(3)]
    for i, (x, y) in enumerate(single):
        parts = [evals.eval_batch(i, r, dp) for r in range(dp)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
        assert torch.equal(x[:, 1:], y[:, :-1])
    tokens = np.fromfile(packed_builtin.eval_path, dtype=packed_builtin.dtype)
    assert single[1][0][0].tolist() == tokens[8 * 32 : 8 * 32 + 32].tolist()  # batch 1 starts at window 8
    wrapped = evals.eval_batch(evals.num_batches)
    assert torch.equal(wrapped[0], single[0][0])

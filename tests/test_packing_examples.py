"""Packed fine-tuning examples (issue 37 item 4): whole examples packed into train.seq_len windows,
position ids restarting at 0 per example, attention kept inside each example.

The packer's rows (boundaries, labels, position ids, truncation, determinism); the logits of a packed
window equal each example run alone (1e-5, Llama and GPT-2 through Hugging Face's own mask builder),
also gathered from real tp2, tp2 Megatron-SP (and a Mistral sliding window), sp2 ring and sp2 Ulysses
processes (one launch); and real multi-process runs on packed examples with uneven label counts
against one process: dp2, pp2 (1F1B), tp2, tp2 Megatron-SP, sp2 ring and sp2 Ulysses (the sp
attention's document masks; with recompute), one launch for all of them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from partrain.blueprint.config.compose import compose
from partrain.blueprint.validate import validate
from partrain.data.chat import IGNORE_INDEX
from partrain.data.example_packing import PackedExampleBatches, first_fit, run_packing_facts
from partrain.data.examples import Examples, prepare_examples
from partrain.rehearse.runs import train_all
from partrain.testing.parity import check_parity, parity_args, reference_overrides

STEPS = 3
SEQ_LEN = 256  # a window holds several of these chats (65 to 265 tokens)
GLOBAL_BATCH = 8


def _examples(lengths, seed: int = 0, vocab: int = 256) -> Examples:
    """In-memory examples of the given lengths; labels after the first quarter of each (an "answer")."""
    rng = np.random.default_rng(seed)
    ids, labels = [], []
    for n in lengths:
        x = rng.integers(1, vocab, n)
        lab = x.copy()
        lab[: n // 4] = IGNORE_INDEX
        ids.append(x)
        labels.append(lab)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return Examples(
        ids=np.concatenate(ids).astype(np.uint16),
        labels=np.concatenate(labels).astype(np.int32),
        offsets=offsets,
        n_train=len(lengths),
        vocab_size=vocab,
        pad_id=0,
        tokenizer="test",
        meta_path=Path("/nonexistent/meta.json"),
    )


def _documents(positions: torch.Tensor) -> list:
    """(start, length) of each run of positions 0, 1, 2, ... in a row."""
    starts = (positions == 0).nonzero().flatten().tolist() + [len(positions)]
    return [(a, b - a) for a, b in zip(starts, starts[1:])]


def test_first_fit_fills_the_oldest_open_window_with_room():
    window, n = first_fit(np.array([6, 6, 2, 4, 2, 1]), seq_len=8, open_windows=2)
    assert window.tolist() == [0, 1, 0, 2, 1, 2] and n == 3
    assert first_fit(np.array([5, 5, 3]), seq_len=8, open_windows=2)[0].tolist() == [0, 1, 0]
    # One open window: window 0 is closed when window 1 opens, and never filled again.
    assert first_fit(np.array([5, 5, 3]), seq_len=8, open_windows=1)[0].tolist() == [0, 1, 1]


def test_packed_rows_keep_examples_whole_and_apart():
    lengths = [20, 33, 7, 90, 150, 41, 12, 64, 5, 77, 30, 18, 200, 9, 51, 26]
    ex = _examples(lengths)
    batches = PackedExampleBatches(ex, 64, 4, seed=3, long_examples="truncate")
    assert batches.truncated == sum(n > 65 for n in lengths)
    seen = {}
    for w in range(batches.n_windows):
        inputs, labels, positions = batches._rows.rows(np.array([w]))
        inputs, labels, positions = inputs[0], labels[0], positions[0]
        p = batches.packing
        members = p.members[p.starts[w] : p.starts[w + 1]].tolist()
        docs = _documents(positions)
        assert [n for _, n in docs[: len(members)]] == p.slots[p.starts[w] : p.starts[w + 1]].tolist()
        for (start, n), e in zip(docs, members):
            x = np.asarray(ex.ids[ex.offsets[e] : ex.offsets[e + 1]], dtype=np.int64)
            lab = np.asarray(ex.labels[ex.offsets[e] : ex.offsets[e + 1]], dtype=np.int64)
            assert n == min(len(x) - 1, 64)
            assert inputs[start : start + n].tolist() == x[:n].tolist()
            # Shifted within the example: the last slot's target is the example's own token n, never
            # the first token of the next example.
            assert labels[start : start + n].tolist() == lab[1 : n + 1].tolist()
            seen[e] = seen.get(e, 0) + 1
        used = sum(n for _, n in docs[: len(members)])
        assert (labels[used:] == IGNORE_INDEX).all() and (inputs[used:] == ex.pad_id).all()
        assert int((labels != IGNORE_INDEX).sum()) == int(p.counts[w])
    assert sorted(seen) == list(range(len(lengths))) and set(seen.values()) == {1}
    assert 0.0 <= batches.padding_share < 0.5
    # Deterministic, the same rows for every dp layout, and label_count is the global batch's.
    again = PackedExampleBatches(ex, 64, 4, seed=3, long_examples="truncate")
    for step in range(3):
        whole = batches.rank_batch(step)
        halves = [again.rank_batch(step, r, 2) for r in range(2)]
        for i in range(3):
            assert torch.equal(whole[i], torch.cat([h[i] for h in halves]))
        assert batches.label_count(step) == int((whole[1] != IGNORE_INDEX).sum())
    skip = PackedExampleBatches(ex, 64, 4, seed=3, long_examples="skip")
    assert skip.n_examples == len(lengths) - batches.truncated


def _hf(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {"vocab_size": 256, "use_cache": False}
    if model_type == "gpt2":
        kw.update(n_embd=64, n_layer=2, n_head=4)
    else:
        kw.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        kw.update(num_key_value_heads=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw)).eval()


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_packed_window_logits_equal_each_example_alone(model_type):
    ex = _examples([20, 33, 7, 50, 41, 12, 64, 5, 30, 18, 9, 26], seed=1)
    batches = PackedExampleBatches(ex, 64, 4, seed=0)
    model = _hf(model_type)
    inputs, _, positions = batches.rank_batch(0)
    with torch.no_grad():
        packed = model(input_ids=inputs, position_ids=positions).logits
        checked = 0
        for row in range(len(inputs)):
            for start, n in _documents(positions[row]):
                alone = model(input_ids=inputs[row : row + 1, start : start + n]).logits[0]
                torch.testing.assert_close(packed[row, start : start + n], alone, rtol=1e-5, atol=1e-5)
                checked += 1
    assert checked > len(inputs)  # windows really hold several examples


LOGIT_LAYOUTS = ("tp2", "tp2-megatron-sp", "sp2-ring", "sp2-ulysses")
"""The layouts whose gathered logits of packed windows `test_packed_logits_under_tp_and_sp` checks."""
LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _layout_logits(layout: str, model_cfg, inputs, positions, rank: int, world: int) -> torch.Tensor:
    """The full-vocabulary, full-sequence logits of the packed rows under `layout` on this rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from partrain.models.adapters import get_adapter
    from partrain.models.build import build_meta_model
    from partrain.models.materialize import materialize
    from partrain.parallel.context_parallel import SequenceShard, apply_sp
    from partrain.parallel.tensor_parallel import apply_tp

    model = build_meta_model(model_cfg)
    if layout.startswith("tp2"):
        # Megatron-SP: the embeddings are sequence shards, so HF builds the mask from s/t tokens (replaced).
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        apply_tp(model, get_adapter(model), mesh, sequence_parallel=layout == "tp2-megatron-sp")
        materialize(model, model_cfg, seed=7, device="cpu").eval()
        with torch.no_grad():
            logits = model(input_ids=inputs, position_ids=positions).logits
        # Loss parallel keeps the logits vocabulary-sharded: gather them to compare whole rows.
        return logits.full_tensor() if isinstance(logits, DTensor) else logits
    shard = SequenceShard(layout.split("-")[1], world, rank, dist.group.WORLD, documents=True)
    apply_sp(model, get_adapter(model), shard, inputs.shape[1])
    materialize(model, model_cfg, seed=7, device="cpu").eval()
    with torch.no_grad():
        local = model(input_ids=shard.take(inputs), position_ids=shard.take(positions)).logits.contiguous()
    # Each rank holds the logits of its own (zig-zag or contiguous) tokens: put them back in place.
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local)
    full = torch.empty(inputs.shape[0], inputs.shape[1], local.shape[-1])
    for r, part in enumerate(parts):
        full[:, dataclasses.replace(shard, rank=r).positions(inputs.shape[1])] = part
    return full


LOGIT_MODELS = {
    "llama": (LLAMA, LOGIT_LAYOUTS),
    "gpt2": (dict(n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), LOGIT_LAYOUTS),
    # A sliding window shorter than the window of packed examples (the sp attention refuses those).
    "mistral": (dict(LLAMA, sliding_window=8), ("tp2-megatron-sp",)),
}
"""The models whose packed logits are checked (GPT-2: learned positions) and under which layouts."""


def _packed_logits_differences(rank: int, world: int) -> dict:
    """Per model and layout, the largest |packed window's logits - each example's logits alone in one
    process|."""
    from partrain.blueprint.config.schema import ModelConfig
    from partrain.models.build import build_meta_model
    from partrain.models.materialize import materialize

    ex = _examples([20, 33, 7, 50, 41, 12, 64, 5, 30, 18, 9, 26], seed=1)
    inputs, _, positions = PackedExampleBatches(ex, 64, 4, seed=0).rank_batch(0)
    documents = [(row, start, n) for row in range(len(inputs)) for start, n in _documents(positions[row])]
    out = {"documents": len(documents)}
    for arch, (config, layouts) in LOGIT_MODELS.items():
        config = dict(config, vocab_size=256, bos_token_id=0, eos_token_id=0)
        model_cfg = ModelConfig(arch=arch, config=config)
        alone = materialize(build_meta_model(model_cfg), model_cfg, seed=7, device="cpu").eval()
        with torch.no_grad():
            expected = [alone(input_ids=inputs[r : r + 1, start : start + n]).logits[0] for r, start, n in documents]
        for layout in layouts:
            packed = _layout_logits(layout, model_cfg, inputs, positions, rank, world)
            differences = [
                (packed[r, start : start + n] - e).abs().max() for (r, start, n), e in zip(documents, expected)
            ]
            out[f"{arch} {layout}"] = float(max(differences))
    return out


def test_packed_logits_under_tp_and_sp(tmp_path):
    """Issue 37: the logits of packed windows, gathered to full vocabulary (tp2) or full sequence (sp2
    ring, sp2 Ulysses), equal each example run alone in one process (1e-5). One launch for all three."""
    from partrain.runtime.spawn import run_spawned

    for rank, result in enumerate(run_spawned(_packed_logits_differences, 2, tmp_path)):
        assert result["documents"] > 4, result  # windows really hold several examples
        for arch, (_, layouts) in LOGIT_MODELS.items():
            for layout in layouts:
                assert result[f"{arch} {layout}"] <= 1e-5, (rank, arch, layout, result)


def test_packing_is_allowed_for_examples_under_sp_and_tp_sequence_shards(tmp_path):
    from partrain.preflight import data_problems

    source = tmp_path / "x.jsonl"
    source.write_text(json.dumps(_rows(1)[0]) + "\n")
    base = ["model=llama-tiny", f"data.source={source}", "data.tokenizer=byte", "data.chat_template=chatml"]
    megatron = ["parallel.tp=2", "parallel.tp_sequence_parallel=true", "data.packing=true"]
    for extra in (
        ["data.packing=true"],
        ["data.packing=true", "parallel.sp=2"],
        ["data.packing=false", "parallel.sp=2"],
        megatron,  # the attention mask of whole rows is rebuilt from position ids (megatron_sp)
    ):
        validate(compose([*base, "data.format=chat", *extra]))
    # data.format=auto: the preflight (known once the first row is read) has nothing against it either.
    v = validate(
        compose(
            [*base, *megatron, f"data.cache_dir={tmp_path}", "train.micro_batch_size=1", "train.global_batch_size=1"]
        )
    )
    assert "parallel.tp_sequence_parallel" not in {p.key for p in data_problems(v, dry_run=True)}


# ---- real runs against one process --------------------------------------------------------------


def _rows(n: int = 64) -> list:
    """Chats from a few bytes to ~200 (some longer than a window: truncated), uneven answers."""
    rows = []
    for i in range(n):
        answer = str(i) if i % 3 else "yes " * (i % 13 + 2) + str(i)
        if i % 11 == 5:
            answer = "long " * 40
        rows.append({"messages": [{"role": "user", "content": f"q{i}?"}, {"role": "assistant", "content": answer}]})
    return rows


@pytest.fixture(scope="module")
def data_overrides(tmp_path_factory):
    folder = tmp_path_factory.mktemp("packed")
    chat = folder / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    return [
        "model=llama-tiny",
        "model.config.num_hidden_layers=2",
        f"data.source={chat}",
        "data.tokenizer=byte",
        "data.chat_template=chatml",
        "data.packing=true",
        "data.long_examples=truncate",
        "data.eval_fraction=0.1",
        f"data.cache_dir={folder / 'cache'}",
        f"train.seq_len={SEQ_LEN}",
        f"train.global_batch_size={GLOBAL_BATCH}",
        "train.precision=fp32",
        "optim.lr=2e-3",
        "optim.warmup_steps=0",
        "optim.schedule=constant",
    ]


TWO = ["cluster.devices_per_node=2", "parallel.zero_stage=0"]
LAYOUTS = {
    "dp2": ["parallel.dp=2", "train.micro_batch_size=2"],
    "pp2-1f1b": ["parallel.pp=2", "parallel.pp_schedule=1f1b", "train.micro_batch_size=4", "train.microbatches=2"],
    "tp2": ["parallel.dp=1", "parallel.tp=2", "train.micro_batch_size=4"],
    # Megatron-SP: HF builds the mask from sequence-sharded embeddings; megatron_sp rebuilds whole rows'.
    "tp2-megatron-sp": [
        "parallel.dp=1",
        "parallel.tp=2",
        "parallel.tp_sequence_parallel=true",
        "parallel.recompute=full",
        "train.micro_batch_size=4",
    ],
    # Recompute re-runs the attention in backward: the document masks must come back the same.
    "sp2-ring": [
        "parallel.dp=1",
        "parallel.sp=2",
        "parallel.sp_mode=ring",
        "parallel.recompute=full",
        "train.micro_batch_size=4",
    ],
    "sp2-ulysses": [
        "parallel.dp=1",
        "parallel.sp=2",
        "parallel.sp_mode=ulysses",
        "parallel.recompute=selective",
        "train.micro_batch_size=4",
    ],
}


@pytest.fixture(scope="module")
def runs(data_overrides, tmp_path_factory):
    cases = {"reference": parity_args(reference_overrides(data_overrides + ["train.micro_batch_size=8"]), STEPS)}
    for name, layout in LAYOUTS.items():
        cases[name] = parity_args(data_overrides + TWO + layout, STEPS)
    return train_all(cases, tmp_path_factory.mktemp("runs"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_packed_examples_match_single_process(name, runs):
    got, ref = runs[name], runs["reference"]
    print(name, check_parity(ref, got))
    assert got.losses[-1] < got.losses[0]


def test_data_show_gives_the_loaders_restarting_position_ids(data_overrides):
    from partrain.cli.data_cmds import first_rows, hf_sample

    v = validate(compose(data_overrides))
    _, rows, _ = first_rows(v, 4)
    several = 0
    for row in rows:
        sample = hf_sample(*row)
        positions, labels, ids = sample["position_ids"], sample["labels"], sample["input_ids"]
        starts = [t for t, p in enumerate(positions) if p == 0]
        assert starts[0] == 0
        several += len(starts) > 1  # several examples (or one and the padding)
        assert all(positions[t] == positions[t - 1] + 1 for t in range(1, len(positions)) if t not in starts)
        assert all(labels[t] == IGNORE_INDEX for t in starts)
        assert all(label in (IGNORE_INDEX, ids[t]) for t, label in enumerate(labels))
    assert several
    meta = prepare_examples(v.run.data).meta_path
    packed = run_packing_facts(meta, v.run.data, SEQ_LEN, GLOBAL_BATCH, 1234)["packing"]
    padded = run_packing_facts(meta, dataclasses.replace(v.run.data, packing=False), SEQ_LEN, GLOBAL_BATCH, 1)
    assert packed["packed"] and packed["truncated"] > 0 and packed["rows"] < padded["packing"]["rows"]
    assert packed["padding_share"] < padded["packing"]["padding_share"]

"""partrain's preference losses against TRL's own computation (TRL as a test-only oracle): on one tiny
Llama with LoRA adapters and the same batch of pairs, DPO's loss and the adapters' gradients equal
DPOTrainer's (whose reference under PEFT is the adapters switched off, as partrain's), and SimPO's equal
CPOTrainer's with loss_type=simpo and cpo_alpha=0."""

from __future__ import annotations

import copy

import pytest
import torch

from partrain.models.loss import IGNORE_INDEX
from partrain.train.preference import PreferenceObjective

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

ROWS = [
    {"prompt": "what is two plus two ?", "chosen": "four", "rejected": "five"},
    {"prompt": "reverse the word lamp", "chosen": "pmal", "rejected": "lamp lamp"},
    {"prompt": "upper case of river", "chosen": "RIVER", "rejected": "river"},
    {"prompt": "how many letters in stone ?", "chosen": "five", "rejected": "six or seven"},
]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for row in ROWS for text in row.values() for w in text.split()})
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<eos>", *words])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _base_model(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


# Adapters whose B is not zero, so the policy differs from its reference (the adapters switched off).
# TRL adds them itself: given a model that has adapters already, its reference is a copy of those.
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def _partrain_rows(ids: torch.Tensor, labels: torch.Tensor) -> tuple:
    """TRL's rows ([chosen rows; rejected rows], labels aligned with the ids, -100 off the answers) as
    partrain's: rows interleaved [c0, r0, c1, r1, ...] and labels shifted (labels[t]: the target of t)."""
    shifted = torch.full_like(ids, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    pairs = ids.shape[0] // 2
    order = torch.stack([torch.arange(pairs), torch.arange(pairs) + pairs], dim=1).reshape(-1)
    return ids[order], shifted[order]


def _trl_rows(trainer, batch: dict, objective: str) -> tuple:
    """(ids, labels aligned with them) of a TRL batch, chosen rows first."""
    if objective == "simpo":  # CPOTrainer's own concatenation
        both = trainer.concatenated_inputs(batch, padding_value=trainer.pad_token_id)
        return both["concatenated_input_ids"], both["concatenated_labels"]
    ids = batch["input_ids"]
    return ids, torch.where(batch["completion_mask"].bool(), ids, torch.full_like(ids, IGNORE_INDEX))


def _lora_grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_same_grads(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
        scale = theirs[name].abs().max().clamp_min(1e-12)
        assert (ours[name] - theirs[name]).abs().max() / scale < 1e-4, name


@pytest.mark.parametrize("objective", ["dpo", "simpo"])
def test_preference_loss_and_gradients_match_trl(objective, tmp_path):
    tokenizer = _tokenizer()
    rows = datasets.Dataset.from_list(ROWS)
    common = dict(output_dir=str(tmp_path), per_device_train_batch_size=len(ROWS), report_to="none", use_cpu=True)
    model, lora = _base_model(len(tokenizer)), peft.LoraConfig(**LORA)
    ours_model = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(**LORA))
    if objective == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        args = CPOConfig(loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=0.5, **common)
        trainer = CPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer, peft_config=lora)
        ours = PreferenceObjective("simpo", beta=2.0, simpo_gamma=0.5)
    else:
        args = trl.DPOConfig(beta=0.1, loss_type=["sigmoid"], **common)
        trainer = trl.DPOTrainer(
            model=model, args=args, train_dataset=rows, processing_class=tokenizer, peft_config=lora
        )
        ours = PreferenceObjective("dpo", beta=0.1, reference=lambda model: model.disable_adapter())
    # TRL's adapters (random B), on an unpatched copy: TRL replaces its model's forward with a fused head.
    ours_model.load_state_dict(trainer.model.state_dict())
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(ROWS))])
    theirs_loss = trainer.compute_loss(trainer.model, batch)
    theirs_loss.backward()
    ids, labels = _partrain_rows(*_trl_rows(trainer, batch, objective))
    ours_loss = ours(ours_model, ids, labels)
    ours_loss.backward()
    assert float(ours_loss) == pytest.approx(float(theirs_loss), rel=1e-5)
    _assert_same_grads(_lora_grads(ours_model), _lora_grads(trainer.model))
    metrics = ours.step_metrics()
    if objective == "simpo":
        return  # CPOTrainer keeps its metrics elsewhere; its loss and gradients are the check
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert metrics[name] == pytest.approx(trainer._metrics["train"][name][-1], rel=1e-5, abs=1e-7), name

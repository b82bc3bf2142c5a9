"""Learning-rate schedules (transformers' schedule functions) and the optimizer choices, in-process.

The real runs (SGD under FSDP, a resume continuing the exact LR sequence) are in test_progress_output.py,
which shares its launches between checks.
"""

from __future__ import annotations

import json

import pytest
import torch

from partrain.blueprint.config.compose import compose
from partrain.blueprint.config.schema import LR_SCHEDULES, OptimConfig
from partrain.blueprint.validate import validate
from partrain.errors import ConfigError
from partrain.train.lr_schedule import LRSchedule


def lrs(schedule: LRSchedule, n: int) -> list:
    out = []
    for _ in range(n):
        out.append(schedule.lr())
        schedule.step()
    return out


def test_every_schedule_warms_up_then_follows_its_shape():
    cfg = dict(lr=1.0, warmup_steps=4, min_lr_ratio=0.1, decay_fraction=0.25)
    got = {name: lrs(LRSchedule(OptimConfig(schedule=name, **cfg), 20), 20) for name in LR_SCHEDULES}
    assert got["cosine"][:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # step s runs at lr x (s+1)/warmup
    assert got["constant"][:4] == pytest.approx([0.25, 0.5, 0.75, 1.0]) and set(got["constant"][3:]) == {1.0}
    for name in ("cosine", "linear", "wsd"):
        assert got[name][-1] == pytest.approx(0.1), name  # the last step reaches min_lr_ratio
        decay = got[name][3:]
        assert all(a >= b for a, b in zip(decay, decay[1:])), name
    linear_steps = [a - b for a, b in zip(got["linear"][3:], got["linear"][4:])]
    assert linear_steps == pytest.approx([linear_steps[0]] * len(linear_steps))
    assert got["wsd"][3:15] == [1.0] * 12 and got["wsd"][15:] == pytest.approx([0.82, 0.64, 0.46, 0.28, 0.1])
    assert got["cosine"][10] != pytest.approx(got["linear"][10])


@pytest.mark.parametrize("name", LR_SCHEDULES)
def test_a_resumed_schedule_continues_the_exact_sequence(name):
    cfg = OptimConfig(schedule=name, lr=3e-4, warmup_steps=3, decay_fraction=0.3)
    straight = lrs(LRSchedule(cfg, 12), 12)
    first = LRSchedule(cfg, 12)
    lrs(first, 5)
    saved = json.loads(json.dumps(first.state_dict()))  # what the checkpoint's record holds
    resumed = LRSchedule(cfg, 12)
    resumed.load(saved, 5)
    assert lrs(resumed, 7) == straight[5:]  # exact, not approximately
    old_checkpoint = LRSchedule(cfg, 12)
    old_checkpoint.load(None, 5)  # written before schedules were saved: stepped forward
    assert lrs(old_checkpoint, 7) == straight[5:]


def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


@pytest.mark.parametrize(
    "name,implementation", [("adamw", "fused"), ("adamw", "foreach"), ("sgd", "for_loop"), ("sgd", "fused")]
)
def test_state_made_before_the_first_step_changes_nothing(name, implementation):
    """Checkpoints give every parameter its optimizer state before the first step (state.py):
    the first update must equal the lazily initialised one, for SGD's momentum too."""
    from partrain.checkpoint.state import _ensure_adam_state
    from partrain.parallel.optimizer import make_torch_optimizer, param_groups

    cfg = OptimConfig(name=name, implementation=implementation, lr=0.1)
    models = [_tiny(), _tiny()]
    opts = [make_torch_optimizer(param_groups(m, cfg.weight_decay), cfg) for m in models]
    assert isinstance(opts[0], torch.optim.SGD if name == "sgd" else torch.optim.AdamW)
    assert opts[0].defaults[implementation if implementation != "for_loop" else "foreach"] is (
        implementation != "for_loop"
    )
    _ensure_adam_state(opts[1])
    assert all(opts[1].state[p] for p in models[1].parameters())
    x = torch.randn(4, 8)
    for _ in range(2):
        for m, opt in zip(models, opts):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["optim.schedule=Cosine2"], "optim.schedule"),
        (["optim.implementation=fast"], "optim.implementation"),
        (["optim.name=lion"], "optim.name"),
        (["optim=sgd", "parallel.zero_stage=1"], "optim.name"),
        (["optim.momentum=1"], "optim.momentum"),
        (["optim.decay_fraction=0"], "optim.decay_fraction"),
        (["optim.schedule=wsd", "train.steps=10", "optim.warmup_steps=9"], "optim.warmup_steps"),
    ],
)
def test_bad_optimizer_values_are_config_errors(overrides, key):
    with pytest.raises(ConfigError) as err:
        validate(compose(["recipe=gpt-dp", *overrides]))
    assert [p.key for p in err.value.problems] == [key]


def test_sgd_config_group_composes_and_validates():
    run = validate(compose(["recipe=gpt-dp", "optim=sgd", "parallel.zero_stage=3"])).run
    assert (run.optim.name, run.optim.momentum, run.optim.weight_decay) == ("sgd", 0.9, 0.0)

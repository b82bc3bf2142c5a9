"""Preference tuning (train.objective=dpo / simpo) for real: each layout against one process of the same
model, pairs and seed (losses, gradient norms and the reward metrics), dpo under LoRA (the reference is
the adapters switched off) and simpo in full fine-tuning; the runs of one process count share a launch
(rehearse.runs.train_all). The shipped recipe as the docs give it, and the reference-free objective too."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from partrain.rehearse.parity import check_parity, parity_args, reference_overrides
from partrain.rehearse.runs import train_all

pytestmark = pytest.mark.slow

STEPS = 3
DPO = ["recipe=dpo-lora", "optim.lr=1e-2", "optim.warmup_steps=0", "train.global_batch_size=8"]
SIMPO = DPO + ["peft=none", "train.objective=simpo", "train.preference_beta=2.0", "optim.lr=1e-3"]
MIXTRAL_DPO = DPO + ["model=mixtral-tiny"]
# Full fine-tuning: the reference is the starting model's log-probabilities, computed before step 1 by each
# layout's own processes and cached beside the data (partrain.train.reference_logps).
DPO_FULL = DPO + ["peft=none", "optim.lr=1e-3"]

PP2 = ["parallel.pp=2", "train.micro_batch_size=2"]
V2 = ["parallel.pp_virtual_stages=2"]
FOUR = ["cluster.devices_per_node=4"]
COPY = ["train.preference_reference=copy"]
LAYOUTS = {
    # name: (the reference's overrides, the layout)
    "dpo-ddp2": (DPO, ["parallel.dp=2", "parallel.tp=1", "parallel.zero_stage=0", "train.micro_batch_size=2"]),
    "dpo-fsdp2": (DPO, ["parallel.dp=2", "parallel.tp=1", "parallel.zero_stage=3", "train.micro_batch_size=4"]),
    "dpo-tp2": (DPO, ["parallel.dp=1", "parallel.tp=2", "parallel.zero_stage=0", "train.micro_batch_size=4"]),
    "dpo-tp2-megatron-sp": (
        DPO,
        ["parallel.dp=1", "parallel.tp=2", "parallel.tp_sequence_parallel=true", "train.micro_batch_size=4"],
    ),
    # Sequence parallelism: each rank scores its slice of every row; the slices' sums meet over the sp group.
    "dpo-sp2-ulysses": (DPO, ["parallel.dp=1", "parallel.sp=2", "train.micro_batch_size=4"]),
    "dpo-sp2-ring": (DPO, ["parallel.dp=1", "parallel.sp=2", "parallel.sp_mode=ring", "train.micro_batch_size=4"]),
    "dpo-mixtral-ep2": (MIXTRAL_DPO, ["parallel.dp=2", "parallel.ep=2", "train.micro_batch_size=2"]),
    "dpo-full-ddp2": (DPO_FULL, ["parallel.dp=2", "parallel.zero_stage=0", "train.micro_batch_size=2"]),
    "dpo-full-fsdp2": (DPO_FULL, ["parallel.dp=2", "parallel.zero_stage=3", "train.micro_batch_size=4"]),
    "dpo-full-tp2": (DPO_FULL, ["parallel.dp=1", "parallel.tp=2", "train.micro_batch_size=4"]),
    # Pipeline parallelism: the last stage computes the pairs' loss; dpo's reference log-probabilities ride with
    # the labels (LoRA: a forward of the stages with the adapters off; full fine-tuning: the cached table).
    "dpo-pp2-1f1b": (DPO, ["parallel.dp=1", *PP2, "parallel.pp_schedule=1f1b"]),
    "dpo-pp2-interleaved": (DPO, ["parallel.dp=1", *PP2, "parallel.pp_schedule=interleaved-1f1b", *V2]),
    "dpo-full-pp2-zbv": (DPO_FULL, ["parallel.dp=1", *PP2, "parallel.pp_schedule=zbv", *V2]),
    # The frozen copy (train.preference_reference=copy) against the one-process table: both are the starting
    # model's log-probabilities. Under FSDP the copy is sharded as the policy is.
    "dpo-copy-fsdp2": (DPO_FULL, [*COPY, "parallel.dp=2", "parallel.zero_stage=3", "train.micro_batch_size=4"]),
    "dpo-copy-tp2": (DPO_FULL, [*COPY, "parallel.dp=1", "parallel.tp=2", "train.micro_batch_size=4"]),
    "simpo-pp2-gpipe": (SIMPO, ["parallel.dp=1", *PP2, "parallel.pp_schedule=gpipe"]),
    # Four processes: vocabulary-sharded logits on the last stage, and the pairs' metrics summed over dp and pp.
    "dpo-pp2-tp2": (DPO, ["parallel.dp=1", "parallel.tp=2", *PP2, *FOUR]),
    "simpo-pp2-dp2": (SIMPO, ["parallel.dp=2", *PP2, *FOUR]),
    "dpo-hsdp-2x2": (DPO_FULL, ["parallel.dp=4", "parallel.zero_stage=3", "parallel.dp_shard=2", *PP2[1:], *FOUR]),
    # The schedules left: every one of partrain's seven carries the pairs' loss.
    "dpo-pp2-looped-bfs": (DPO, ["parallel.dp=1", *PP2, "parallel.pp_schedule=looped-bfs", *V2]),
    "simpo-pp2-interleaved-zero-bubble": (
        SIMPO,
        ["parallel.dp=1", *PP2, "parallel.pp_schedule=interleaved-zero-bubble", *V2],
    ),
    "dpo-full-pp2-dualpipev": (DPO_FULL, ["parallel.dp=1", *PP2, "parallel.pp_schedule=dualpipev", *V2]),
    "simpo-sp2-ring": (SIMPO, ["parallel.dp=1", "parallel.sp=2", "parallel.sp_mode=ring", "train.micro_batch_size=4"]),
    "simpo-zero1": (SIMPO, ["parallel.dp=2", "parallel.tp=1", "parallel.zero_stage=1", "train.micro_batch_size=2"]),
    "simpo-tp2": (SIMPO, ["parallel.dp=1", "parallel.tp=2", "parallel.zero_stage=0", "train.micro_batch_size=4"]),
}
OWN_TABLE = {
    "dpo-full-dp2-own-table": ["parallel.dp=2", "train.micro_batch_size=2"],
    "dpo-full-sp2-own-table": ["parallel.dp=1", "parallel.sp=2", "train.micro_batch_size=4"],
    "dpo-full-pp2-own-table": ["parallel.dp=1", *PP2],
}
EVAL = ["train.eval_every=2", "train.eval_batches=1"]
"""The evaluation pass under pp (dpo-pp2-eval) against one process's: its reference forward and loss too."""
RTOL = {"dpo-mixtral-ep2": 5e-5}
"""Per-layout tolerance where it is not FP32_RTOL (1e-5): expert parallelism adds the experts' outputs in
another order, and Adam at lr 1e-2 grows that rounding step by step (measured: gradient norm 5e-7 at step 1,
6.5e-6 at step 2, 1.3e-5 at step 3; losses within 8e-7)."""
REWARD_ATOL = 1e-5
"""Absolute tolerance of the reward metrics (see test_preference_layout_matches_single_process); measured
at most 2e-6 (Mixtral ep2, step 3)."""
REFERENCES = {
    "reference-dpo": DPO,
    "reference-simpo": SIMPO,
    "reference-mixtral-dpo": MIXTRAL_DPO,
    "reference-dpo-full": DPO_FULL,
}


def _reference_of(overrides) -> str:
    return next(name for name, ref in REFERENCES.items() if ref == overrides)


def _records(record) -> list:
    return [json.loads(line) for line in (record.run_dir / "metrics.jsonl").read_text().splitlines()]


def _metrics(record) -> list:
    return [r for r in _records(record) if "rewards/accuracies" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = [f"data.cache_dir={tmp_path_factory.mktemp('data-cache')}"]
    cases = {name: parity_args(reference_overrides(ref + cache), STEPS) for name, ref in REFERENCES.items()}
    for name, (ref, layout) in LAYOUTS.items():
        devices = [] if FOUR[0] in layout else ["cluster.devices_per_node=2"]
        cases[name] = parity_args(ref + layout + devices + cache, STEPS)
    root = tmp_path_factory.mktemp("runs")
    # Full-FT dpo whose reference table its own layout computes (a data cache of its own, so none is found):
    # the scoring pass split over dp ranks and gathered, and over sp slices summed.
    for name, layout in OWN_TABLE.items():
        own = [f"data.cache_dir={tmp_path_factory.mktemp(name)}"]
        cases[name] = parity_args(DPO_FULL + layout + ["cluster.devices_per_node=2"] + own, STEPS)
    cases["reference-dpo-eval"] = parity_args(reference_overrides(DPO + cache), STEPS) + EVAL
    layout = ["parallel.dp=1", *PP2, "cluster.devices_per_node=2"]
    cases["dpo-pp2-eval"] = parity_args(DPO + layout + cache, STEPS) + EVAL
    # Full-FT dpo saved at step 2 by one process, then resumed under dp2 by a launch of its own (the
    # checkpoint must exist when the run is prepared): it reads the reference table the first one cached.
    cases["dpo-full-saved"] = parity_args(reference_overrides(DPO_FULL + cache) + ["checkpoint.every_steps=2"], 2)
    records = train_all(cases, root)
    saved = root / "dpo-full-saved" / "run" / "checkpoints" / "step-00000002"
    resume = ["parallel.dp=2", "train.micro_batch_size=2", "cluster.devices_per_node=2", f"checkpoint.resume={saved}"]
    resumed = {"dpo-full-resumed-dp2": parity_args(DPO_FULL + resume + cache, STEPS)}
    return {**records, **train_all(resumed, root)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_preference_layout_matches_single_process(name, runs):
    ref_overrides, _ = LAYOUTS[name]
    got, ref = runs[name], runs[_reference_of(ref_overrides)]
    print(name, check_parity(ref, got, **({"rtol": RTOL[name]} if name in RTOL else {})))
    # The reward metrics are the same pairs' on every layout: means over all data-parallel ranks. A reward is
    # beta x a difference of two log-probabilities of about -30: rounding of 1e-7 relative in each leaves
    # about 1e-6 absolute (REWARD_ATOL). The accuracy counts pairs whose margin is positive: compared where
    # the margin is clear of that rounding (full-FT dpo's step 1 margins are rounding only: its table was
    # computed by another layout).
    for a, b in zip(_metrics(got), _metrics(ref), strict=True):
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=REWARD_ATOL), (key, a, b)
        if abs(b["rewards/margins"]) > 1e-3:
            assert a["rewards/accuracies"] == b["rewards/accuracies"], (a, b)


def test_dpo_starts_at_log_2_and_learns(runs):
    """B starts at zero, so the policy is its reference: every margin is 0 and the first loss is log 2;
    then the adapters move the chosen answers' log-probabilities above the rejected ones'."""
    ref = runs["reference-dpo"]
    assert math.isclose(ref.losses[0], math.log(2), rel_tol=1e-6), ref.losses
    first = _metrics(ref)[0]
    assert first["rewards/margins"] == 0.0 and first["rewards/accuracies"] == 0.0
    assert ref.losses[-1] < ref.losses[0]
    assert _metrics(ref)[-1]["rewards/margins"] > 0


def test_simpo_has_no_reference_and_learns(runs):
    """SimPO's loss is the pairs' mean of -log sigmoid(beta x (avg log p(c) - avg log p(r)) - gamma): at
    least that of the mean margin (the function is convex), and not log 2 at the start as DPO's."""
    ref = runs["reference-simpo"]
    m = _metrics(ref)[0]
    z = m["rewards/margins"] - 0.5  # rewards are beta x the average log-probs; simpo_gamma 0.5
    assert ref.losses[0] >= math.log1p(math.exp(-z)) - 1e-6, (ref.losses, m)
    assert not math.isclose(ref.losses[0], math.log(2), rel_tol=1e-3)
    assert ref.losses[-1] < ref.losses[0]


def test_full_fine_tuning_dpo_reads_its_cached_reference_on_a_resume_under_another_layout(runs):
    """The reference table is computed once (one process, before step 1), written beside the data with its
    checksum, and read by the run resumed under dp2: its step 3 is the uninterrupted run's."""
    ref, resumed = runs["reference-dpo-full"], runs["dpo-full-resumed-dp2"]
    assert math.isclose(ref.losses[0], math.log(2), rel_tol=1e-6), "the table is the starting model's"
    assert resumed.losses == pytest.approx(ref.losses[2:], rel=1e-5), (resumed.losses, ref.losses)
    cache = Path(json.loads((ref.run_dir / "data.json").read_text())["meta_path"]).parent  # the examples entry
    tables = list(cache.glob("reference-*.npy"))
    assert len(tables) == 1 and tables[0].with_suffix(".json").is_file(), (cache, tables)


@pytest.mark.parametrize("name", list(OWN_TABLE))
def test_a_layout_computes_the_reference_table_of_one_process(name, runs):
    """The scoring pass under dp2 (rows split and gathered) and sp2 (slices summed) gives one process's
    reference: the first loss is log 2 and every step matches the one-process run."""
    got, ref = runs[name], runs["reference-dpo-full"]
    assert math.isclose(got.losses[0], math.log(2), rel_tol=1e-6), got.losses
    print(name, check_parity(ref, got))


def test_the_evaluation_of_dpo_under_pipeline_parallelism_is_the_one_process_evaluation(runs):
    """dpo-pp2-eval evaluates at steps 2 and 3: the stages' forward with the adapters off (the reference), then
    the pairs' loss on the last stage, as one process computes it."""
    ref, got = runs["reference-dpo-eval"], runs["dpo-pp2-eval"]
    check_parity(ref, got)
    evals = [
        [
            r["eval_loss"]
            for r in map(json.loads, (x.run_dir / "metrics.jsonl").read_text().splitlines())
            if "eval_loss" in r
        ]
        for x in (ref, got)
    ]
    assert len(evals[0]) == 2 and evals[0][0] > 0, evals
    for a, b in zip(*evals, strict=True):
        assert math.isclose(a, b, rel_tol=1e-5), evals


def test_a_resume_whose_reference_table_is_gone_is_exit_2_before_any_process(runs, cli, tmp_path):
    """The table lives in the data cache; resumed where that cache is empty (another machine, a wiped
    cache), the run cannot get the starting model's numbers back: exit 2 naming the key and the ways out."""
    saved = runs["dpo-full-saved"].run_dir / "checkpoints" / "step-00000002"
    args = [*reference_overrides(DPO_FULL), f"checkpoint.resume={saved}", f"data.cache_dir={tmp_path / 'wiped'}"]
    ran = cli("train", "--dry-run", *args)
    out = " ".join((ran.stdout + ran.stderr).split())
    assert ran.code == 2 and ran.spawned == [] and "Traceback" not in out, out
    assert "train.preference_reference" in out and "gone or damaged" in out and "preference_reference=copy" in out, out

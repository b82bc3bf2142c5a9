"""Pipeline parallelism: stage split, stage modules, and real multi-process runs against one process.

Fast tests check the layer split, the placement rules and that a chain of stage modules computes
exactly what the full model computes (GPT-2, Llama, Mixtral, Mistral with a sliding window).

The parity tests run this file as a worker in 2 and 4 processes (gloo, FileStore rendezvous, 120 s
process-group timeout, destroy_process_group + os._exit at the end): tiny GPT-2 (tied embeddings)
and Llama models, built on the meta device, split into stages, materialized with the same seed,
3 AdamW steps on the same batches. Per-step losses and global gradient norms must be within 1e-5
relative of a single-process run of the full model over the same microbatches (computed here in
the parent), and final parameters, both copies of GPT-2's tied weight included, within 1e-4
absolute (10% of one AdamW step: Adam turns reduction-order noise in near-zero gradients into
~1e-5 parameter differences). The 4-process launch also runs pp=2 x dp=2 with FSDP2, DDP and the
runner's own dp all-reduce; every run also checks `eval_step` against the first reference loss.
The 2-process launch measures saved-activation bytes of GPipe and 1F1B.

`python tests/test_pipeline.py bubble` (not a test) prints measured per-rank idle shares of every
schedule at pp=2 next to the simulated and published bubble.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from partrain.blueprint.stage_split import (
    SCHEDULE_STYLE,
    chunk_placement,
    owner_of_chunk,
    schedule_problems,
    split_layers,
)
from partrain.runtime.lifecycle import finish_group, leave

SEED = 3
BATCH, SEQ, MICRO, STEPS, LR = 8, 16, 4, 3, 1e-3
MODELS = {
    "gpt2": dict(
        vocab_size=256,
        n_positions=64,
        n_embd=64,
        n_layer=4,
        n_head=4,
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
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
    ),
}
# (schedule, pp, v) per world size; every model runs every entry.
RUNS = {
    2: [("gpipe", 2, 1), ("1f1b", 2, 1), ("interleaved-1f1b", 2, 2), ("interleaved-zero-bubble", 2, 2), ("zbv", 2, 2)],
    4: [("gpipe", 4, 1), ("1f1b", 4, 1)],
}
EXTRA = {2: [("llama", "looped-bfs", 2, 2), ("llama", "dualpipev", 2, 2)]}
# pp=2 x dp=2 in the 4-process launch: (model, schedule, v, how the data-parallel side is done).
DP_RUNS = [
    ("gpt2", "zbv", 2, "fsdp"),
    ("llama", "interleaved-1f1b", 2, "fsdp"),
    ("llama", "zbv", 2, "dp_group"),
    ("gpt2", "1f1b", 1, "ddp"),
]
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-4
"""fp32 pipeline runs vs one process: every rank's losses, gradient norms and step-0 eval loss relative
(partrain.testing.parity.FP32_RTOL's reasoning: the same sums in another order), and every parameter
after the steps, absolute (weights of order 0.02-1 after a few Adam steps of lr 1e-3, so fp32 rounding
of the updates, not a fault, is what separates them). Measured (2026-12-07, every schedule, pp2 and pp4,
pp2 x dp2): losses at most 6.4e-8 and gradient norms 1.6e-7 (a margin of 62x), parameters at most 4.2e-6
(looped-bfs; 24x)."""


# ---- fast, single-process -------------------------------------------------------------------------


def test_split_layers_balances_costs():
    assert [len(r) for r in split_layers(8, 4)] == [2, 2, 2, 2]
    assert [len(r) for r in split_layers(5, 2)] == [3, 2]  # ties: earlier chunks get more
    # An expensive head (a big vocabulary) takes layers off the last chunk.
    assert [len(r) for r in split_layers(8, 2, head_cost=2.0)] == [5, 3]
    assert [len(r) for r in split_layers(8, 2, embed_cost=2.0)] == [3, 5]
    assert [len(r) for r in split_layers(12, 4, embed_cost=1.0, head_cost=1.0)] == [3, 3, 3, 3]
    ranges = split_layers(10, 3)
    assert ranges[0].start == 0 and ranges[-1].stop == 10
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))


def test_split_layers_minimises_the_slowest_chunk():
    import itertools
    import random

    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(2, 9)
        k = rng.randint(1, n)
        embed, head = rng.choice([0, 0.5, 1.7, 3]), rng.choice([0, 0.3, 2.2, 4])
        layer = [rng.choice([1, 1, 1, 2, 0.5]) for _ in range(n)]

        def chunk_costs(bounds):
            return [
                sum(layer[a:b]) + (embed if j == 0 else 0) + (head if j == k - 1 else 0)
                for j, (a, b) in enumerate(zip(bounds, bounds[1:]))
            ]

        best = min(max(chunk_costs([0, *cuts, n])) for cuts in itertools.combinations(range(1, n), k - 1))
        ranges = split_layers(n, k, embed_cost=embed, head_cost=head, layer_cost=layer)
        assert all(len(r) >= 1 for r in ranges) and ranges[-1].stop == n
        assert max(chunk_costs([r.start for r in ranges] + [n])) == pytest.approx(best)


def test_split_layers_explicit_and_errors():
    assert [list(r) for r in split_layers(4, 2, layers_per_chunk=[3, 1])] == [[0, 1, 2], [3]]
    with pytest.raises(ValueError):
        split_layers(4, 2, layers_per_chunk=[2, 1])
    with pytest.raises(ValueError):
        split_layers(3, 4)


def test_chunk_costs_from_facts():
    from partrain.blueprint.model_facts import model_facts
    from partrain.blueprint.stage_split import chunk_costs, plan_chunks

    facts = model_facts(
        "llama",
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
        },
    )
    costs = chunk_costs(facts, seq_len=0)
    assert costs.layer == 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # q, o + k, v + SwiGLU
    assert 2.3 < costs.head / costs.layer < 2.5  # Llama-3 8B's head ~ 2.4 layers
    plan = plan_chunks(facts, pp=4, v=1, schedule="1f1b")
    sizes = [len(r) for r in plan["ranges"]]
    assert sum(sizes) == 32 and sizes[-1] < sizes[0]
    params = chunk_costs(facts, kind="params")
    assert params.embed == 128256 * 4096
    sizes = [len(r) for r in plan_chunks(facts, 4, 1, "1f1b", kind="params")["ranges"]]
    assert sizes[0] < sizes[1] and sizes[-1] < sizes[1]


def test_chunk_placement_styles():
    assert chunk_placement(4, 2, "loop") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert chunk_placement(4, 2, "v") == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert owner_of_chunk(2, 2, "v") == [0, 1, 1, 0]
    assert SCHEDULE_STYLE["zbv"] == SCHEDULE_STYLE["dualpipev"] == "v"
    assert SCHEDULE_STYLE["interleaved-1f1b"] == "loop"
    with pytest.raises(ValueError):
        chunk_placement(2, 3, "v")


def test_schedule_problems():
    assert schedule_problems("1f1b", 4, 1, 8, n_layers=8) == []
    assert schedule_problems("1f1b", 4, 1, 2)  # microbatches < pp
    assert schedule_problems("gpipe", 2, 2, 4)  # one chunk per rank
    assert schedule_problems("zbv", 2, 3, 4)
    assert schedule_problems("dualpipev", 2, 2, 3)
    assert schedule_problems("interleaved-1f1b", 4, 2, 9)  # 9 % (9 // 4) != 0
    assert schedule_problems("interleaved-1f1b", 4, 2, 8) == []
    assert schedule_problems("1f1b", 4, 2, 8, n_layers=4)
    assert schedule_problems("bogus", 2, 1, 2)


def _model_cfg(arch: str, **extra):
    from partrain.blueprint.config.schema import ModelConfig

    kwargs = dict(MODELS[arch]) if arch in MODELS else {}
    kwargs.update(extra)
    return ModelConfig(arch=arch, config=kwargs)


CHAIN_CASES = {
    "gpt2": ("gpt2", {}),
    "llama": ("llama", {}),
    "mixtral": (
        "mixtral",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
    "mistral-window-eager": (
        "mistral",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=6,
            attn_implementation="eager",
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
}


@pytest.mark.parametrize("case", list(CHAIN_CASES))
def test_stage_chain_equals_full_model(case):
    import torch

    from partrain.models.adapters import get_adapter
    from partrain.models.build import build_meta_model
    from partrain.models.materialize import materialize
    from partrain.parallel.pipeline import build_stage_module

    arch, extra = CHAIN_CASES[case]
    cfg = _model_cfg(arch, **extra)
    full = materialize(build_meta_model(cfg), cfg, SEED, "cpu")
    meta = build_meta_model(cfg)
    adapter = get_adapter(meta)
    ranges = split_layers(4, 3)
    stages = [materialize(build_stage_module(meta, adapter, c, 3, ranges[c]), cfg, SEED, "cpu") for c in range(3)]
    assert len(list(meta.parameters())) == len(list(build_meta_model(cfg).parameters()))  # meta model untouched
    full_names = dict(full.named_parameters())
    for stage in stages:
        for name, p in stage.named_parameters():
            assert torch.equal(p, full_names[name]), name  # same FQN, same weights
    covered = {n for s in stages for n, _ in s.named_parameters()}
    assert covered == set(full_names)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    h = ids
    for stage in stages:
        h = stage(h)
    ref = full(input_ids=ids, position_ids=torch.arange(12).unsqueeze(0)).logits
    torch.testing.assert_close(h, ref, rtol=0, atol=0)
    assert list(stages[1].layers().keys()) == [str(i) for i in ranges[1]]
    if arch == "gpt2":  # the last chunk holds a tied copy under the embedding's FQN
        last = stages[-1]
        assert last.tied_weight() is last.lm_head.weight
        assert "transformer.wte.weight" in dict(last.named_parameters())
        assert stages[1].tied_weight() is None


def test_saved_activation_bytes_counts_activations_not_params():
    import torch

    from partrain.runtime.activations import saved_activation_bytes

    lin = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64)

    def fwd():
        return torch.relu(lin(x)).sum()

    out, peak = saved_activation_bytes(fwd, params=list(lin.parameters()))
    # linear saves its input x (32x64 fp32); relu saves its output (32x64): 2 x 8 KiB
    assert peak == 2 * 32 * 64 * 4
    out.backward()


# ---- multi-process parity -------------------------------------------------------------------------


def make_batch(step: int):
    import torch

    ids = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 + step))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def reference_run(arch: str):
    """Single process: full model, the same microbatches, mean of microbatch losses."""
    import torch

    from partrain.models.build import build_meta_model
    from partrain.models.loss import forward_loss
    from partrain.models.materialize import materialize

    torch.set_num_threads(1)
    cfg = _model_cfg(arch)
    model = materialize(build_meta_model(cfg), cfg, SEED, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = make_batch(step)
        total = 0.0
        for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):
            loss = forward_loss(model, xm, ym)
            (loss / MICRO).backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        opt.step()
        losses.append(total / MICRO)
    return {
        "losses": losses,
        "grad_norms": norms,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _worker(out_dir: str, store: str) -> None:
    """One rank of a launch: every (model, schedule) run of RUNS/EXTRA for this world size."""
    import datetime

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    results: dict = {}
    code = 0
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
        runs = [(arch, *r) for arch in MODELS for r in RUNS[world]] + EXTRA.get(world, [])
        for arch, schedule, pp, v in runs:
            key = f"{arch}-{schedule}-pp{pp}"
            results[key] = _worker_run(arch, schedule, pp, v, mesh["pp"], rank, Path(out_dir) / f"{key}-rank{rank}.pt")
        if world == 4:
            mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
            for arch, schedule, v, wrap in DP_RUNS:
                results[f"{arch}-{schedule}-pp2-dp2-{wrap}"] = _worker_run(
                    arch,
                    schedule,
                    2,
                    v,
                    mesh2d["pp"],
                    mesh2d["pp"].get_local_rank(),
                    None,
                    dp_mesh=mesh2d["dp"],
                    wrap=wrap,
                )
        if world == 2:
            for schedule in ("gpipe", "1f1b"):
                results[f"saved-{schedule}"] = _worker_run(
                    "llama", schedule, 2, 1, mesh["pp"], rank, None, steps=1, saved=True
                )
    except BaseException as exc:  # report, then leave: the other ranks' collectives time out
        import traceback

        results["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        code = 1
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    if code == 0:
        finish_group()
    leave(code)


def _worker_run(arch, schedule, pp, v, pp_mesh, rank, params_path, steps=STEPS, saved=False, dp_mesh=None, wrap=None):
    import torch
    import torch.distributed as dist

    from partrain.models.adapters import get_adapter
    from partrain.models.build import build_meta_model
    from partrain.models.loss import token_loss
    from partrain.models.materialize import materialize
    from partrain.parallel.pipeline import (
        PipelineRunner,
        build_stage_module,
        clip_grad_norm_,
    )
    from partrain.runtime.activations import saved_activation_bytes

    cfg = _model_cfg(arch)
    meta = build_meta_model(cfg)
    adapter = get_adapter(meta)
    n_chunks = pp * v
    ranges = split_layers(4, n_chunks)
    chunks = chunk_placement(pp, v, SCHEDULE_STYLE[schedule])[rank]
    dp = dp_mesh.size() if dp_mesh is not None else 1
    dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else 0
    stages = []
    for c in chunks:
        stage = build_stage_module(meta, adapter, c, n_chunks, ranges[c])
        if wrap == "fsdp":  # each layer, then the stage module, on the meta model
            from torch.distributed.fsdp import fully_shard

            for layer in stage.layers().values():
                fully_shard(layer, mesh=dp_mesh, reshard_after_forward=False)
            fully_shard(stage, mesh=dp_mesh, reshard_after_forward=False)
        materialize(stage, cfg, SEED, "cpu")
        if wrap == "ddp":
            stage = torch.nn.parallel.DistributedDataParallel(stage, process_group=dp_mesh.get_group())
        stages.append(stage)
    micro = MICRO // dp  # the same microbatches as the reference, dealt out over dp
    runner = PipelineRunner(
        stages,
        chunks,
        n_chunks,
        pp_mesh,
        schedule,
        micro,
        token_loss,
        "cpu",
        microbatch_size=BATCH // MICRO,
        seq_len=SEQ,
        dp_group=dp_mesh if wrap == "dp_group" else None,
    )
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, foreach=False)
    out = {"losses": [], "grad_norms": [], "timings": [], "chunks": chunks}

    def local_rows(x, y):
        rows = BATCH // dp
        return x[dp_rank * rows : (dp_rank + 1) * rows], y[dp_rank * rows : (dp_rank + 1) * rows]

    def mean_loss(value):
        t = torch.tensor([runner.broadcast_loss(value)])
        if dp_mesh is not None:
            dist.all_reduce(t, group=dp_mesh.get_group())
        return t.item() / dp

    if not saved:  # forward-only pass on the first batch = the reference's first training loss
        out["eval0"] = mean_loss(runner.eval_step(*local_rows(*make_batch(0))))
    for step in range(steps):
        opt.zero_grad()
        x, y = local_rows(*make_batch(step))
        if saved:
            loss, peak = saved_activation_bytes(lambda: runner.step(x, y), params=params)
            out["saved_peak_bytes"] = peak
        else:
            loss = runner.step(x, y)
        out["grad_norms"].append(clip_grad_norm_(stages, 0.0, runner.group))
        opt.step()
        out["losses"].append(mean_loss(loss))
        out["timings"].append(runner.last_timing.to_json())
    if params_path is not None:
        torch.save(
            {f"{c}:{n}": p.detach().clone() for c, s in zip(chunks, stages) for n, p in s.named_parameters()},
            params_path,
        )
        out["params_file"] = str(params_path)
    return out


def launch(world: int, out_dir: Path, timeout_s: float = 400.0, mode: str = "worker") -> list:
    """Run this file's worker (mode "worker" or "bubble") in `world` processes; each rank's results."""
    store = out_dir / "store"
    procs, logs = [], []
    env_base = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    for rank in range(world):
        env = dict(env_base, RANK=str(rank), WORLD_SIZE=str(world))
        log = open(out_dir / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, mode, str(out_dir), str(store)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    deadline = time.time() + timeout_s
    failed = None
    while time.time() < deadline:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            failed = codes
            break
        if all(c == 0 for c in codes):
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for log in logs:
        log.close()
    results = []
    for rank in range(world):
        path = out_dir / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    errors = [r.get("error") for r in results if r.get("error")]
    if failed is not None or errors or any(not r for r in results):
        tails = "\n".join((out_dir / f"rank{r}.log").read_text()[-3000:] for r in range(world))
        raise RuntimeError(f"pipeline workers failed (exit codes {[p.returncode for p in procs]}):\n{errors}\n{tails}")
    return results


@pytest.fixture(scope="module")
def references():
    return {arch: reference_run(arch) for arch in MODELS}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    cache = {}

    def get(world: int):
        if world not in cache:
            cache[world] = launch(world, tmp_path_factory.mktemp(f"pp-world{world}"))
        return cache[world]

    return get


CASES = [(arch, schedule, pp, world) for world, runs in RUNS.items() for arch in MODELS for schedule, pp, _ in runs]
CASES += [(arch, schedule, pp, world) for world, runs in EXTRA.items() for arch, schedule, pp, _ in runs]
CASES += [(arch, f"{schedule}-pp2-dp2-{wrap}", None, 4) for arch, schedule, _, wrap in DP_RUNS]


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,schedule,pp,world", CASES, ids=[f"{a}-{s}" + (f"-pp{p}" if p else "") for a, s, p, _ in CASES]
)
def test_pipeline_matches_single_process(arch, schedule, pp, world, references, launches):
    """pp alone (2 and 4 ranks), and pp=2 x dp=2 with FSDP2, DDP or the runner's dp_group all-reduce."""
    import torch

    results = launches(world)
    key = f"{arch}-{schedule}" + (f"-pp{pp}" if pp else "")
    ref = references[arch]
    for rank, res in enumerate(results):
        got = res[key]
        rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
        assert max(rel) <= LOSS_RTOL, f"rank {rank} losses {got['losses']} vs {ref['losses']}"
        norm_rel = [abs(a - b) / abs(b) for a, b in zip(got["grad_norms"], ref["grad_norms"])]
        assert max(norm_rel) <= LOSS_RTOL, f"rank {rank} grad norms {got['grad_norms']} vs {ref['grad_norms']}"
        print(key, f"rank {rank}: loss rel diff {max(rel):.1e}, grad-norm rel diff {max(norm_rel):.1e}")
        assert abs(got["eval0"] - ref["losses"][0]) <= LOSS_RTOL * ref["losses"][0], (got["eval0"], ref["losses"][0])
        for timing in got["timings"]:
            assert 0 < timing["busy_s"] <= timing["wall_s"] * 1.05
    if pp is None:  # pp x dp: parameters are FSDP shards; losses and global grad norms were checked
        return
    seen, worst = set(), 0.0
    for rank, res in enumerate(results):
        params = torch.load(res[key]["params_file"])
        for name, value in params.items():
            fqn = name.split(":", 1)[1]
            seen.add(fqn)
            diff = (value - ref["params"][fqn]).abs().max().item()
            assert diff <= PARAM_ATOL, f"{name} on rank {rank} differs by {diff:.2e}"
            worst = max(worst, diff)
    print(key, f"parameters: largest difference {worst:.1e}")
    assert seen == set(ref["params"])  # every parameter lives on some stage
    if arch == "gpt2":  # the tied weight has two copies (first and last chunk) and they agree
        copies = [
            v
            for res in results
            for n, v in torch.load(res[key]["params_file"]).items()
            if n.endswith("transformer.wte.weight")
        ]
        assert len(copies) == 2 and torch.equal(copies[0], copies[1])


@pytest.mark.slow
def test_one_f_one_b_holds_fewer_activations_than_gpipe(launches):
    results = launches(2)
    gpipe = results[0]["saved-gpipe"]["saved_peak_bytes"]
    one_f_one_b = results[0]["saved-1f1b"]["saved_peak_bytes"]
    # pp=2, m=4: rank 0 keeps all 4 microbatches under GPipe, at most 2 under 1F1B.
    assert one_f_one_b > 0 and gpipe >= 1.6 * one_f_one_b, (gpipe, one_f_one_b)


# ---- bubble measurement (not a test: `python tests/test_pipeline.py bubble`) ------------------------

BUBBLE_MODEL = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    bos_token_id=0,
    eos_token_id=0,
    tie_word_embeddings=False,
)
BUBBLE_SHAPE = dict(microbatch=2, seq=128, microbatches=8, warmup=2, steps=5)
BUBBLE_RUNS = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved-1f1b", 2),
    ("looped-bfs", 2),
    ("interleaved-zero-bubble", 2),
    ("zbv", 2),
    ("dualpipev", 2),
]


def _bubble_worker(out_dir: str, store: str) -> None:
    """pp=2, one thread per process: per-rank busy/idle per step for each schedule (medians)."""
    import datetime
    import statistics

    import torch
    import torch.distributed as dist

    from partrain.blueprint.config.schema import ModelConfig
    from partrain.models.adapters import get_adapter
    from partrain.models.build import build_meta_model
    from partrain.models.loss import token_loss
    from partrain.models.materialize import materialize
    from partrain.parallel.pipeline import PipelineRunner, build_stage_module

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    cfg = ModelConfig(arch="llama", config=BUBBLE_MODEL)
    shape = BUBBLE_SHAPE
    m, b = shape["microbatches"], shape["microbatch"]
    results: dict = {}
    try:
        for schedule, v in BUBBLE_RUNS:
            meta = build_meta_model(cfg)
            n_chunks = world * v
            ranges = split_layers(BUBBLE_MODEL["num_hidden_layers"], n_chunks)
            chunks = chunk_placement(world, v, SCHEDULE_STYLE[schedule])[rank]
            stages = [
                materialize(build_stage_module(meta, get_adapter(meta), c, n_chunks, ranges[c]), cfg, SEED, "cpu")
                for c in chunks
            ]
            runner = PipelineRunner(
                stages,
                chunks,
                n_chunks,
                dist.group.WORLD,
                schedule,
                m,
                token_loss,
                "cpu",
                microbatch_size=b,
                seq_len=shape["seq"],
            )
            ids = torch.randint(0, 256, (m * b, shape["seq"] + 1), generator=torch.Generator().manual_seed(0))
            x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
            timings = []
            for step in range(shape["warmup"] + shape["steps"]):
                for p in runner.parameters():
                    p.grad = None
                dist.barrier()
                runner.step(x, y)
                if step >= shape["warmup"]:
                    timings.append(runner.last_timing.to_json())
            results[schedule] = {
                k: statistics.median(t[k] for t in timings) for k in ("wall_s", "busy_s", "idle_s", "bubble_fraction")
            }
    except BaseException as exc:
        import traceback

        results["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    if "error" not in results:
        finish_group()
    leave(1 if "error" in results else 0)


def bubble_report(world: int = 2) -> str:
    from partrain.blueprint.schedule_sim import formula_bubble, schedule_grid

    res = launch(world, Path(tempfile.mkdtemp(prefix="pp-bubble-")), timeout_s=590, mode="bubble")
    m = BUBBLE_SHAPE["microbatches"]
    lines = [
        f"pp={world}, m={m}, llama h=256 8 layers, microbatch {BUBBLE_SHAPE['microbatch']}x{BUBBLE_SHAPE['seq']}, "
        f"1 thread/process; medians of {BUBBLE_SHAPE['steps']} steps",
        f"{'schedule':24s} {'wall ms':>8s} {'measured idle share per rank':>30s} {'simulated':>9s} {'formula':>8s}",
    ]
    for schedule, v in BUBBLE_RUNS:
        wall = max(r[schedule]["wall_s"] for r in res)
        idle = " ".join(f"{r[schedule]['bubble_fraction']:.3f}" for r in res)
        sim = schedule_grid(schedule, world, v, m).bubble_fraction
        f = formula_bubble(schedule, world, v, m)
        lines.append(f"{schedule:24s} {wall * 1000:8.1f} {idle:>30s} {sim:9.3f} {'-' if f is None else f'{f:.3f}':>8s}")
    return "\n".join(lines)


if __name__ == "__main__" and len(sys.argv) >= 4 and sys.argv[1] in ("worker", "bubble"):
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    (_worker if sys.argv[1] == "worker" else _bubble_worker)(sys.argv[2], sys.argv[3])
elif __name__ == "__main__" and sys.argv[1:] == ["bubble"]:
    print(bubble_report())

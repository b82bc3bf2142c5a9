"""Expert parallelism for real (several gloo processes, the worker's code) against ep=1.

Every layout is compared with the one-process run of the same model, data and seed (dropless,
router losses on, fp32, 5 steps, 1e-5 relative on loss and gradient norm). The layouts share one
launch per process count (testing.in_process.train_all); the resume under another ep degree goes
through `partrain train` itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partrain.rehearse.runs import train_all
from partrain.runtime.spawn import run_spawned
from partrain.testing.parity import (
    check_parity,
    max_relative_difference,
    parity_args,
    reference_overrides,
    run_training,
)

pytestmark = pytest.mark.slow

STEPS = 5
COMMON = ["train.seq_len=64", "data.max_bytes=1000000"]
# Tiny Mixtral, 4 experts top-2, dp2 x ep2. Router losses 100x HF's default weight and a z-loss:
# they change the gradient norm by about 1%, so a wrongly scaled router-loss gradient cannot hide.
MIXTRAL = ["recipe=mixtral-ep", "parallel.moe_aux_loss_coef=0.1", "parallel.moe_z_loss_coef=0.01"]
QWEN = ["recipe=mixtral-ep", "model=qwen2-moe-tiny"]  # 8 experts top-2 + shared expert; HF's aux weight
QWEN3 = ["recipe=mixtral-ep", "model=qwen3-moe-tiny"]  # 4 experts top-2, q/k norms, no shared expert
# 4 biased transposed experts top-2, attention sinks; a window as long as the sequence so Ulysses runs it.
GPT_OSS = ["recipe=mixtral-ep", "model=gpt-oss-tiny", "model.config.sliding_window=64"]
DEEPSEEK = ["recipe=mixtral-ep", "model=deepseek-v3-tiny"]  # latent attention, a dense layer, a shared expert
# The generic MoE path (blueprint/families/generic_moe.py): transformers' own MoE blocks around partrain's
# routed experts. GLM-4.5: a dense first layer, a sigmoid router choosing inside groups with a selection bias,
# a shared expert split over tp; EXAONE-MoE: Qwen3's attention, its router bias saved under another name.
GLM4_MOE = ["recipe=mixtral-ep", "model=glm4-moe-tiny"]
EXAONE_MOE = ["recipe=mixtral-ep", "model=exaone-moe-tiny"]
FOUR = ["parallel.dp=4", "cluster.devices_per_node=4"]
# Auxiliary-loss-free balancing: the routers' selection bias moves after every step by the loads of every rank.
DEEPSEEK_BALANCED = DEEPSEEK + ["parallel.moe_bias_update_speed=0.05"]

LAYOUTS = {
    "mixtral-ep4": (MIXTRAL, FOUR + ["parallel.ep=4"]),
    # Megatron-SP on: the MoE block gathers the sequence, its experts (replicated over tp) see every token.
    "mixtral-ep2-tp2-sp": (
        MIXTRAL,
        [
            "parallel.dp=2",
            "parallel.ep=2",
            "parallel.tp=2",
            "parallel.tp_sequence_parallel=true",
            "cluster.devices_per_node=4",
        ],
    ),
    "mixtral-ep2-pp2-recompute": (
        MIXTRAL,
        ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "cluster.devices_per_node=4", "parallel.recompute=full"],
    ),
    "mixtral-ep2-fsdp-zero3": (MIXTRAL, FOUR + ["parallel.ep=2", "parallel.zero_stage=3"]),  # edp=2: FSDP over edp
    "mixtral-ep2-zero1": (MIXTRAL, FOUR + ["parallel.ep=2", "parallel.zero_stage=1"]),  # expert Adam state over edp=2
    "qwen2-moe-ep2": (QWEN, []),
    "qwen3-moe-ep2": (QWEN3, []),
    "gpt-oss-ep2": (GPT_OSS, []),
    "deepseek-v3-ep2": (DEEPSEEK, []),
    # The shared experts and the dense first layer's MLP split over tp, the routed experts over ep.
    "deepseek-v3-ep2-tp2": (
        DEEPSEEK,
        ["parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "cluster.devices_per_node=4"],
    ),
    "deepseek-v3-ep2-bias-update": (DEEPSEEK_BALANCED, []),
    "deepseek-v3-ep2-pp2-bias-update": (
        DEEPSEEK_BALANCED,
        ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "cluster.devices_per_node=4"],
    ),
    "glm4-moe-ep2-tp2": (GLM4_MOE, ["parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "cluster.devices_per_node=4"]),
    "glm4-moe-ep2-lora-bias-update": (
        GLM4_MOE + ["peft=lora", "parallel.moe_bias_update_speed=0.05"],
        [],
    ),
    "exaone-moe-ep2-pp2": (
        EXAONE_MOE,
        ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "cluster.devices_per_node=4"],
    ),
    # Each sp rank runs half of the heads after Ulysses' all-to-all, with those heads' sink logits.
    "gpt-oss-ep2-sp2-ulysses": (GPT_OSS, ["parallel.dp=1", "parallel.sp=2", "parallel.sp_mode=ulysses"]),
    # Context parallel: the router losses gather their statistics over the sp ranks' shards, so they
    # are the whole sequence's (each sp rank holds half of every sequence; ep carved out of sp).
    "mixtral-ep2-sp2-ulysses": (MIXTRAL, ["parallel.dp=1", "parallel.sp=2", "parallel.sp_mode=ulysses"]),
}


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


def _base(model, data_cache):
    return model + COMMON + [f"data.cache_dir={data_cache}"]


def _reference_name(model) -> str:
    names = {
        tuple(MIXTRAL): "mixtral",
        tuple(QWEN): "qwen2",
        tuple(QWEN3): "qwen3",
        tuple(GPT_OSS): "gpt-oss",
        tuple(DEEPSEEK): "deepseek",
        tuple(DEEPSEEK_BALANCED): "deepseek-balanced",
        tuple(GLM4_MOE): "glm4-moe",
        tuple(GLM4_MOE + ["peft=lora", "parallel.moe_bias_update_speed=0.05"]): "glm4-moe-lora-balanced",
        tuple(EXAONE_MOE): "exaone-moe",
    }
    return "reference-" + names[tuple(model)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """Every LAYOUTS entry and the one-process reference of each model, trained once per module
    through the worker's code; the runs of one process count share a launch (testing.in_process).
    Also the recipe as shipped, saving a checkpoint at step 3 for the resume and export tests."""
    cases = {"mixtral-ep2": parity_args(_base(MIXTRAL, data_cache) + ["checkpoint.every_steps=3"], STEPS)}
    for name, (model, layout) in LAYOUTS.items():
        cases[_reference_name(model)] = parity_args(reference_overrides(_base(model, data_cache)), STEPS)
        cases[name] = parity_args(_base(model, data_cache) + layout, STEPS)
    return train_all(cases, tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="module")
def mixtral_ep2(runs):
    """The recipe as shipped (dp2 x ep2), which saved a checkpoint at step 3."""
    return runs["mixtral-ep2"]


def test_mixtral_ep2_matches_single_process_and_holds_half_the_experts(mixtral_ep2, runs):
    ref = runs[_reference_name(MIXTRAL)]
    print("mixtral-ep2", check_parity(ref, mixtral_ep2))
    total = ref.summary["ranks"][0]["expert_param_bytes"]  # one process holds every expert
    for rank in mixtral_ep2.summary["ranks"]:
        assert abs(rank["expert_param_bytes"] - total / 2) <= 0.02 * total / 2, (rank, total)
    # Expert-load metrics: every routed token copy counted once over the ep group, each step.
    records = [json.loads(line) for line in (mixtral_ep2.run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens_per_step = 8 * 64 * 2 * 2  # global batch x seq_len x top_k x MoE layers
    for rec in records:
        assert sum(rec["moe_tokens_per_expert"]) == tokens_per_step
        assert rec["moe_imbalance"] >= 1.0 and rec["moe_aux_loss"] > 0 and rec["moe_z_loss"] > 0
    ref_records = [json.loads(line) for line in (ref.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["moe_tokens_per_expert"] for r in ref_records] == [r["moe_tokens_per_expert"] for r in records]
    load = mixtral_ep2.summary["moe"]
    assert len(load["tokens_per_expert"]) == 2 and len(load["tokens_per_expert"][0]) == 4
    assert [sum(row) for row in load["tokens_per_expert"]] == [STEPS * tokens_per_step // 2] * 2
    # What `partrain train` prints at the end (launch._print_summary renders this table).
    from rich.console import Console

    from partrain.blueprint.report.expert_load import expert_load_table

    console = Console(width=100, record=True)
    console.print(expert_load_table(load))
    text = console.export_text()
    assert "expert load" in text and "max/mean" in text and f"{load['tokens_per_expert'][1][3]:,}" in text


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, runs):
    model, _ = LAYOUTS[name]
    ref, got = runs[_reference_name(model)], runs[name]
    print(name, check_parity(ref, got))
    if name == "mixtral-ep4":
        total = ref.summary["ranks"][0]["expert_param_bytes"]
        assert all(abs(r["expert_param_bytes"] - total / 4) <= 0.02 * total / 4 for r in got.summary["ranks"])


def test_the_bias_update_changes_the_routing_of_one_process_as_of_every_layout(runs):
    """parallel.moe_bias_update_speed moves DeepSeek-V3's selection biases after each step: the balanced run
    leaves the plain one (its routing changed), and the layouts above matched it step by step."""
    plain, balanced = runs["reference-deepseek"], runs["reference-deepseek-balanced"]
    assert plain.losses[0] == balanced.losses[0]  # the first step routes with the loaded (zero) biases
    assert plain.losses[1:] != balanced.losses[1:], (plain.losses, balanced.losses)


def _routed_experts_ep2_vs_ep1(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    return {str(cf): _one_layer_ep2_vs_ep1(rank, mesh, cf) for cf in (None, 1.0)}


def _one_layer_ep2_vs_ep1(rank, mesh, capacity_factor):
    """One MoE layer's experts at ep=2 (this rank's tokens, half the experts) and at ep=1 (all
    experts, same tokens, no exchange): outputs, input gradients and expert gradients."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from partrain.parallel.expert_parallel import MoERuntime, MoESettings, RoutedExperts

    E, H, I, T, k = 4, 8, 6, 24, 2
    torch.manual_seed(0)
    full = {"gate_up_proj": torch.randn(E, 2 * I, H), "down_proj": torch.randn(E, H, I)}
    torch.manual_seed(1 + rank)  # each rank routes its own tokens, skewed so that capacity bites
    x = torch.randn(T, H)
    scores = torch.softmax(torch.randn(T, E) + torch.tensor([2.0, 1.0, 0.0, 0.0]), -1)
    weights, index = scores.topk(k, -1)
    runtime = MoERuntime(MoESettings(num_experts=E, top_k=k, num_moe_layers=1, capacity_factor=capacity_factor))

    def experts(params, ep_mesh):
        hf = torch.nn.Module()
        for name, value in params.items():
            setattr(hf, name, torch.nn.Parameter(value))
        hf.act_fn = torch.nn.SiLU()
        return RoutedExperts(hf, runtime, 0, ep_mesh).train()

    def run(module):
        xi = x.clone().requires_grad_(True)
        module(xi, index, weights).pow(2).sum().backward()
        return module, xi

    dense, x1 = run(experts({n: v.clone() for n, v in full.items()}, None))
    local = {n: DTensor.from_local(v[rank * 2 : rank * 2 + 2].clone(), mesh, [Shard(0)]) for n, v in full.items()}
    sharded, x2 = run(experts(local, mesh))
    out1, out2 = dense(x, index, weights), sharded(x, index, weights)
    dropped = int((dense.take_stats()[E : 2 * E]).sum())
    result = {
        "out": ((out1 - out2).abs().max() / out1.abs().max()).item(),
        "dx": ((x1.grad - x2.grad).abs().max() / x1.grad.abs().max()).item(),
        "dropped": dropped,
    }
    for name in full:  # ep=1 gradients of every rank's tokens, summed, against this rank's shard
        g = getattr(dense, name).grad.clone()
        dist.all_reduce(g)
        mine = g[rank * 2 : rank * 2 + 2]
        result[name] = (
            (mine - getattr(sharded, name).grad.to_local()).abs().max() / mine.abs().max()
        ).item()  # relative
    return result


def test_routed_experts_ep2_equal_ep1(tmp_path):
    """The exchange (uneven splits both ways), dropless and with capacity factor 1.0: ep=2 computes
    and drops exactly what ep=1 does (drops are decided on the sending rank from its own tokens)."""
    for per_rank in run_spawned(_routed_experts_ep2_vs_ep1, 2, tmp_path):
        print(per_rank)
        for cf, r in per_rank.items():
            assert max(r["out"], r["dx"], r["gate_up_proj"], r["down_proj"]) <= 1e-5, (cf, r)
            assert (r["dropped"] > 0) == (cf != "None"), (cf, r)


def _steps(run_dir: Path):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records if "loss" in r}


def test_resume_under_another_ep_degree(mixtral_ep2, tmp_path, data_cache):
    """Saved at ep=2 after step 3 (experts as Shard(0) DTensors under full FQNs), resumed at ep=4
    with ZeRO-1 (dense Adam state sharded over dp_shard, the expert shards' over edp): steps 4 and 5
    match the uninterrupted ep=2 run."""
    ckpt = mixtral_ep2.run_dir / "checkpoints" / "step-00000003"
    run_training(
        _base(MIXTRAL, data_cache) + FOUR + ["parallel.ep=4", "parallel.zero_stage=1", f"checkpoint.resume={ckpt}"],
        tmp_path / "run",
        STEPS,
    )
    straight, resumed = _steps(mixtral_ep2.run_dir), _steps(tmp_path / "run")
    assert sorted(resumed) == [4, 5]
    for i in (0, 1):
        diff = max_relative_difference([straight[s][i] for s in resumed], [resumed[s][i] for s in resumed])
        print("resume at ep4 zero1", "loss" if i == 0 else "grad_norm", diff)
        assert diff <= 1e-5


def test_export_of_an_ep_checkpoint_is_the_full_hf_model(mixtral_ep2, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from partrain.blueprint.config.compose import load_resolved
    from partrain.checkpoint import export_hf, load_checkpoint
    from partrain.checkpoint.record import model_record
    from partrain.models.build import build_meta_model
    from partrain.models.materialize import materialize
    from partrain.parallel.optimizer import make_torch_optimizer, param_groups

    ckpt = mixtral_ep2.run_dir / "checkpoints" / "step-00000003"
    hf = AutoModelForCausalLM.from_pretrained(export_hf(ckpt, tmp_path / "hf"), local_files_only=True)
    run = load_resolved(mixtral_ep2.run_dir / "config.yaml")
    model = materialize(build_meta_model(run.model), run.model, 0, "cpu")
    load_checkpoint(
        ckpt,
        [model],
        make_torch_optimizer(param_groups(model, run.optim.weight_decay), run.optim),
        {"model": model_record(run.model)},
    )
    for name, value in model.state_dict().items():
        if ".experts." in name:
            assert value.shape[0] == 4 and torch.equal(hf.state_dict()[name], value), name


MESH_LAYOUTS = [
    {"dp": 4, "ep": 2},
    {"dp": 2, "tp": 2, "ep": 2},
    {"dp": 2, "sp": 2, "ep": 4, "order": ("tp", "dp", "sp", "pp")},
]


def _mesh_groups(rank, world):
    import torch.distributed as dist

    from partrain.blueprint.layout import Layout
    from partrain.runtime.mesh import build_mesh

    out = []
    for degrees in MESH_LAYOUTS:
        mesh = build_mesh(Layout(**degrees), "cpu")
        out.append({f: dist.get_process_group_ranks(mesh[f].get_group()) for f in ("ep", "edp", "dp_sp")})
    return out


def test_mesh_ep_and_edp_groups_are_the_layouts(tmp_path):
    from partrain.blueprint.layout import Layout

    for rank, per_layout in enumerate(run_spawned(_mesh_groups, 4, tmp_path)):
        for degrees, groups in zip(MESH_LAYOUTS, per_layout):
            for family, members in groups.items():
                assert members == Layout(**degrees).group_of(family, rank), (degrees, family, rank)


def _tiny_moe(family: str, layers: int):
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    from partrain.models.adapters import MIXTRAL, QWEN2_MOE, QWEN3_MOE

    kw = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts_per_tok": 2,
    }
    if family == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**kw, num_local_experts=4)), MIXTRAL
    if family == "deepseek_v3":  # every layer routed (no dense first layer), 2 groups of 2 experts
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        from partrain.models.adapters import get_adapter

        mla = dict(q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
        kw["num_key_value_heads"] = kw["num_attention_heads"]  # latent attention expands K/V to every head
        config = DeepseekV3Config(
            **kw, n_routed_experts=4, n_group=2, topk_group=1, moe_intermediate_size=32, first_k_dense_replace=0, **mla
        )
        model = DeepseekV3ForCausalLM(config)
        return model, get_adapter(model)
    if family == "gpt_oss":
        import torch
        from transformers import GptOssConfig, GptOssForCausalLM

        from partrain.models.adapters import get_adapter

        model = GptOssForCausalLM(GptOssConfig(**kw, num_local_experts=4, head_dim=8))
        with torch.no_grad():  # transformers starts its biases and sinks at zero: make them count
            for name, p in model.named_parameters():
                if name.endswith("bias") or name.endswith("sinks"):
                    p.normal_(0.0, 0.5)
        return model, get_adapter(model)
    if family == "qwen2_moe":
        return Qwen2MoeForCausalLM(
            Qwen2MoeConfig(**kw, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64)
        ), QWEN2_MOE
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**kw, num_experts=4, moe_intermediate_size=32, head_dim=8)), QWEN3_MOE


def test_routed_experts_compute_what_transformers_computes_on_the_generic_moe_path():
    """Every family of the generic MoE path, built small by its survey: swapping its experts modules for
    RoutedExperts (ep=1) inside transformers' own MoE blocks gives transformers' logits."""
    from types import SimpleNamespace

    import torch

    from partrain.blueprint.families.generic_moe import GENERIC_MOE_RECORDS
    from partrain.models.adapters import get_adapter
    from partrain.models.generic_moe_survey import _build, _kwargs
    from partrain.parallel.expert_parallel import apply_ep, new_runtime

    parallel = SimpleNamespace(moe_capacity_factor=None, moe_aux_loss_coef=None, moe_z_loss_coef=0.0)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for arch in GENERIC_MOE_RECORDS:
        model = _build(arch, _kwargs(arch, 0)[0], "cpu").train()
        expected = model(input_ids=x).logits
        adapter = get_adapter(model)
        runtime = new_runtime(model, adapter, parallel)
        swapped = apply_ep(model, adapter, None, runtime)
        assert len(swapped) == runtime.settings.num_moe_layers > 0, arch
        assert (model(input_ids=x).logits - expected).abs().max().item() <= 1e-6, arch
        assert all(layer.take_stats()[-1].item() == 1 for layer in swapped), arch  # each block ran its experts


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_routed_experts_compute_what_hf_computes(family):
    """RoutedExperts (ep=1) gives HF's logits; on a one-layer model its aux loss is HF's
    load_balancing_loss_func (HF concatenates layers, partrain averages per-layer values). DeepSeek-V3
    has no auxiliary loss in transformers (its router balances through a bias): partrain adds none."""
    from types import SimpleNamespace

    import torch

    from partrain.parallel.expert_parallel import apply_ep, new_runtime

    parallel = SimpleNamespace(moe_capacity_factor=None, moe_aux_loss_coef=None, moe_z_loss_coef=0.0)
    for layers in (2, 1):
        torch.manual_seed(0)
        model, adapter = _tiny_moe(family, layers)
        model.train()
        x = torch.randint(0, 64, (2, 16))
        hf = model(input_ids=x, output_router_logits=True)
        runtime = new_runtime(model, adapter, parallel)
        assert runtime.settings.aux_coef == getattr(model.config, "router_aux_loss_coef", 0.0)
        assert len(apply_ep(model, adapter, None, runtime)) == layers
        logits = model(input_ids=x).logits
        assert (logits - hf.logits).abs().max().item() <= 1e-6
        if layers == 1 and family != "deepseek_v3":
            aux = runtime.layers[0].take_stats()[-3].item()
            assert abs(aux - hf.aux_loss.item()) <= 1e-6 * hf.aux_loss.item(), (aux, hf.aux_loss.item())

"""DeepSeek-V3 mixture of experts: routing against the paper's equations, the layer
against transformers' DeepseekV3MoE, checkpoint names (per expert and fused), and the
grouped-GEMM path against the per-expert loop.

On the "masked groups = 0" bug: transformers has filled the experts of dropped groups
with 0 instead of -inf, which picks them whenever every kept choice score is negative
(negative correction biases). transformers 5.24 fills them with -inf (its
DeepseekV3TopkRouter uses masked_fill(..., float("-inf"))), so the layer is compared with
it directly on every config, negative biases included. The layer is also held, on every
config, to a float64 reference built from the paper's routing and its weights
(moe_reference); `_transformers_masks_with_zero` runs transformers' router on the
constructed case, and a transformers with the bug is expected to differ from that
reference instead of being compared with the layer.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from batchgen.layers.moe import DeepseekV3MoE
from batchgen.layers.moe_routing import RoutingConfig, select_experts
from batchgen.layers.routed_experts import fused_experts, grouped_mm_available


def route_reference(logits, bias, cfg: RoutingConfig) -> list[dict[int, float]]:
    """DeepSeek-V3 routing token by token in float64 (paper, eqs. 12-16, with the
    group limit of its inference config): {expert: weight} per token."""
    per_group = cfg.num_experts // cfg.n_group
    routes = []
    for row in logits.double().tolist():
        if cfg.scoring_func == "sigmoid":
            s = [1.0 / (1.0 + math.exp(-u)) for u in row]
        else:
            z = sum(math.exp(u) for u in row)
            s = [math.exp(u) / z for u in row]
        c = [s_i + float(b_i) for s_i, b_i in zip(s, bias.tolist())]
        eligible = list(range(cfg.num_experts))
        if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
            groups = [list(range(g * per_group, (g + 1) * per_group)) for g in range(cfg.n_group)]
            group_score = [sum(sorted((c[i] for i in grp), reverse=True)[:2]) for grp in groups]
            kept = sorted(range(cfg.n_group), key=lambda g: -group_score[g])[: cfg.topk_group]
            eligible = [i for g in kept for i in groups[g]]
        chosen = sorted(eligible, key=lambda i: -c[i])[: cfg.top_k]
        denom = sum(s[i] for i in chosen) if cfg.norm_topk_prob else 1.0
        routes.append({i: cfg.routed_scaling_factor * s[i] / denom for i in chosen})
    return routes


def as_routes(weights, ids) -> list[dict[int, float]]:
    return [dict(zip(i, w)) for w, i in zip(weights.tolist(), ids.tolist())]


def assert_same_routes(ours, ref, tol=1e-6):
    for t, (a, b) in enumerate(zip(ours, ref)):
        assert set(a) == set(b), f"token {t}: experts {sorted(a)} != reference {sorted(b)}"
        for e in a:
            assert abs(a[e] - b[e]) <= tol, f"token {t} expert {e}: {a[e]} != {b[e]}"


ROUTINGS = {
    "groups, negative biases": (RoutingConfig(16, 4, 4, 2, True, 2.5), -0.6, 0.2),
    "groups, mixed biases": (RoutingConfig(32, 8, 8, 3, True, 2.827), 0.0, 0.5),
    "groups, unnormalised": (RoutingConfig(16, 3, 4, 2, False, 1.5), -0.2, 0.3),
    "one expert per group": (RoutingConfig(8, 2, 8, 3, True, 1.0), -0.4, 0.3),
    "no group limit (n_group=1)": (RoutingConfig(12, 3, 1, 1, True, 2.0), -0.5, 0.3),
    "no group limit (topk_group=n_group)": (RoutingConfig(16, 4, 4, 4, True, 1.0), -0.5, 0.3),
    "softmax": (RoutingConfig(16, 4, 4, 2, True, 1.0, "softmax"), -0.3, 0.1),
}


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_routing_matches_the_paper(name):
    cfg, bias_mean, bias_std = ROUTINGS[name]
    gen = torch.Generator().manual_seed(len(name))
    logits = 2 * torch.randn(64, cfg.num_experts, generator=gen)
    bias = bias_mean + bias_std * torch.randn(cfg.num_experts, generator=gen)
    weights, ids = select_experts(logits, bias, cfg)
    assert weights.dtype == torch.float32 and ids.shape == (64, cfg.top_k)
    assert_same_routes(as_routes(weights, ids), route_reference(logits, bias, cfg))


def masked_groups_case() -> tuple[torch.Tensor, torch.Tensor, RoutingConfig, set[int]]:
    """Every bias is -1, so every kept choice score s + b is below 0. Groups 0 and 1 (of
    4) win; experts 4..7 are masked. The top 3 of the kept choices: 0, 1, 2."""
    cfg = RoutingConfig(8, 3, 4, 2, True, 1.0)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.5, 1.0, 0.5, -4.0, -5.0]])
    bias = torch.full((8,), -1.0)
    return logits, bias, cfg, {0, 1, 2}


def test_masked_groups_are_minus_infinity_not_zero():
    logits, bias, cfg, expected = masked_groups_case()
    choice = logits.sigmoid() + bias
    kept = {0, 1, 2, 3}
    zero_filled = choice.clone()
    zero_filled[:, 4:] = 0.0  # the bug: masked experts get 0, above every kept choice
    buggy = set(zero_filled.topk(cfg.top_k, dim=-1).indices[0].tolist())
    assert buggy - kept, "the constructed case must make the 0-fill pick a masked expert"
    weights, ids = select_experts(logits, bias, cfg)
    assert set(ids[0].tolist()) == expected
    assert_same_routes(as_routes(weights, ids), route_reference(logits, bias, cfg))


def test_config_errors_name_the_value():
    base = dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, hidden_size=8)
    for extra, message in [
        ({"scoring_func": "sqrtsoftplus"}, "scoring_func='sqrtsoftplus'"),
        ({"topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy'"),
        ({"n_group": 3}, "n_group=3"),
        ({"topk_group": 5}, "topk_group=5"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            RoutingConfig.from_hf(types.SimpleNamespace(**{**base, **extra}))


# ---- the layer against transformers -------------------------------------------------

HIDDEN, INTER = 24, 8


def tiny_config(**overrides):
    from transformers import DeepseekV3Config

    fields = dict(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        n_routed_experts=16,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    cfg = DeepseekV3Config(**{**fields, **overrides})
    cfg._experts_implementation = "eager"
    return cfg


def hf_moe(cfg, bias_mean: float, seed: int = 0):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as HFMoE

    gen = torch.Generator().manual_seed(seed)
    module = HFMoE(cfg).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        bias = module.gate.e_score_correction_bias
        bias.copy_(bias_mean + 0.2 * torch.randn(bias.shape, generator=gen))
    return module


def ours_from(state_dict, cfg) -> DeepseekV3MoE:
    module = DeepseekV3MoE(cfg, dtype=torch.float32)
    for name, tensor in state_dict.items():
        module.load_weight(name, tensor)
    return module


def moe_reference(state: dict[str, torch.Tensor], cfg, x: torch.Tensor) -> torch.Tensor:
    """The layer in float64 from its weights (transformers' fused names): the paper's
    routing (route_reference), each chosen expert's SwiGLU MLP times its weight, plus the
    shared experts' MLP."""
    w = {name: t.detach().double() for name, t in state.items()}
    x = x.double()

    def mlp(h, gate, up, down):
        return (torch.nn.functional.silu(h @ gate.t()) * (h @ up.t())) @ down.t()

    routes = route_reference(
        x @ w["gate.weight"].t(), w["gate.e_score_correction_bias"], RoutingConfig.from_hf(cfg)
    )
    inter = w["experts.down_proj"].shape[2]
    out = mlp(x, *(w[f"shared_experts.{p}_proj.weight"] for p in ("gate", "up", "down")))
    for t, route in enumerate(routes):
        for e, weight in route.items():
            gate_up = w["experts.gate_up_proj"][e]
            down = w["experts.down_proj"][e]
            out[t] += weight * mlp(x[t], gate_up[:inter], gate_up[inter:], down)
    return out


def _transformers_masks_with_zero() -> bool:
    """Whether the installed transformers' router picks a masked expert in the
    constructed case (the old 0-fill bug)."""
    logits, bias, cfg, expected = masked_groups_case()
    hf = hf_moe(tiny_config(hidden_size=1, n_routed_experts=8, num_experts_per_tok=3), 0.0)
    with torch.no_grad():
        hf.gate.weight.copy_(logits.t())  # x = [[1.0]] gives these logits
        hf.gate.e_score_correction_bias.copy_(bias)
        _, _, ids = hf.gate(torch.ones(1, 1))
    return set(ids[0].tolist()) != expected


HF_CASES = {
    "positive biases, group limit": ({}, 0.3),
    "negative biases, group limit": ({}, -0.8),
    "no group limit": ({"n_group": 1, "topk_group": 1}, -0.5),
    "unnormalised, 1 shared": ({"norm_topk_prob": False, "n_shared_experts": 1}, 0.1),
}


@pytest.mark.parametrize("name", list(HF_CASES))
def test_layer_matches_transformers(name):
    overrides, bias_mean = HF_CASES[name]
    cfg = tiny_config(**overrides)
    hf = hf_moe(cfg, bias_mean)
    ours = ours_from(hf.state_dict(), cfg)  # transformers' fused names
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf(x), ours(x)
    assert got.shape == (40, HIDDEN) and expected.abs().max() > 0.1
    reference = moe_reference(hf.state_dict(), cfg, x).float()
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)
    if bias_mean < 0 and cfg.topk_group < cfg.n_group and _transformers_masks_with_zero():
        # transformers' 0-fill picks masked experts here: it, not the layer, is off
        assert not torch.allclose(expected, reference, atol=1e-5)
    else:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_transformers_5_24_masks_with_minus_infinity():
    import transformers

    major, minor = (int(v) for v in transformers.__version__.split(".")[:2])
    if (major, minor) < (5, 24):
        pytest.skip(f"transformers {transformers.__version__} predates the checked 5.24")
    assert not _transformers_masks_with_zero()


def per_expert_state_dict(fused: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors split into hub checkpoint names."""
    out = {k: v for k, v in fused.items() if not k.startswith("experts.")}
    gate_up, down = fused["experts.gate_up_proj"], fused["experts.down_proj"]
    for e in range(gate_up.shape[0]):
        gate, up = gate_up[e].chunk(2, dim=0)
        out[f"experts.{e}.gate_proj.weight"] = gate.clone()
        out[f"experts.{e}.up_proj.weight"] = up.clone()
        out[f"experts.{e}.down_proj.weight"] = down[e].clone()
    return out


def test_per_expert_and_fused_names_load_the_same_layer():
    cfg = tiny_config()
    hf = hf_moe(cfg, -0.3, seed=3)
    fused = ours_from(hf.state_dict(), cfg)
    per_expert = ours_from(per_expert_state_dict(hf.state_dict()), cfg)
    for (name, a), (_, b) in zip(fused.named_parameters(), per_expert.named_parameters()):
        assert torch.equal(a, b), name
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(per_expert(x), hf(x), atol=1e-5, rtol=1e-5)


def test_save_pretrained_writes_per_expert_names(tmp_path):
    """transformers 5 keeps experts fused in memory but writes hub names on save."""
    from safetensors.torch import load_file
    from transformers import DeepseekV3ForCausalLM

    cfg = tiny_config(
        vocab_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=2,
        kv_lora_rank=8,
        q_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
    )
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path)
    prefix = "model.layers.1.mlp."
    saved = {
        k[len(prefix) :]: v
        for k, v in load_file(tmp_path / "model.safetensors").items()
        if k.startswith(prefix)
    }
    assert "experts.0.gate_proj.weight" in saved and "experts.gate_up_proj" not in saved
    ours = ours_from(saved, cfg)
    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), model.model.layers[1].mlp(x), atol=1e-5, rtol=1e-5)


def test_loading_rejects_unknown_names_and_wrong_shapes():
    cfg = tiny_config()
    module = DeepseekV3MoE(cfg)
    for name in ["experts.16.up_proj.weight", "experts.0.w1.weight", "gate.routing", "up_proj"]:
        with pytest.raises(KeyError):
            module.load_weight(name, torch.zeros(1))
    with pytest.raises(ValueError, match="shape"):
        module.load_weight("experts.0.gate_proj.weight", torch.zeros(HIDDEN, INTER))
    with pytest.raises(ValueError, match="shape"):
        module.load_weight("experts.gate_up_proj", torch.zeros(16, HIDDEN, 2 * INTER))
    with pytest.raises(ValueError, match="shape"):
        module.load_weight("gate.e_score_correction_bias", torch.zeros(8))


def test_built_as_the_loader_builds_the_router_stays_float32():
    """build_model constructs on the meta device under the model's default dtype, then
    to_empty; the router keeps float32, the experts take the model dtype."""
    from batchgen.models.loader import init_dummy_weights

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            module = DeepseekV3MoE(tiny_config())
    finally:
        torch.set_default_dtype(old)
    module.to_empty(device="cpu")
    init_dummy_weights(module)
    dtypes = {name: p.dtype for name, p in module.named_parameters()}
    assert dtypes.pop("gate.weight") == dtypes.pop("gate.e_score_correction_bias") == torch.float32
    assert set(dtypes.values()) == {torch.bfloat16}, dtypes
    assert not module.gate.e_score_correction_bias.any()
    out = module(torch.randn(5, HIDDEN, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (5, HIDDEN) and out.isfinite().all()


def _bf16_layer(act_dtype=torch.bfloat16) -> DeepseekV3MoE:
    old = torch.get_default_dtype()
    torch.set_default_dtype(act_dtype)
    try:
        with torch.device("meta"):
            module = DeepseekV3MoE(tiny_config())
    finally:
        torch.set_default_dtype(old)
    return module.to_empty(device="cpu")


def test_router_keeps_a_narrow_copy_only_of_an_exactly_narrow_weight():
    """after_load keeps the router weight in the activations' dtype only where the
    float32 weight holds that dtype's values: then its products and sums are those of
    the float32 GEMM; a weight with wider values keeps the float32 path."""
    module = _bf16_layer()
    gate = module.gate
    exact = torch.randn(gate.weight.shape).bfloat16()
    with torch.no_grad():
        gate.weight.copy_(exact.float())
    gate.after_load()
    assert gate.weight_narrow is not None and gate.weight_narrow.dtype == torch.bfloat16
    assert torch.equal(gate.weight_narrow, exact)
    assert "weight_narrow" not in module.state_dict()  # derived, never loaded or saved
    with torch.no_grad():
        gate.weight[3, 5] += 2.0**-20  # one value between two bfloat16 neighbours
    gate.after_load()
    assert gate.weight_narrow is None
    wide = _bf16_layer(torch.float32).gate  # a float32 model: nothing narrower to keep
    with torch.no_grad():
        wide.weight.copy_(exact.float())
    wide.after_load()
    assert wide.weight_narrow is None


def test_dummy_router_holds_model_dtype_values_and_the_loader_narrows_it():
    """load_format="dummy" in bfloat16 draws the float32 router at bfloat16 (as this
    family's checkpoints store it), and build_model's after_load hook keeps the narrow
    copy; on the CPU forward still multiplies in float32, its logits those of the copy."""
    from batchgen.models.loader import init_dummy_weights

    module = _bf16_layer()
    init_dummy_weights(module, dtype=torch.bfloat16)
    w = module.gate.weight.detach()
    assert w.dtype == torch.float32 and w.abs().sum() > 0
    assert torch.equal(w.bfloat16().float(), w)
    bf16 = {n: p for n, p in module.named_parameters() if p.dtype == torch.bfloat16}
    other = _bf16_layer()
    init_dummy_weights(other)  # no dtype: the float32 router keeps float32 values
    assert not torch.equal(other.gate.weight.bfloat16().float(), other.gate.weight)
    for n, p in other.named_parameters():  # the bfloat16 weights drawn alike either way
        if n in bf16:
            assert torch.equal(p, bf16[n]), n
    module.gate.after_load()
    assert torch.equal(module.gate.weight_narrow.float(), w)
    x = torch.randn(6, HIDDEN).bfloat16()
    weights, ids = module.gate(x)
    ref_w, ref_ids = select_experts(
        x.float() @ module.gate.weight_narrow.float().t(),
        module.gate.e_score_correction_bias,
        module.gate.routing,
    )
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)


# ---- the grouped-GEMM path ----------------------------------------------------------


def _grouped_mm_runs_here() -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a, w = torch.ones(2, 8), torch.ones(1, 8, 8)
        torch._grouped_mm(a, w.transpose(1, 2), offs=torch.tensor([2], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not _grouped_mm_runs_here(), reason="torch._grouped_mm has no CPU kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_path_matches_the_loop(dtype):
    """Experts 0 and 5 get no rows; the sort, offsets and un-sort are shared code, the
    grouped op must agree with one matmul per expert."""
    gen = torch.Generator().manual_seed(5)
    e, t, k = 8, 13, 3
    x = torch.randn(t, 16, generator=gen).to(dtype)
    gate_up = (0.3 * torch.randn(e, 32, 16, generator=gen)).to(dtype)
    down = (0.3 * torch.randn(e, 16, 16, generator=gen)).to(dtype)
    pool = torch.tensor([1, 2, 3, 4, 6, 7])
    ids = torch.stack([pool[torch.randperm(6, generator=gen)[:k]] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen)
    loop = fused_experts(x, gate_up, down, weights, ids, use_grouped_mm=False)
    grouped = fused_experts(x, gate_up, down, weights, ids, use_grouped_mm=True)
    expected = torch.zeros(t, 16)
    for i in range(t):
        for j in range(k):
            g, u = (x[i].float() @ gate_up[ids[i, j]].float().t()).chunk(2)
            h = (torch.nn.functional.silu(g) * u) @ down[ids[i, j]].float().t()
            expected[i] += weights[i, j] * h
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(loop.float(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(grouped, loop, atol=tol / 10, rtol=tol / 10)
    assert not grouped_mm_available(x)  # the layer itself keeps the loop on the CPU

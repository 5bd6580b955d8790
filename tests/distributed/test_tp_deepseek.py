"""DeepSeek-V3 at tensor_parallel_size=2 (this process rank 0, one spawned gloo worker)
against tensor_parallel_size=1 on tiny random checkpoints: MLA heads split over a
replicated latent cache, routed experts in one block per rank. The same greedy tokens and
finish reasons, logprobs within 1e-4 (every request asks for one, so decode is not
pipelined), through chunked prefills of a few pages and tens of decode steps, the engine's
defaults otherwise (the checkpoint's EOS is a token the model emits, so some requests stop
on it)."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from deepseek_checkpoints import CONFIGS, save_tiny_deepseek, tiny_config
from deepseek_ranks import emitted_mid_way, shared_head_prompts
from fp8_blocks import quantize_blocks
from penalty_reference import set_eos
from safetensors.torch import load_file, save_file

from batchgen import LLM, SamplingParams
from batchgen.layers.moe import DeepseekV3MoE
from batchgen.layers.routed_experts import fused_experts
from batchgen.layers.tp_group import TPGroup
from batchgen.models import registry
from batchgen.models.deepseek_v3 import DeepseekV3ForCausalLM
from batchgen.models.loader import ModelSource, build_model
from batchgen.models.registry import check_tensor_parallel

KW = dict(
    device="cpu",
    dtype="float32",
    page_size=4,
    max_model_len=128,
    max_num_batched_tokens=24,  # chunked prefills next to decodes
)
PARAMS = SamplingParams(temperature=0, max_tokens=24, logprobs=1)


def _completions(outs) -> list[tuple[list[int], str, list[float]]]:
    """Per request: its tokens, finish reason, and each token's logprob."""
    result = []
    for out in outs:
        c = out.outputs[0]
        logprobs = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
        result.append((c.token_ids, c.finish_reason, logprobs))
    return result


def _generate(path: str, params: SamplingParams = PARAMS, **kw) -> tuple[list, LLM]:
    llm = LLM(path, **KW, **kw)
    try:
        outs = llm.generate(shared_head_prompts(), params, use_tqdm=False)
        return (_completions(outs) if params is PARAMS else outs), llm
    finally:
        llm.engine.shutdown()


def _checkpoint_with_emitted_eos(path: Path, overrides: dict) -> list:
    """A checkpoint whose EOS is a token its TP=1 run emits mid-way; that run's results
    under that EOS."""
    save_tiny_deepseek(path, **overrides)
    first, _ = _generate(str(path), num_kv_pages=200)
    set_eos(path, emitted_mid_way([tokens for tokens, _, _ in first]))
    want, _ = _generate(str(path), num_kv_pages=200)
    return want


def _assert_same(got: list, want: list) -> None:
    assert [(t, r) for t, r, _ in got] == [(t, r) for t, r, _ in want]
    worst = max(abs(a - b) for (_, _, la), (_, _, lb) in zip(got, want) for a, b in zip(la, lb))
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"


@pytest.mark.parametrize("name", ["q_lora", "plain_q_no_interleave", "moe_dense_first"])
def test_tp2_equals_tp1(tmp_path, name):
    """q_lora: q_a_proj / q_b_proj; plain q: q_proj split by heads, rope not interleaved;
    moe_dense_first: a dense layer, then 8 experts in 2 groups (1 kept), a shared expert."""
    want = _checkpoint_with_emitted_eos(tmp_path, CONFIGS[name])
    got, llm = _generate(str(tmp_path), num_kv_pages=200, tensor_parallel_size=2)
    _assert_same(got, want)
    assert {r for _, r, _ in got} == {"stop", "length"}
    assert sum(len(t) for t, _, _ in got) >= 60  # tens of decode steps
    model = llm.engine.model  # rank 0's share
    assert model.layers[0].self_attn.num_heads == 2  # of 4
    assert model.layers[0].self_attn.kv_b_proj.weight.shape[0] == 2 * (16 + 24)
    if name == "moe_dense_first":
        assert model.layers[1].mlp.experts.local_experts == range(0, 4)
        assert model.layers[1].mlp.experts.gate_up_proj.shape[0] == 4


def test_tp2_triton_backend_equals_tp1(tmp_path):
    """The Triton MLA backend (the interpreter on the CPU) on each rank's local heads:
    mla_decode over the replicated latent pages, prefill_attention over its heads'
    decompressed K / V."""
    save_tiny_deepseek(tmp_path, **CONFIGS["moe_dense_first"])
    triton = dict(attention_backend="triton", num_kv_pages=64)
    want, _ = _generate(str(tmp_path), **triton)
    got, llm = _generate(str(tmp_path), tensor_parallel_size=2, **triton)
    assert llm.engine.runner.attention_backend == "triton"
    _assert_same(got, want)
    assert sum(len(t) for t, _, _ in got) >= 60


def test_tp2_host_tier_swaps_and_equals_tp1_tier_off(tmp_path):
    """A pool too small for the batch: latent pages swap to the host and back on both
    ranks (each its own replica), the outputs stay the ample-pool TP=1 run's."""
    want = _checkpoint_with_emitted_eos(tmp_path, CONFIGS["moe_dense_first"])
    tier = dict(tensor_parallel_size=2, num_kv_pages=18, host_kv_size_gib=0.001)
    llm = LLM(str(tmp_path), **{**KW, "max_model_len": 64}, **tier)
    try:
        got = _completions(llm.generate(shared_head_prompts(), PARAMS, use_tqdm=False))
        (worker,) = llm.engine.tier_worker_metrics()
        m = llm.engine.metrics()
    finally:
        llm.engine.shutdown()
    _assert_same(got, want)
    assert m["swaps_out"] > 0 and m["swaps_in"] > 0, m
    assert worker["pages_loaded"] == m["pages_loaded"] > 0
    assert worker["pages_offloaded"] == m["pages_offloaded"] > 0


def _fp8_with_fused_experts(path: Path) -> None:
    """Rewrite a saved checkpoint as DeepSeek-V3's FP8 one (every 2-D projection weight
    float8 with per-block scales), its routed experts as fused [E, ...] tensors."""
    block = (16, 32)
    tensors, experts = {}, {}
    for name, t in load_file(str(path / "model.safetensors")).items():
        expert = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)_proj\.weight$", name)
        if expert:
            experts.setdefault(expert[1], {})[(int(expert[2]), expert[3])] = t
        elif name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight"):
            tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(t.float(), block)
        else:
            tensors[name] = t
    for prefix, parts in experts.items():
        num = 1 + max(e for e, _ in parts)
        gate_up = [torch.cat((parts[e, "gate"], parts[e, "up"])) for e in range(num)]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}.down_proj"] = torch.stack([parts[e, "down"] for e in range(num)])
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block)}
    (path / "config.json").write_text(json.dumps(config))


def test_tp2_loads_fp8_weights_and_fused_experts_as_tp1_does(tmp_path):
    """Each rank cuts its heads, features and expert block from the dequantized full
    tensors and from the fused expert tensors."""
    save_tiny_deepseek(tmp_path, **CONFIGS["moe_dense_first"])
    _fp8_with_fused_experts(tmp_path)
    names = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.1.mlp.experts.gate_up_proj" in names
    assert "model.layers.0.self_attn.kv_b_proj.weight_scale_inv" in names
    want, _ = _generate(str(tmp_path), num_kv_pages=200)
    got, _ = _generate(str(tmp_path), num_kv_pages=200, tensor_parallel_size=2)
    _assert_same(got, want)
    assert sum(len(t) for t, _, _ in got) >= 60


def _checkpoint_of_dummy_shares(path: Path, size: int) -> dict[str, torch.Tensor]:
    """The full checkpoint whose TP=1 load holds the weights that a TP=`size` engine draws
    with load_format "dummy". Each rank's share is built as the engine builds it (the same
    seed, dtype and parameter shapes); where each checkpoint element lands in that share
    is found by loading a probe into a second share, each element's flat index as its
    value. A replicated weight must come out the same on every rank."""
    source = ModelSource.resolve(path)
    config = source.load_config()
    shapes = {n: t.shape for n, t in load_file(str(path / "model.safetensors")).items()}
    full = {n: torch.full(s, float("nan")) for n, s in shapes.items()}
    cpu, positions = torch.device("cpu"), KW["max_model_len"]
    for rank in range(size):
        tp = TPGroup(rank, size)
        share = build_model(source, config, torch.float32, cpu, positions, "dummy", 0, tp=tp)
        probe = build_model(source, config, torch.float32, cpu, positions, "dummy", 0, tp=tp)
        drawn = dict(share.named_parameters())
        names = {id(p): n for n, p in probe.named_parameters()}
        for name, shape in shapes.items():
            target = probe.checkpoint_target(name)
            if target is None:
                continue
            module, param, shard = target
            p = getattr(module, param)
            index = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
            with torch.no_grad():
                p.fill_(-1.0)
                if hasattr(module, "load"):
                    module.load(param, index, shard)
                else:
                    p.copy_(index)
            held = p.detach() >= 0
            at, values = p.detach()[held].long(), drawn[names[id(p)]].detach()[held]
            flat = full[name].view(-1)
            earlier = ~flat[at].isnan()
            assert torch.equal(flat[at][earlier], values[earlier]), f"{name}: ranks differ"
            flat[at] = values
    assert not [n for n, t in full.items() if t.isnan().any()], "elements no rank holds"
    return full


def test_tp2_dummy_weights_generate_as_tp1_on_the_checkpoint_they_make(tmp_path):
    """load_format "dummy" at TP=2: the ranks draw their shares apart (see build_model),
    so TP=1 is run on the full checkpoint those shares make up: the same greedy tokens,
    finish reasons and logprobs."""
    model, full = tmp_path / "model", tmp_path / "full"
    save_tiny_deepseek(model, **CONFIGS["moe_dense_first"])
    shutil.copytree(model, full)
    save_file(_checkpoint_of_dummy_shares(model, 2), str(full / "model.safetensors"))
    top2 = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
    want, _ = _generate(str(full), top2, num_kv_pages=64)
    got, _ = _generate(
        str(model), top2, num_kv_pages=64, tensor_parallel_size=2, load_format="dummy"
    )
    assert _same_up_to_a_near_tie(got, want) >= 60  # tens of decode steps compared


def _same_up_to_a_near_tie(got, want, tol: float = 1e-4) -> int:
    """Greedy outputs equal token for token, logprobs within `tol`, up to a near-tie: a
    random tiny model's two best logits can lie within the rounding of TP=2's split sums
    (a CPU's BLAS blocks a product by its shape), so a row may part where both sides'
    two best tokens are the other's two best, within `tol` of each other; it is compared
    no further. The tokens compared."""
    compared = 0
    for g, w in zip(got, want, strict=True):
        g, w = g.outputs[0], w.outputs[0]
        for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)):
            mine, theirs = g.logprobs[i], w.logprobs[i]
            if a != b:
                assert set(mine) == set(theirs) == {a, b}, (i, mine, theirs)
                for lps in (mine, theirs):
                    assert abs(lps[a].logprob - lps[b].logprob) < tol, (i, mine, theirs)
                break
            assert abs(mine[a].logprob - theirs[b].logprob) < tol, (i, mine, theirs)
            compared += 1
        else:
            assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
    return compared


def _random_moe(config) -> DeepseekV3MoE:
    torch.manual_seed(0)
    moe = DeepseekV3MoE(config)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def _per_expert_checkpoint(moe: DeepseekV3MoE) -> dict[str, torch.Tensor]:
    """The layer's weights under the hub checkpoints' per-expert names."""
    inter = moe.experts.inter
    state = {
        "gate.weight": moe.gate.weight,
        "gate.e_score_correction_bias": moe.gate.e_score_correction_bias,
        "shared_experts.gate_proj.weight": moe.shared_experts.gate_up_proj.weight[:inter],
        "shared_experts.up_proj.weight": moe.shared_experts.gate_up_proj.weight[inter:],
        "shared_experts.down_proj.weight": moe.shared_experts.down_proj.weight,
    }
    for e in range(moe.experts.num_experts):
        state[f"experts.{e}.gate_proj.weight"] = moe.experts.gate_up_proj[e, :inter]
        state[f"experts.{e}.up_proj.weight"] = moe.experts.gate_up_proj[e, inter:]
        state[f"experts.{e}.down_proj.weight"] = moe.experts.down_proj[e]
    return state


def test_each_rank_holds_its_expert_block_and_the_partial_outputs_sum_to_the_moe():
    """Rank r of 2 holds experts [4r, 4r + 4) of 8 (loaded from per-expert names and from
    fused tensors alike), routes as the whole layer does, and its partial output (its
    experts' pairs, its half of the shared expert) plus the other rank's is the layer's
    output."""
    config = tiny_config(first_k_dense_replace=0, n_shared_experts=1)
    full = _random_moe(config)
    state = _per_expert_checkpoint(full)
    x = 0.5 * torch.randn(32, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = full(x)
        weights, ids = full.gate(x)
        assert ids.unique().numel() == 8  # every block has rows
        total = torch.zeros_like(want)
        for rank in range(2):
            block = slice(4 * rank, 4 * rank + 4)
            moe = DeepseekV3MoE(config, tp=TPGroup(rank, 2))
            for name, tensor in state.items():
                moe.load_weight(name, tensor)
            assert moe.experts.local_experts == range(4 * rank, 4 * rank + 4)
            assert moe.experts.shard_names("down_proj") == [f"{e}.down" for e in range(8)[block]]
            assert torch.equal(moe.experts.gate_up_proj, full.experts.gate_up_proj[block])
            assert torch.equal(moe.experts.down_proj, full.experts.down_proj[block])
            fused = DeepseekV3MoE(config, tp=TPGroup(rank, 2))
            fused.load_weight("experts.gate_up_proj", full.experts.gate_up_proj)
            fused.load_weight("experts.down_proj", full.experts.down_proj)
            assert torch.equal(fused.experts.gate_up_proj, moe.experts.gate_up_proj)
            assert torch.equal(fused.experts.down_proj, moe.experts.down_proj)
            w, i = moe.gate(x)
            assert torch.equal(w, weights) and torch.equal(i, ids)
            partial = moe.experts(x, w, i) + moe.shared_experts(x)
            assert (partial - want).abs().max() > 1e-2  # one rank alone is not the layer
            total += partial
    assert (total - want).abs().max() < 1e-5


def test_pairs_routed_outside_a_block_add_nothing():
    """Rows whose experts all sit in the other block come out zero; the rest equal the
    whole layer's sum over the block's pairs only."""
    g = torch.Generator().manual_seed(2)
    gate_up, down = torch.randn(8, 6, 5, generator=g), torch.randn(8, 5, 3, generator=g)
    x = torch.randn(3, 5, generator=g)
    ids = torch.tensor([[0, 1], [5, 6], [2, 7]])
    weights = torch.rand(3, 2, generator=g)
    whole = fused_experts(x, gate_up, down, weights, ids)
    block = fused_experts(x, gate_up[:4], down[:4], weights, ids, first_expert=0)
    other = fused_experts(x, gate_up[4:], down[4:], weights, ids, first_expert=4)
    assert torch.equal(block[1], torch.zeros(5)) and torch.equal(other[0], torch.zeros(5))
    only_2 = fused_experts(x[2:], gate_up, down, weights[2:, :1], ids[2:, :1])
    assert torch.allclose(block[2], only_2[0], atol=1e-6)
    assert torch.allclose(block + other, whole, atol=1e-6)


def test_what_does_not_split_is_refused_by_name(tmp_path, monkeypatch):
    config = tiny_config(first_k_dense_replace=0)
    with torch.device("meta"):
        DeepseekV3ForCausalLM(config, 64, TPGroup(1, 4))  # 4 heads, 8 experts: fine
        with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible .* 3"):
            DeepseekV3ForCausalLM(config, 64, TPGroup(0, 3))
        odd = tiny_config(first_k_dense_replace=0, n_routed_experts=6, n_group=2)
        with pytest.raises(ValueError, match=r"n_routed_experts=6 is not divisible .* 4"):
            DeepseekV3ForCausalLM(odd, 64, TPGroup(0, 4))
    check_tensor_parallel(SimpleNamespace(architectures=["KimiLinearForCausalLM"]), 2)
    # a class that does not declare tensor_parallel (every registered one does now)
    monkeypatch.setitem(registry._MODELS, "PlainForCausalLM", ("torch.nn", "Identity"))
    plain = SimpleNamespace(architectures=["PlainForCausalLM"])
    refusal = r"Identity does not support tensor_parallel_size=2 .*DeepseekV3.*KimiLinear"
    with pytest.raises(ValueError, match=refusal):
        check_tensor_parallel(plain, 2)
    with pytest.raises(ValueError, match=refusal):
        build_model(None, plain, torch.float32, torch.device("cpu"), 64, "dummy", tp=TPGroup(0, 2))
    check_tensor_parallel(plain, 1)

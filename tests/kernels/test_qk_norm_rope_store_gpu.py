"""qk_norm_rope_store compiled on a GPU at W1's shapes (Qwen3-0.6B: 16 query heads, 8 KV
heads, head_dim 128, bf16), against qk_norm_rope then store_kv bit for bit: a decode
batch, a prefill chunk, padding rows, bf16 and FP8 pages, in a CUDA graph; and an engine
whose layers take the one launch against the same engine with the two kernels in its
place (tokens and logprobs equal, decode graphs replayed)."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_model, tiny_config
from gpu_defaults import params_for, run_checked

from batchgen.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_store
from batchgen.kernels.store_kv import store_kv
from batchgen.kv_quant import FP8, to_cache
from batchgen.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.gpu

ENGINE_PAGES = 1024

HEADS, KV_HEADS, HEAD_DIM, PAGE, PAGES = 16, 8, 128, 16, 1200
MAX_POSITIONS = 40960
DEVICE = "cuda"


@pytest.fixture(scope="module")
def rotary():
    cfg = tiny_config("Qwen3ForCausalLM", head_dim=HEAD_DIM, max_position_embeddings=MAX_POSITIONS)
    rotary = RotaryEmbedding(cfg, HEAD_DIM, MAX_POSITIONS)
    rotary.materialize(torch.device(DEVICE))
    return rotary


def _inputs(t, cache_dtype, with_norm, gen):
    qkv = (4 * torch.randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen)).to(DEVICE)
    qkv.view(-1)[::997] = 1000.0  # past FP8's 448
    qkv = qkv.to(torch.bfloat16)
    positions = torch.randint(0, MAX_POSITIONS, (t,), generator=gen).to(DEVICE)
    slots = torch.randperm(PAGES * PAGE, generator=gen)[:t].to(DEVICE)
    slots[::5] = -1  # padding rows
    weights = [(1 + 0.3 * torch.randn(HEAD_DIM, generator=gen)).to(DEVICE, torch.bfloat16)]
    weights = weights * 2 if with_norm else [None, None]
    pool = torch.randn(2, PAGES, PAGE, KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    pool = to_cache(pool, FP8) if cache_dtype == FP8 else pool.to(cache_dtype)
    return qkv, positions, slots, weights, pool


def _two_kernels(rotary, qkv, positions, slots, weights, pool):
    args = (qkv, positions, rotary.cos, rotary.sin, HEADS, KV_HEADS)
    q, k = qk_norm_rope(*args, *weights, 1e-6)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(-1, KV_HEADS, HEAD_DIM)
    store_kv(pool[0], pool[1], k, v, slots)
    return q


def _fused(rotary, qkv, positions, slots, weights, pool):
    args = (qkv, positions, rotary.cos, rotary.sin, HEADS, KV_HEADS)
    return qk_norm_rope_store(*args, pool[0], pool[1], slots, *weights, 1e-6)


def _bytes(pool):
    return pool.view(torch.uint8) if pool.dtype == FP8 else pool


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("t", [256, 7, 8192])
def test_one_launch_writes_the_two_kernels_bytes(rotary, cache_dtype, with_norm, t):
    gen = torch.Generator().manual_seed(t)
    qkv, positions, slots, weights, pool = _inputs(t, cache_dtype, with_norm, gen)
    ref_pool = pool.clone()
    ref_q = _two_kernels(rotary, qkv, positions, slots, weights, ref_pool)
    q = _fused(rotary, qkv, positions, slots, weights, pool)
    assert torch.equal(q, ref_q), f"{(q != ref_q).sum().item()} q elements differ"
    assert torch.equal(_bytes(pool), _bytes(ref_pool))


def test_one_launch_replays_in_a_cuda_graph(rotary):
    """Captured once, replayed on new rows, positions and slots: the eager bytes."""
    gen = torch.Generator().manual_seed(1)
    t = 64
    qkv, positions, slots, weights, pool = _inputs(t, torch.bfloat16, True, gen)
    _fused(rotary, qkv, positions, slots, weights, pool)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _fused(rotary, qkv, positions, slots, weights, pool)
    new_qkv, new_positions, new_slots, _, _ = _inputs(t, torch.bfloat16, True, gen)
    for buf, new in ((qkv, new_qkv), (positions, new_positions), (slots, new_slots)):
        buf.copy_(new)
    ref_pool = pool.clone()
    graph.replay()
    want = _two_kernels(rotary, qkv, positions, slots, weights, ref_pool)
    assert torch.equal(captured, want) and torch.equal(pool, ref_pool)


def _engine_run(model_dir, prompts, params, mode):
    return run_checked(model_dir, prompts, params, mode, num_kv_pages=ENGINE_PAGES, max_num_seqs=16)


@pytest.mark.parametrize("mode", ["defaults", "greedy_logprobs"])
def test_engine_tokens_fused_as_unfused(tmp_path, monkeypatch, mode):
    save_tiny_model(tmp_path, "Qwen3ForCausalLM")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 40, 90, 3, 17)]
    params = params_for(mode, len(prompts))
    calls = []
    store = RotaryEmbedding.forward_qkv_store

    def counted(self, *args, **kwargs):
        calls.append(1)
        return store(self, *args, **kwargs)

    monkeypatch.setattr(RotaryEmbedding, "forward_qkv_store", counted)
    fused = _engine_run(tmp_path, prompts, params, mode)
    assert calls, "the engine's layers did not take the one launch"

    def two_kernels(self, positions, qkv, heads, kv_heads, pages, slots, q_norm, k_norm):
        q, k = self.forward_qkv(positions, qkv, heads, kv_heads, q_norm, k_norm)
        v = qkv[:, (heads + kv_heads) * self.head_dim :].view(-1, kv_heads, self.head_dim)
        store_kv(*pages, k, v, slots)
        return q

    monkeypatch.setattr(RotaryEmbedding, "forward_qkv_store", two_kernels)
    assert _engine_run(tmp_path, prompts, params, mode) == fused

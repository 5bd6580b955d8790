"""mla_rope_store compiled on a GPU at DeepSeek-V3's MLA shapes (16 local query heads,
nope 128, rope 64, latent rank 512, interleaved rope pairs, bf16), against
mla_rope_latent then store_latent bit for bit: a decode batch, a prefill chunk, padding
rows, bf16 and FP8 pages, in a CUDA graph; and an engine whose MLA layers take the one
launch against the same engine with the two launches in its place (tokens and logprobs
equal, decode graphs replayed)."""

from __future__ import annotations

import pytest
import torch
from deepseek_checkpoints import save_tiny_deepseek
from gpu_defaults import params_for, run_checked

from batchgen.kernels import mla_rope
from batchgen.kernels.mla_rope import mla_rope_latent, mla_rope_store
from batchgen.kernels.store_kv import store_latent
from batchgen.kv_quant import FP8, to_cache
from batchgen.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.gpu

ENGINE_PAGES = 512

HEADS, NOPE, ROPE, RANK, PAGE, PAGES = 16, 128, 64, 512, 64, 300
MAX_POSITIONS = 16384
DEVICE = "cuda"


class _Config:
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.fixture(scope="module")
def rotary():
    rotary = RotaryEmbedding(_Config(), ROPE, MAX_POSITIONS)
    rotary.materialize(torch.device(DEVICE))
    return rotary


def _inputs(t, cache_dtype, gen):
    dtype = torch.bfloat16
    q = (2 * torch.randn(t, HEADS, NOPE + ROPE, generator=gen)).to(DEVICE, dtype)
    kv = (2 * torch.randn(t, RANK + ROPE, generator=gen)).to(DEVICE, dtype)
    weight = (300 * (1 + 0.3 * torch.randn(RANK, generator=gen))).to(DEVICE, dtype)  # > 448
    positions = torch.randint(0, MAX_POSITIONS, (t,), generator=gen).to(DEVICE)
    slots = torch.randperm(PAGES * PAGE, generator=gen)[:t].to(DEVICE)
    slots[::5] = -1  # padding rows
    pool = torch.randn(PAGES, PAGE, 1, RANK + ROPE, generator=gen).to(DEVICE)
    pool = to_cache(pool, FP8) if cache_dtype == FP8 else pool.to(dtype)
    return q, kv, weight, positions, slots, pool


def _bytes(pool):
    return pool.view(torch.uint8) if pool.dtype == FP8 else pool


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("t", [256, 7, 4096])
def test_one_launch_writes_the_two_launches_bytes(rotary, cache_dtype, t):
    gen = torch.Generator().manual_seed(t)
    q, kv, weight, positions, slots, pool = _inputs(t, cache_dtype, gen)
    ref_q, ref_pool = q.clone(), pool.clone()
    args = (positions, rotary.cos, rotary.sin, weight, 1e-6, NOPE, True)
    store_latent(ref_pool, mla_rope_latent(ref_q, kv, *args), slots)
    mla_rope_store(q, kv, *args, pool, slots)
    assert torch.equal(q, ref_q), f"{(q != ref_q).sum().item()} q elements differ"
    assert torch.equal(_bytes(pool), _bytes(ref_pool))


def test_one_launch_replays_in_a_cuda_graph(rotary):
    gen = torch.Generator().manual_seed(1)
    q, kv, weight, positions, slots, pool = _inputs(64, FP8, gen)
    args = (rotary.cos, rotary.sin, weight, 1e-6, NOPE, True)
    mla_rope_store(q, kv, positions, *args, pool, slots)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_rope_store(q, kv, positions, *args, pool, slots)
    new_q, new_kv, _, new_positions, new_slots, _ = _inputs(64, FP8, gen)
    for buf, new in ((q, new_q), (kv, new_kv), (positions, new_positions), (slots, new_slots)):
        buf.copy_(new)
    ref_q, ref_pool = q.clone(), pool.clone()
    graph.replay()
    store_latent(ref_pool, mla_rope_latent(ref_q, kv, positions, *args), slots)
    assert torch.equal(q, ref_q) and torch.equal(_bytes(pool), _bytes(ref_pool))


def _engine_run(model_dir, prompts, params, mode):
    return run_checked(model_dir, prompts, params, mode, num_kv_pages=ENGINE_PAGES, max_num_seqs=16)


@pytest.mark.parametrize("mode", ["defaults", "greedy_logprobs"])
def test_engine_tokens_fused_as_unfused(tmp_path, monkeypatch, mode):
    save_tiny_deepseek(tmp_path)  # dense MLPs: graph-safe in bf16
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 40, 90, 3, 17)]
    params = params_for(mode, len(prompts))
    calls = []

    def counted(*args):
        calls.append(1)
        return mla_rope_store(*args)

    monkeypatch.setattr(mla_rope, "mla_rope_store", counted)
    fused = _engine_run(tmp_path, prompts, params, mode)
    assert calls, "the engine's MLA layers did not take the one launch"

    def two_launches(q, kv, *args):
        *rope_args, cache, slots = args
        store_latent(cache, mla_rope_latent(q, kv, *rope_args), slots)

    monkeypatch.setattr(mla_rope, "mla_rope_store", two_launches)
    assert _engine_run(tmp_path, prompts, params, mode) == fused

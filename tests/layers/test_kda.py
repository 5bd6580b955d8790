"""KDA layer: ours against transformers' KimiLinearDeltaAttention (same weights, fp32), and
our recurrent, chunked and packed computations against each other."""

from __future__ import annotations

import pytest
import torch
from kimi_checkpoints import random_kda_module as hf_layer
from kimi_checkpoints import run_kda_step as run_step
from kimi_checkpoints import transformers_torch_kda

from batchgen.forward_context import (
    LinearAttentionMetadata,
    LinearSeq,
)
from batchgen.kv.page_copies import device_to_host_state, host_to_device_state
from batchgen.kv.state_pool import HostStatePool, StateLayout, StatePool
from batchgen.layers import kda_torch
from batchgen.layers.kda import KimiDeltaAttention

kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def transformers_torch_path():
    """transformers binds fla-core's kernels in place of its torch KDA where fla-core is
    installed; the reference here is its torch code, on the CPU."""
    with transformers_torch_kda():
        yield


def tiny_config(**overrides):
    from transformers import KimiLinearConfig

    fields = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        linear_num_heads=2,
        linear_head_dim=8,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-5,
        hidden_act="silu",
    )
    return KimiLinearConfig(**{**fields, **overrides})


def our_layer(config, hf, chunk_size: int = 16) -> KimiDeltaAttention:
    layer = KimiDeltaAttention(config, layer_id=0, state_index=0, chunk_size=chunk_size)
    for name, tensor in hf.state_dict().items():
        layer.load_weight(name, tensor)
    return layer


def pool_for(layer: KimiDeltaAttention, num_slots: int = 4) -> StatePool:
    layout = StateLayout(
        num_layers=1,
        num_heads=layer.num_heads,
        head_k_dim=layer.head_dim,
        head_v_dim=layer.head_dim,
        conv_dim=layer.conv_dim,
        conv_kernel=layer.conv_kernel,
        conv_dtype=torch.float32,
    )
    return StatePool(layout, num_slots, "cpu")


def hf_prefill(hf, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(x.unsqueeze(0))[0]


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def setup():
    config = tiny_config()
    hf = hf_layer(config)
    return config, hf


@pytest.mark.parametrize("length", [1, 5, 16, 40])
def test_single_prompt_matches_transformers(setup, length):
    config, hf = setup
    ours = our_layer(config, hf, chunk_size=16)
    x = torch.randn(length, config.hidden_size)
    (out,) = run_step(ours, pool_for(ours), [(x, 0, False)])
    assert err(out, hf_prefill(hf, x)) < TOL


def test_prompt_across_fla_chunks_matches_transformers(setup):
    """Chunk size 64 as fla and transformers use, 150 tokens: three chunks, the last short."""
    config, hf = setup
    ours = our_layer(config, hf, chunk_size=64)
    x = torch.randn(150, config.hidden_size)
    (out,) = run_step(ours, pool_for(ours), [(x, 1, False)])
    assert err(out, hf_prefill(hf, x)) < TOL


@pytest.mark.parametrize("split", [3, 16, 21])
def test_chunked_prefill_carries_state(setup, split):
    config, hf = setup
    ours = our_layer(config, hf, chunk_size=16)
    pool = pool_for(ours)
    x = torch.randn(45, config.hidden_size)
    (first,) = run_step(ours, pool, [(x[:split], 2, False)])
    (second,) = run_step(ours, pool, [(x[split:], 2, True)])
    assert err(torch.cat([first, second]), hf_prefill(hf, x)) < TOL


def test_decode_after_prefill_matches_full_prefill(setup):
    config, hf = setup
    ours = our_layer(config, hf, chunk_size=16)
    pool = pool_for(ours)
    x = torch.randn(26, config.hidden_size)
    outs = run_step(ours, pool, [(x[:20], 3, False)])
    for t in range(20, 26):  # one token a step: the batched recurrent path
        outs += run_step(ours, pool, [(x[t : t + 1], 3, True)])
    assert err(torch.cat(outs), hf_prefill(hf, x)) < TOL


def test_packed_batch_of_requests(setup):
    """Several requests in one step, mixed prefill chunks and decodes, slots out of order;
    then a decode-only step over all of them."""
    config, hf = setup
    ours = our_layer(config, hf, chunk_size=16)
    pool = pool_for(ours, num_slots=6)
    lengths, slots = [37, 1, 12, 20], [5, 0, 3, 1]
    xs = [torch.randn(n + 1, config.hidden_size) for n in lengths]
    # request 3 already computed its first 8 tokens in an earlier step
    run_step(ours, pool, [(xs[3][:8], slots[3], False)])
    parts = [
        (xs[0][:37], 5, False),
        (xs[1][:1], 0, False),
        (xs[2][:12], 3, False),
        (xs[3][8:20], 1, True),
    ]
    step1 = run_step(ours, pool, parts)
    step2 = run_step(ours, pool, [(x[-1:], s, True) for x, s in zip(xs, slots)])
    for i, x in enumerate(xs):
        want = hf_prefill(hf, x)
        got = torch.cat([step1[i], step2[i]])
        assert err(got, want[-got.shape[0] :]) < TOL, f"request {i}"


def test_fresh_request_ignores_stale_slot(setup):
    """A slot released by one request and taken by another starts from zeros."""
    config, hf = setup
    ours = our_layer(config, hf, chunk_size=16)
    pool = pool_for(ours)
    run_step(ours, pool, [(torch.randn(9, config.hidden_size), 0, False)])
    x = torch.randn(6, config.hidden_size)
    (out,) = run_step(ours, pool, [(x, 0, False)])
    assert err(out, hf_prefill(hf, x)) < TOL


def test_state_swapped_out_and_in_continues_exactly(setup):
    """Prefill, move the slot to the host, let another request reuse the device slot,
    bring the state back into a different slot, decode: as if it never moved."""
    config, hf = setup
    ours = our_layer(config, hf, chunk_size=16)
    pool = pool_for(ours, num_slots=4)
    host = HostStatePool(pool.layout, 2, pin=False)
    x = torch.randn(24, config.hidden_size)
    outs = run_step(ours, pool, [(x[:20], 0, False)])
    device_to_host_state((pool.states, pool.windows), (host.states, host.windows), [0], [1])
    run_step(ours, pool, [(torch.randn(7, config.hidden_size), 0, False)])  # slot 0 reused
    host_to_device_state((host.states, host.windows), (pool.states, pool.windows), [1], [3])
    for t in range(20, 24):
        outs += run_step(ours, pool, [(x[t : t + 1], 3, True)])
    assert err(torch.cat(outs), hf_prefill(hf, x)) < TOL


def kda_recurrent_loop(q, k, v, g, beta, state):
    """One sequence token by token through kda_torch.kda_recurrent: q, k, g [T, H, Dk],
    v [T, H, Dv], beta [T, H], state [H, Dk, Dv] -> (o [T, H, Dv], final state). The
    definition kda_chunk must meet."""
    outs = []
    s = state.unsqueeze(0)
    for t in range(q.shape[0]):
        step = (x[t : t + 1] for x in (q, k, v, g, beta))
        o, s = kda_torch.kda_recurrent(*step, s)
        outs.append(o)
    return torch.cat(outs), s[0]


def random_kda_inputs(length: int, heads: int = 3, dk: int = 8, dv: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, heads, dk, generator=gen)
    k = torch.randn(length, heads, dk, generator=gen)
    v = torch.randn(length, heads, dv, generator=gen)
    g = -torch.rand(length, heads, dk, generator=gen) * 2  # log decay in (-2, 0]
    beta = torch.rand(length, heads, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("length,chunk", [(1, 4), (7, 4), (33, 8), (64, 64), (65, 16)])
def test_recurrent_equals_chunked(length, chunk):
    args = random_kda_inputs(length)
    o_rec, s_rec = kda_recurrent_loop(*args)
    o_chk, s_chk = kda_torch.kda_chunk(*args, chunk_size=chunk)
    assert err(o_rec, o_chk) < TOL
    assert err(s_rec, s_chk) < TOL


def test_recurrent_matches_transformers_recurrence():
    q, k, v, g, beta, state = random_kda_inputs(12)
    o, s = kda_recurrent_loop(q, k, v, g, beta, state)
    want_o, want_s = kimi.recurrent_kimi_delta_attention(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        state[None].clone(),
        True,
        use_qk_l2norm_in_kernel=True,
    )
    assert err(o, want_o[0]) < TOL
    assert err(s, want_s[0]) < TOL


def test_gate_matches_transformers(setup):
    config, hf = setup
    ours = our_layer(config, hf)
    x = torch.randn(5, config.hidden_size)
    with torch.no_grad():
        want = hf.forget_gate(x[None])[0]
        f_a = ours.in_proj(x)[:, ours.in_proj.shards["f_a"][0] : ours.in_proj.shards["f_a"][1]]
        f = ours.f_b_proj(f_a).view(5, ours.num_heads, ours.head_dim)
        got = kda_torch.kda_gate(f, ours.A_log, ours.dt_bias)
    assert err(got, want) < TOL


def test_loads_moonshot_checkpoint_names(setup):
    """The Hub checkpoint's names: separate q/k/v conv weights, gate weights unnested."""
    config, hf = setup
    ours = our_layer(config, hf)
    other = KimiDeltaAttention(config, layer_id=0, state_index=0)
    sd = hf.state_dict()
    width = ours.proj_dim
    for name, tensor in sd.items():
        if name == "conv1d.weight":
            for i, part in enumerate("qkv"):
                other.load_weight(f"{part}_conv1d.weight", tensor[i * width : (i + 1) * width])
        else:
            other.load_weight(name.removeprefix("forget_gate."), tensor)
    for (name, a), (_, b) in zip(ours.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(KeyError):
        other.checkpoint_target("q_norm.weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_short_conv_equals_request_by_request(dtype):
    """A mixed step (prefill chunks shorter and longer than the window, single rows, fresh
    and continuing requests, slots out of order): the packed convolution gives the same
    rows as the per-request reference up to an ulp (SiLU's vectorised and scalar loops
    split the rows differently, by CPU), and leaves the same windows, bit for bit."""
    g = torch.Generator().manual_seed(0)
    taps, channels, num_slots = 4, 24, 9
    lengths, slots = [5, 1, 2, 1, 17, 3, 1], [7, 0, 3, 5, 1, 8, 2]
    seqs, start = [], 0
    for n, slot in zip(lengths, slots):
        seqs.append(LinearSeq(q_start=start, q_len=n, slot=slot, has_state=True))
        start += n
    x = torch.randn(start, channels, generator=g).to(dtype)
    weight = torch.randn(channels, taps, generator=g)
    windows = torch.randn(num_slots, taps - 1, channels, generator=g).to(dtype)
    meta = LinearAttentionMetadata.build(seqs, "cpu")

    ref_windows, ref_windows_before = windows.clone(), windows.clone()
    ref = kda_torch.short_conv(x, weight, ref_windows, seqs)
    out = kda_torch.short_conv_packed(x, weight, windows, meta.cu_seqlens, meta.state_slots)
    assert out.dtype == dtype
    ulp = torch.finfo(dtype).eps * ref.abs().clamp(min=1.0)
    assert ((out.float() - ref.float()).abs() <= ulp).all()
    assert torch.equal(windows, ref_windows)
    # and the windows did move: the 17-row request (rows 9..25, slot 1) keeps rows 23..25;
    # the 2-row one (slot 3) its old window's last row, then its two rows
    assert torch.equal(windows[1], x[23:26])
    assert torch.equal(windows[3], torch.cat([ref_windows_before[3][-1:], x[6:8]]))


def test_conv_taps_stay_plain_when_the_projections_quantize():
    """quantization="fp8" quantizes every quantizable Linear; the depthwise conv taps
    are read as a matrix by the short convolution and must stay in the model's dtype
    (heads of 128 so that every stacked shard starts on a 128-row block)."""
    from batchgen.models import fp8

    config = tiny_config(linear_num_heads=2, linear_head_dim=128, hidden_size=256)
    with torch.device("meta"):
        layer = KimiDeltaAttention(config, layer_id=0, state_index=0)
    assert fp8.quantize_linears(layer) >= 3
    assert layer.o_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.conv1d.quant is None and layer.conv1d.weight.dtype == torch.float32

"""KDA on a GPU: fla-core's kernels (kda_ops on CUDA) against the torch reference on the
same slots, mixed prefill + decode steps in float32 and bfloat16, and the decode step
replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from batchgen.forward_context import LinearAttentionMetadata, LinearSeq
from batchgen.layers import kda_ops, kda_torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if kda_ops.fla_kda() is None:
    pytest.skip("fla-core is not installed", allow_module_level=True)

# tests/models/test_kimi_linear_gpu.py builds its models with these KDA heads: fla-core
# keys its kernels' autotuning on them, so that file reuses what this one tuned
H, DK, DV, SLOTS = 4, 128, 128, 8
TOL = {torch.float32: 5e-3, torch.bfloat16: 5e-2}  # fla dots run in tf32 / bf16


def step_inputs(rows: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    g = -torch.rand(rows, H, DK, device="cuda", generator=gen) * 0.5
    beta = torch.rand(rows, H, device="cuda", generator=gen).to(dtype)
    return (
        randn(rows, H, DK).to(dtype),
        randn(rows, H, DK).to(dtype),
        randn(rows, H, DV).to(dtype),
        g,
        beta,
    )


def meta_for(parts: list[tuple[int, int, bool]]) -> LinearAttentionMetadata:
    seqs, row = [], 0
    for n, slot, has_state in parts:
        seqs.append(LinearSeq(q_start=row, q_len=n, slot=slot, has_state=has_state))
        row += n
    return LinearAttentionMetadata.build(seqs, "cuda")


def both(args, meta, states_fla, states_ref, raw=None, decode_kernel="batchgen"):
    """fla's step and the torch step on the same inputs; with `raw`, g and beta are the
    raw projections (the gates computed in fla's kernels, by kda_torch for the reference)."""
    for states in (states_fla, states_ref):
        states.index_fill_(0, meta.fresh_slots, 0.0)
    got = kda_ops.kda_attention(*args, states_fla, meta, raw=raw, decode_kernel=decode_kernel)
    q, k, v, g, beta = args
    if raw is not None:
        g, beta = kda_torch.kda_gate(g, raw.a_log, raw.dt_bias), torch.sigmoid(beta)
    want = kda_ops.kda_attention_torch(q, k, v, g, beta, states_ref, meta)
    return got, want


def raw_gates(seed: int) -> kda_ops.RawGates:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a_log = torch.randn(1, 1, H, 1, device="cuda", generator=gen) * 0.5
    return kda_ops.RawGates(a_log, torch.randn(H * DK, device="cuda", generator=gen))


# (gates, the one-token rows' kernel): raw gates are the layer's default call;
# kernels/kda_decode.py ("batchgen") takes raw gates only, fla-core's kernel either
KERNELS = [("raw", "fla"), ("given", "fla"), ("raw", "batchgen")]


# float32 is marked slow: fla-core autotunes (compiles) its kernels again per dtype, ~100 s
# of device time on an H200; bf16 is what the engine runs on the GPU by default
@pytest.mark.parametrize(
    "dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16]
)
@pytest.mark.parametrize("gates,decode_kernel", KERNELS)
def test_fla_matches_reference_over_steps(dtype, gates, decode_kernel):
    raw = raw_gates(9) if gates == "raw" else None
    states_fla = torch.randn(SLOTS, H, DK, DV, device="cuda") * 0.1
    states_ref = states_fla.clone()
    # step 1: three prompts (one crossing 64-token chunks), slots out of order
    prefill = meta_for([(150, 5, False), (7, 1, False), (64, 3, False)])
    got, want = both(
        step_inputs(221, dtype, 0), prefill, states_fla, states_ref, raw, decode_kernel
    )
    assert (got.float() - want.float()).abs().max().item() < TOL[dtype]
    # step 2: a continued prefill chunk between two decodes (their rows gathered)
    mixed = meta_for([(1, 5, True), (33, 1, True), (1, 3, True)])
    got, want = both(step_inputs(35, dtype, 1), mixed, states_fla, states_ref, raw, decode_kernel)
    assert (got.float() - want.float()).abs().max().item() < TOL[dtype]
    # step 2b: the usual layout, decodes ahead of the chunk (the kernels take views)
    mixed = meta_for([(1, 5, True), (1, 3, True), (20, 1, True)])
    got, want = both(step_inputs(22, dtype, 4), mixed, states_fla, states_ref, raw, decode_kernel)
    assert (got.float() - want.float()).abs().max().item() < TOL[dtype]
    # step 3: decode only (the in-place recurrent kernel)
    decode = meta_for([(1, 3, True), (1, 5, True), (1, 1, True)])
    got, want = both(step_inputs(3, dtype, 2), decode, states_fla, states_ref, raw, decode_kernel)
    assert (got.float() - want.float()).abs().max().item() < TOL[dtype]
    assert (states_fla - states_ref).abs().max().item() < TOL[dtype]
    untouched = [0, 2, 4, 6, 7]
    assert torch.equal(states_fla[untouched], states_ref[untouched])


@pytest.mark.parametrize("prepared", [True, False])
@pytest.mark.parametrize(
    "parts",
    [
        [(150, 5, False), (7, 1, False)],
        [(1, 5, True), (33, 1, True)],
        [(1, 5, True), (33, 1, True), (1, 3, True)],
    ],
    ids=["prefill", "mixed-blocks", "mixed-interleaved"],
)
def test_a_prepared_step_queues_its_kda_without_a_host_sync(parts, prepared):
    """`prepare_step` (called by the runner's linear_metadata) makes fla's chunk index
    before the forward, uploaded from pinned memory: neither it nor the layer then waits
    for the GPU, so a step can be prepared and queued behind one in flight. Unprepared,
    fla's pageable copy of that index synchronises inside the layer: the check below
    must catch it there (else it proves nothing of the prepared case)."""
    raw = raw_gates(4)
    states = torch.randn(SLOTS, H, DK, DV, device="cuda") * 0.1
    rows = sum(n for n, _, _ in parts)
    args = step_inputs(rows, torch.bfloat16, 5)
    kda_ops.kda_attention(*args, states, meta_for(parts), raw=raw)  # autotuning syncs: outside
    meta = meta_for(parts)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        if prepared:
            kda_ops.prepare_step(meta)
            kda_ops.kda_attention(*args, states, meta, raw=raw)
        else:
            with pytest.raises(RuntimeError, match="synchroniz"):
                kda_ops.kda_attention(*args, states, meta, raw=raw)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("gates,decode_kernel", KERNELS)
def test_decode_step_replays_from_a_cuda_graph(gates, decode_kernel):
    raw = raw_gates(2) if gates == "raw" else None
    states = torch.randn(SLOTS, H, DK, DV, device="cuda") * 0.1
    meta = meta_for([(1, 6, True), (1, 2, True)])
    q, k, v, g, beta = step_inputs(2, torch.bfloat16, 3)
    eager_states = states.clone()
    want = kda_ops.kda_attention(
        q, k, v, g, beta, eager_states, meta, raw=raw, decode_kernel=decode_kernel
    )
    graph_states = states.clone()
    compile_states = graph_states.clone()  # a first call compiles, outside the capture
    kda_ops.kda_attention(
        q, k, v, g, beta, compile_states, meta, raw=raw, decode_kernel=decode_kernel
    )
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kda_ops.kda_attention(
            q, k, v, g, beta, graph_states, meta, raw=raw, decode_kernel=decode_kernel
        )
    graph_states.copy_(states)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert torch.equal(graph_states, eager_states)


def test_prefill_conv_and_output_norm_match_torch_in_bf16():
    """A prefill step's short convolution (kernels/conv_packed.py) and the gated output
    norm (fla's rms_norm_gated) on CUDA against the torch code on the same tensors; q, k
    and v contiguous, the conv window of every slot the step holds moves on alike, the
    others stay."""
    if kda_ops.fla_norm() is None:
        pytest.skip("this fla-core has no rms_norm_gated")
    gen = torch.Generator(device="cuda").manual_seed(11)
    channels, taps = 3 * H * DK, 4
    meta = meta_for([(150, 5, True), (1, 1, True), (2, 3, True), (64, 6, False)])
    x = torch.randn(217, channels, device="cuda", generator=gen).to(torch.bfloat16)
    weight = torch.randn(channels, taps, device="cuda", generator=gen).to(torch.bfloat16)
    windows = torch.randn(SLOTS, taps - 1, channels, device="cuda", generator=gen)
    windows = windows.to(torch.bfloat16)
    windows.index_fill_(0, meta.fresh_slots, 0.0)
    want_windows = windows.clone()
    want = kda_torch.short_conv_packed(x, weight, want_windows, meta.cu_seqlens, meta.state_slots)
    qkv = kda_ops.short_conv(x, weight, windows, meta)
    assert all(t.is_contiguous() for t in qkv)
    got = torch.cat(qkv, dim=-1)
    # the torch code sums the taps in bfloat16, the kernel in float32
    assert (got.float() - want.float()).abs().max().item() < 0.1
    assert torch.equal(windows, want_windows)
    o = torch.randn(217, H, DV, device="cuda", generator=gen).to(torch.bfloat16)
    gate = torch.randn(217, H, DV, device="cuda", generator=gen).to(torch.bfloat16)
    norm_weight = torch.rand(DV, device="cuda", generator=gen).to(torch.bfloat16)
    want = kda_torch.gated_rms_norm(o, norm_weight, gate, 1e-5)
    got = kda_ops.output_norm(o, norm_weight, gate, 1e-5)
    assert (got.float() - want.float()).abs().max().item() < TOL[torch.bfloat16]


def test_decode_conv_replays_from_a_cuda_graph_as_the_torch_step():
    """A decode-only step's short convolution (kernels/conv_decode.py through
    kda_ops.short_conv) captured in a CUDA graph and replayed twice, against the torch
    decode step run twice on the same windows: q, k and v within bf16 rounding (the
    kernel sums the taps in float32, the torch code in bfloat16), contiguous, and the
    windows moved on bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(12)
    channels, taps = 3 * H * DK, 4
    meta = meta_for([(1, 6, True), (1, 2, True), (1, 4, True)])
    weight = torch.randn(channels, taps, device="cuda", generator=gen).to(torch.bfloat16)
    windows = torch.randn(SLOTS, taps - 1, channels, device="cuda", generator=gen)
    windows = windows.to(torch.bfloat16)
    xs = [torch.randn(3, channels, device="cuda", generator=gen).to(torch.bfloat16)]
    xs.append(torch.randn(3, channels, device="cuda", generator=gen).to(torch.bfloat16))
    want_windows, wants = windows.clone(), []
    for x in xs:
        wants.append(kda_torch.short_conv_decode(x, weight, want_windows, meta.state_slots))
    start = windows.clone()
    x_in = xs[0].clone()
    kda_ops.short_conv(x_in, weight, windows, meta)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, k, v = kda_ops.short_conv(x_in, weight, windows, meta)
    windows.copy_(start)
    for x, want in zip(xs, wants):
        x_in.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert all(t.is_contiguous() for t in (q, k, v))
        got = torch.cat([q, k, v], dim=-1)
        assert (got.float() - want.float()).abs().max().item() < 0.1
    assert torch.equal(windows, want_windows)

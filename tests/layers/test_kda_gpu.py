"""KDA on a GPU: fla-core's kernels (kda_ops on CUDA) against the torch reference on the
same slots, mixed prefill + decode steps in float32 and bfloat16, and the decode step
replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from batchgen.forward_context import LinearAttentionMetadata, LinearSeq
from batchgen.layers import kda_ops

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if kda_ops.fla_kda() is None:
    pytest.skip("fla-core is not installed", allow_module_level=True)

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


def both(args, meta, states_fla, states_ref):
    for states in (states_fla, states_ref):
        states.index_fill_(0, meta.fresh_slots, 0.0)
    got = kda_ops.kda_attention(*args, states_fla, meta)
    want = kda_ops.kda_attention_torch(*args, states_ref, meta)
    return got, want


# float32 is marked slow: fla-core autotunes (compiles) its kernels again per dtype, ~100 s
# of device time on an H200; bf16 is what the engine runs on the GPU by default
@pytest.mark.parametrize(
    "dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16]
)
def test_fla_matches_reference_over_steps(dtype):
    states_fla = torch.randn(SLOTS, H, DK, DV, device="cuda") * 0.1
    states_ref = states_fla.clone()
    # step 1: three prompts (one crossing 64-token chunks), slots out of order
    prefill = meta_for([(150, 5, False), (7, 1, False), (64, 3, False)])
    got, want = both(step_inputs(221, dtype, 0), prefill, states_fla, states_ref)
    assert (got.float() - want.float()).abs().max().item() < TOL[dtype]
    # step 2: a continued prefill chunk beside two decodes
    mixed = meta_for([(1, 5, True), (33, 1, True), (1, 3, True)])
    got, want = both(step_inputs(35, dtype, 1), mixed, states_fla, states_ref)
    assert (got.float() - want.float()).abs().max().item() < TOL[dtype]
    # step 3: decode only (the in-place recurrent kernel)
    decode = meta_for([(1, 3, True), (1, 5, True), (1, 1, True)])
    got, want = both(step_inputs(3, dtype, 2), decode, states_fla, states_ref)
    assert (got.float() - want.float()).abs().max().item() < TOL[dtype]
    assert (states_fla - states_ref).abs().max().item() < TOL[dtype]
    untouched = [0, 2, 4, 6, 7]
    assert torch.equal(states_fla[untouched], states_ref[untouched])


def test_decode_step_replays_from_a_cuda_graph():
    states = torch.randn(SLOTS, H, DK, DV, device="cuda") * 0.1
    meta = meta_for([(1, 6, True), (1, 2, True)])
    q, k, v, g, beta = step_inputs(2, torch.bfloat16, 3)
    eager_states = states.clone()
    want = kda_ops.kda_attention(q, k, v, g, beta, eager_states, meta)
    graph_states = states.clone()
    kda_ops.kda_attention(q, k, v, g, beta, graph_states.clone(), meta)  # compile outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kda_ops.kda_attention(q, k, v, g, beta, graph_states, meta)
    graph_states.copy_(states)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert torch.equal(graph_states, eager_states)

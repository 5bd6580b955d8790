"""fla-core's recurrent KDA kernel under the Triton interpreter against our torch reference.

Runs where fla-core is installed (skipped otherwise). On the CPU only the recurrent kernel
runs: fla-core 0.6's chunk kernels index with a loop counter the interpreter hands over as
a Python int (`i_t.to(...)` fails), so the chunked path is covered by GPU tests only.
"""

from __future__ import annotations

import os

import pytest
import torch

from batchgen.forward_context import LinearAttentionMetadata, LinearSeq
from batchgen.layers import kda_ops, kda_torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

fla_kda = pytest.importorskip("fla.ops.kda")

TOL = 1e-5


def inputs(rows: int, heads: int = 2, dk: int = 16, dv: int = 16, seed: int = 0):
    """q, k, v as views of one packed row each, as the layer's conv output hands them."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, heads * (2 * dk + dv), generator=gen)
    q, k, v = qkv.split([heads * dk, heads * dk, heads * dv], dim=-1)
    q, k, v = q.view(rows, heads, dk), k.view(rows, heads, dk), v.view(rows, heads, dv)
    g = -torch.rand(rows, heads, dk, generator=gen)
    beta = torch.rand(rows, heads, generator=gen)
    return q, k, v, g, beta


def test_decode_step_in_place_on_slots():
    """Our CUDA decode call (slots read and written in place through ssm_state_indices)
    against the torch decode step, slots out of order and one slot left alone."""
    q, k, v, g, beta = inputs(3)
    states = torch.randn(5, 2, 16, 16, generator=torch.Generator().manual_seed(1))
    seqs = [LinearSeq(q_start=i, q_len=1, slot=s, has_state=True) for i, s in enumerate([4, 0, 2])]
    meta = LinearAttentionMetadata.build(seqs, "cpu")
    want_states = states.clone()
    want = kda_ops.kda_attention_torch(q, k, v, g, beta, want_states, meta)
    got = kda_ops._kda_fla(q, k, v, g, beta, states, meta)
    assert (got - want).abs().max().item() < TOL
    assert (states - want_states).abs().max().item() < TOL
    assert torch.equal(states[[1, 3]], want_states[[1, 3]])


def test_recurrent_varlen_from_initial_states():
    """fused_recurrent_kda over packed sequences with initial states against kda_chunk."""
    lengths = [5, 1, 9]
    q, k, v, g, beta = inputs(sum(lengths), seed=2)
    init = torch.randn(3, 2, 16, 16, generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, 5, 6, 15])
    o, final = fla_kda.fused_recurrent_kda(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        initial_state=init,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu,
    )
    for i in range(3):
        rows = slice(cu[i].item(), cu[i + 1].item())
        want_o, want_s = kda_torch.kda_chunk(
            q[rows], k[rows], v[rows], g[rows], beta[rows], init[i], chunk_size=4
        )
        assert (o[0, rows] - want_o).abs().max().item() < TOL
        assert (final[i] - want_s).abs().max().item() < TOL

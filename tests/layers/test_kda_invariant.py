"""layers/kda_invariant.py: in batch-invariant mode every autotuned fla-core kernel of the
KDA path launches with one pinned config, whatever its key, and outside it the tuner
runs as before; a piece of 64k + 1 tokens gives its last token to the recurrent step.

On the CPU the kernel runs in Triton's interpreter (tests/conftest.py sets it), where
fla's own tuner cannot benchmark: its timings are faked here.
"""

from __future__ import annotations

import random

import pytest
import torch
import triton
from fla.modules.norm import l2norm

from batchgen.forward_context import LinearAttentionMetadata, LinearSeq
from batchgen.layers import batch_invariant, kda_invariant, kda_ops

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# the kernels chunk_kda's forward, l2norm_fwd and rms_norm_gated launch, all autotuned
FORWARD_PATH = {
    "l2norm_fwd_kernel",
    "layer_norm_gated_fwd_kernel",
    "kda_gate_chunk_cumsum_vector_kernel",
    "chunk_local_cumsum_vector_kernel",
    "chunk_kda_fwd_kernel_intra_token_parallel",
    "chunk_kda_fwd_kernel_inter_solve_fused",
    "recompute_w_u_fwd_kda_kernel",
    "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
    "chunk_gla_fwd_kernel_o",
}


def _tuner(kernel):
    while not hasattr(kernel, "configs"):
        kernel = kernel.fn
    return kernel


def test_fla_import_pins_every_autotuned_kernel_of_the_path():
    assert kda_ops.fla_kda() is not None
    pinned = {t.base_fn.__name__: t for t in kda_invariant.pin_autotuners()}
    assert FORWARD_PATH <= set(pinned)
    for name in FORWARD_PATH:
        assert isinstance(pinned[name].run.pinned, triton.Config), name
    assert _tuner(l2norm.l2norm_fwd_kernel).run.pinned.kwargs == {"BT": 8}


def test_the_pinned_config_depends_on_the_list_alone():
    configs = [
        triton.Config({"BT": 64, "BK": 32}, num_warps=8),
        triton.Config({"BT": 16, "BK": 32}, num_warps=8),
        triton.Config({"BT": 16, "BK": 32}, num_warps=4, num_stages=3),
        triton.Config({"BT": 16, "BK": 32}, num_warps=4, num_stages=2),
        triton.Config({"BT": 16, "BK": 32}, num_warps=2, num_stages=2),
        triton.Config({"BT": 16, "BK": 64}, num_warps=4, num_stages=1),
    ]
    want = configs[3]  # the smallest tiles, then 4 warps, then the fewest stages
    for seed in range(5):
        shuffled = configs[:]
        random.Random(seed).shuffle(shuffled)
        assert kda_invariant.pinned_config(shuffled) is want


def test_invariant_mode_launches_the_pinned_config_and_no_tuning(monkeypatch):
    """Inside the mode: one launch with the pinned config, nothing benchmarked or cached.
    Outside: fla's tuner benchmarks (timings faked to favour BT 64 with 8 warps) and
    launches its pick."""
    kda_invariant.pin_autotuners()
    tuner = _tuner(l2norm.l2norm_fwd_kernel)
    launches, benched = [], []
    launch = tuner.fn.run

    def spy(*args, **kwargs):
        launches.append((kwargs["BT"], kwargs["num_warps"]))
        return launch(*args, **kwargs)

    def fake_bench(*args, config, **kwargs):
        benched.append(config)
        best = config.kwargs["BT"] == 64 and config.num_warps == 8
        return [1.0 if best else 2.0] * 3

    monkeypatch.setattr(tuner.fn, "run", spy)
    monkeypatch.setattr(tuner, "_bench", fake_bench)
    monkeypatch.setattr(tuner, "cache", {})
    monkeypatch.setattr(tuner, "cache_results", False)  # no decision read from disk
    x = torch.randn(5, 2, 16, device=DEVICE)
    with batch_invariant.invariant_mode(True):
        y, _ = l2norm.l2norm_fwd(x)
    assert launches == [(8, 4)] and benched == [] and tuner.cache == {}
    launches.clear()
    plain, _ = l2norm.l2norm_fwd(x)
    assert len(benched) == len(tuner.configs) and launches == [(64, 8)]
    assert len(tuner.cache) == 1
    torch.testing.assert_close(y, plain)
    torch.testing.assert_close(y, x / x.norm(dim=-1, keepdim=True), rtol=1e-5, atol=1e-5)


def _meta(lengths):
    seqs, start = [], 0
    for i, n in enumerate(lengths):
        seqs.append(LinearSeq(q_start=start, q_len=n, slot=10 + i, has_state=i % 2 == 0))
        start += n
    return LinearAttentionMetadata.build(seqs, "cpu")


def test_a_piece_of_64k_plus_one_tokens_steps_its_last_alone():
    meta = _meta([1, 65, 10, 1, 129])
    seeded = []
    split = kda_invariant.tail_split(meta, lambda cu, host: seeded.append(host.tolist()))
    # the recurrent step: both decode rows and the last rows of the 65 and 129 pieces
    assert split.step_rows.tolist() == [0, 65, 76, 205]
    assert split.step_slots.tolist() == [10, 11, 13, 14]
    assert split.step_cu.tolist() == [0, 1, 2, 3, 4]
    # the chunked kernel: every other row of the longer pieces, in order
    want = list(range(1, 65)) + list(range(66, 76)) + list(range(77, 205))
    assert split.chunk_rows.tolist() == want
    assert split.chunk_slots.tolist() == [11, 12, 14]
    assert split.chunk_cu.tolist() == split.chunk_cu_host.tolist() == [0, 64, 74, 202]
    assert seeded == [[0, 64, 74, 202]]
    assert kda_invariant.tail_split(_meta([1, 64, 10, 2, 130])) is None


def test_the_step_split_takes_the_tails_in_invariant_mode_only():
    meta = _meta([1, 65, 10])
    outside = kda_ops._step_split(meta)
    assert outside.decode_rows == slice(0, 1) and outside.prefill_rows == slice(1, 76)
    with batch_invariant.invariant_mode(True):
        inside = kda_ops._step_split(_meta([1, 65, 10]))
    assert inside.decode_rows.tolist() == [0, 65]
    assert inside.prefill_cu.tolist() == [0, 64, 74]


@pytest.mark.parametrize("lengths", [[1, 64, 3], [1, 1, 2], [2, 1, 128]])
def test_without_a_64k_plus_one_piece_the_usual_split_serves(lengths):
    meta = _meta(lengths)
    with batch_invariant.invariant_mode(True):
        split = kda_ops._step_split(meta)
    assert meta.derived["tails"] is None
    assert split.decode_slots.tolist() == [s.slot for s in meta.seqs if s.q_len == 1]


def test_a_tail_steps_after_its_chunks_from_their_state(monkeypatch):
    """In invariant mode a mixed step with pieces of 65 and 129 tokens: the chunked call
    takes 64 and 128 of their rows (and a 10-token prompt whole), then one recurrent call
    takes the decode rows and the two last rows, from the states the chunks left. The
    chunked kernel cannot run in the interpreter: its stand-in is fla's varlen recurrent
    KDA (as in tests/layers/test_kda_fla_interpret.py). Outputs and every slot against
    the torch step."""
    from fla.ops import kda as fla_ops

    calls = []

    def chunked(q, *args, cu_seqlens=None, **kwargs):
        calls.append(("chunked", q.shape[1], cu_seqlens.tolist()))
        kwargs.pop("cu_seqlens_cpu")
        return fla_ops.fused_recurrent_kda(q, *args, cu_seqlens=cu_seqlens, **kwargs)

    def recurrent(q, *args, ssm_state_indices=None, **kwargs):
        calls.append(("recurrent", q.shape[1], ssm_state_indices.tolist()))
        return step(q, *args, ssm_state_indices=ssm_state_indices, **kwargs)

    _, step = kda_ops.fla_kda()
    monkeypatch.setattr(kda_ops, "fla_kda", lambda: (chunked, recurrent))
    parts = [(1, 6, True), (65, 1, True), (10, 3, False), (129, 4, False), (1, 2, True)]
    seqs, row = [], 0
    for n, slot, has_state in parts:
        seqs.append(LinearSeq(q_start=row, q_len=n, slot=slot, has_state=has_state))
        row += n
    meta = LinearAttentionMetadata.build(seqs, DEVICE)
    gen = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(row, 2, 16, generator=gen).to(DEVICE) for _ in range(3))
    g = -torch.rand(row, 2, 16, generator=gen).to(DEVICE)
    beta = torch.rand(row, 2, generator=gen).to(DEVICE)
    states = torch.randn(8, 2, 16, 16, generator=gen).to(DEVICE)
    states.index_fill_(0, meta.fresh_slots, 0.0)
    want_states = states.clone()
    want = kda_ops.kda_attention_torch(q, k, v, g, beta, want_states, meta)
    with batch_invariant.invariant_mode(True):
        got = kda_ops._kda_fla(q, k, v, g, beta, states, meta, decode_kernel="fla")
    assert calls == [("chunked", 202, [0, 64, 74, 202]), ("recurrent", 4, [6, 1, 4, 2])]
    tol = 1e-4 if DEVICE.type == "cpu" else 5e-3  # fla's dots in tf32 on the GPU
    assert (got - want).abs().max().item() < tol
    assert (states - want_states).abs().max().item() < tol
    assert torch.equal(states[[0, 5, 7]], want_states[[0, 5, 7]])

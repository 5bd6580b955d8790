"""fla-core's kernels as kda_ops calls them, under the Triton interpreter, against our
torch reference: the recurrent KDA step (gates given or computed in the kernel) and the
gated output norm.

fla-core is a dependency of the package, imported plainly. On the CPU the chunked KDA kernels
do not run: fla-core 0.6's chunk kernels index with a loop counter the interpreter hands over as
a Python int (`i_t.to(...)` fails), so the chunked path is covered by GPU tests only.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from fla.ops import kda as fla_kda

from batchgen.forward_context import LinearAttentionMetadata, LinearSeq
from batchgen.layers import kda_ops, kda_torch

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


@contextlib.contextmanager
def one_config(*modules):
    """While entered, each autotuned kernel of `modules` has one config: the interpreter
    cannot time candidates (the tuner asks for a GPU driver), and one config never
    times. Each list is put back on exit, so later tests (on a GPU, the tuner's own
    choice) meet the kernels as fla-core made them."""
    cut = []
    for module in modules:
        for name in dir(module):
            kernel = getattr(module, name)
            while kernel is not None and not hasattr(kernel, "configs") and hasattr(kernel, "fn"):
                kernel = kernel.fn
            configs = getattr(kernel, "configs", None)
            if isinstance(configs, list) and len(configs) > 1:
                cut.append((kernel, configs))
                kernel.configs = configs[:1]
    try:
        yield
    finally:
        for kernel, configs in cut:
            kernel.configs = configs


def test_one_config_puts_each_list_back():
    from fla.modules.norm import fused_norm_gate

    tuner = fused_norm_gate.layer_norm_gated_fwd_kernel
    while not hasattr(tuner, "configs"):
        tuner = tuner.fn
    before = tuner.configs
    assert len(before) > 1
    with one_config(fused_norm_gate):
        assert tuner.configs == before[:1]
    assert tuner.configs is before
    with pytest.raises(RuntimeError), one_config(fused_norm_gate):
        raise RuntimeError("a failing test")
    assert tuner.configs is before


@pytest.fixture
def fla_norm():
    norm = kda_ops.fla_norm()
    if norm is None:
        pytest.skip("this fla-core has no rms_norm_gated")
    from fla.modules.norm import fused_norm_gate

    with contextlib.ExitStack() as stack:
        if os.environ.get("TRITON_INTERPRET") == "1":
            stack.enter_context(one_config(fused_norm_gate))
        yield norm


def test_gated_output_norm_matches_the_torch_norm(fla_norm):
    norm = fla_norm
    gen = torch.Generator().manual_seed(5)
    o, gate = torch.randn(7, 2, 16, generator=gen), torch.randn(7, 2, 16, generator=gen)
    weight = torch.randn(16, generator=gen)
    want = kda_torch.gated_rms_norm(o, weight, gate, 1e-5)
    got = norm(
        o.reshape(-1, 16), gate.reshape(-1, 16), weight, None, activation="sigmoid", eps=1e-5
    )
    assert (got.view(o.shape) - want).abs().max().item() < TOL


@pytest.mark.parametrize("kernel", ["batchgen", "fla"])
def test_decode_step_with_raw_gates_computes_them_in_the_kernel(kernel):
    """The decode call with g and beta handed over raw (the gate and the sigmoid inside
    the kernel: kernels/kda_decode.py, the default, or fla's) against the torch step
    given kda_gate(f) and sigmoid(b)."""
    q, k, v, _, _ = inputs(3, seed=6)
    gen = torch.Generator().manual_seed(7)
    f, b = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, generator=gen)
    raw = kda_ops.RawGates(torch.randn(1, 1, 2, 1, generator=gen), torch.randn(32, generator=gen))
    states = torch.randn(5, 2, 16, 16, generator=gen)
    seqs = [LinearSeq(q_start=i, q_len=1, slot=s, has_state=True) for i, s in enumerate([4, 0, 2])]
    meta = LinearAttentionMetadata.build(seqs, "cpu")
    want_states = states.clone()
    g = kda_torch.kda_gate(f, raw.a_log, raw.dt_bias)
    want = kda_ops.kda_attention_torch(q, k, v, g, torch.sigmoid(b), want_states, meta)
    got = kda_ops._kda_fla(q, k, v, f, b, states, meta, raw, decode_kernel=kernel)
    assert (got - want).abs().max().item() < TOL
    assert (states - want_states).abs().max().item() < TOL


def test_the_torch_path_applies_raw_gates_itself():
    q, k, v, _, _ = inputs(3, seed=9)
    gen = torch.Generator().manual_seed(10)
    f, b = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, generator=gen)
    raw = kda_ops.RawGates(torch.randn(1, 1, 2, 1, generator=gen), torch.randn(32, generator=gen))
    states = torch.randn(5, 2, 16, 16, generator=gen)
    want_states = states.clone()
    meta = LinearAttentionMetadata.build(
        [LinearSeq(q_start=0, q_len=2, slot=1, has_state=True), LinearSeq(2, 1, 3, True)], "cpu"
    )
    got = kda_ops.kda_attention(q, k, v, f, b, states, meta, raw=raw)
    g = kda_torch.kda_gate(f, raw.a_log, raw.dt_bias)
    want = kda_ops.kda_attention_torch(q, k, v, g, torch.sigmoid(b), want_states, meta)
    assert torch.equal(got, want)
    assert torch.equal(states, want_states)


@pytest.mark.parametrize(
    "raw,kernel", [(False, "fla"), (True, "fla"), (True, "batchgen")], ids=["given", "raw", "ours"]
)
def test_mixed_step_splits_one_token_rows_from_prefill_chunks(monkeypatch, raw, kernel):
    """A mixed step (prefill chunks between one-token rows, a new one-token prompt among
    them): the one-token rows go to the recurrent step in place on their slots (fla's,
    or with raw gates kernels/kda_decode.py where decode_kernel says so), the chunks to
    the chunked kernel. The chunked kernel cannot run in the interpreter: its stand-in is
    fla's varlen recurrent KDA, the same math (compared with kda_chunk above). Outputs
    and every slot against the torch step."""
    calls = []

    def chunked(q, *args, cu_seqlens=None, **kwargs):
        calls.append(("chunked", q.shape[1], cu_seqlens.tolist()))
        kwargs.pop("cu_seqlens_cpu")
        return fla_kda.fused_recurrent_kda(q, *args, cu_seqlens=cu_seqlens, **kwargs)

    def recurrent(q, *args, ssm_state_indices=None, **kwargs):
        calls.append(("recurrent", q.shape[1], ssm_state_indices.tolist()))
        return fused_recurrent_kda_fwd(q, *args, ssm_state_indices=ssm_state_indices, **kwargs)

    _, fused_recurrent_kda_fwd = kda_ops.fla_kda()
    monkeypatch.setattr(kda_ops, "fla_kda", lambda: (chunked, recurrent))
    parts = [(1, 6, True), (5, 1, True), (1, 0, True), (1, 3, False), (7, 4, False), (1, 2, True)]
    seqs, row = [], 0
    for n, slot, has_state in parts:
        seqs.append(LinearSeq(q_start=row, q_len=n, slot=slot, has_state=has_state))
        row += n
    meta = LinearAttentionMetadata.build(seqs, "cpu")
    q, k, v, g, beta = inputs(row, seed=12)
    gen = torch.Generator().manual_seed(13)
    gates = None
    if raw:
        g, beta = torch.randn(row, 2, 16, generator=gen), torch.randn(row, 2, generator=gen)
        gates = kda_ops.RawGates(
            torch.randn(1, 1, 2, 1, generator=gen), torch.randn(32, generator=gen)
        )
    states = torch.randn(8, 2, 16, 16, generator=gen)
    states.index_fill_(0, meta.fresh_slots, 0.0)
    want_states = states.clone()
    want = kda_ops.kda_attention_torch(
        q,
        k,
        v,
        *(
            (g, beta)
            if not raw
            else (kda_torch.kda_gate(g, gates.a_log, gates.dt_bias), torch.sigmoid(beta))
        ),
        want_states,
        meta,
    )
    got = kda_ops._kda_fla(q, k, v, g, beta, states, meta, gates, decode_kernel=kernel)
    recurrent_calls = [("recurrent", 4, [6, 0, 3, 2])] if kernel == "fla" else []
    assert calls == recurrent_calls + [("chunked", 12, [0, 5, 12])]
    assert (got - want).abs().max().item() < TOL
    assert (states - want_states).abs().max().item() < TOL
    assert torch.equal(states[[5, 7]], want_states[[5, 7]])


@pytest.mark.parametrize("decodes_first", [True, False])
def test_mixed_step_in_two_blocks_hands_the_kernels_views(monkeypatch, decodes_first):
    """The usual mixed step: the running requests' one-token rows in one block, the
    admitted prompts' chunks in another (either order). Each kernel gets views of the
    step's contiguous q, k, v and g (no gather: the same storage); beta's rows are 8
    bytes here, so a view of them that starts off a 16-byte boundary is copied (Triton
    would compile anew for it) and one that starts on it is not. Every pointer handed
    over is aligned; the outputs and every slot match the torch step."""
    seen = []

    def record(name, tensors):
        seen.append((name, [t.untyped_storage().data_ptr() for t in tensors]))
        assert all(t.data_ptr() % 16 == 0 for t in tensors)

    def chunked(q, k, v, g, beta, *args, cu_seqlens=None, **kwargs):
        record("chunked", (q, k, v, g, beta))
        kwargs.pop("cu_seqlens_cpu")
        return fla_kda.fused_recurrent_kda(q, k, v, g, beta, *args, cu_seqlens=cu_seqlens, **kwargs)

    def recurrent(q, k, v, g, beta, *args, **kwargs):
        record("recurrent", (q, k, v, g, beta))
        return fused_recurrent_kda_fwd(q, k, v, g, beta, *args, **kwargs)

    _, fused_recurrent_kda_fwd = kda_ops.fla_kda()
    monkeypatch.setattr(kda_ops, "fla_kda", lambda: (chunked, recurrent))
    decodes = [(1, 6, True), (1, 0, True), (1, 2, True)]
    prefills = [(5, 1, True), (4, 3, False)]
    parts = decodes + prefills if decodes_first else prefills + decodes
    seqs, row = [], 0
    for n, slot, has_state in parts:
        seqs.append(LinearSeq(q_start=row, q_len=n, slot=slot, has_state=has_state))
        row += n
    meta = LinearAttentionMetadata.build(seqs, "cpu")
    split = kda_ops._step_split(meta)
    assert isinstance(split.decode_rows, slice) and isinstance(split.prefill_rows, slice)
    q, k, v, g, beta = (t.contiguous() for t in inputs(row, seed=21))
    assert beta.stride(0) * beta.element_size() == 8
    wide = [t.untyped_storage().data_ptr() for t in (q, k, v, g)]
    states = torch.randn(8, 2, 16, 16, generator=torch.Generator().manual_seed(22))
    states.index_fill_(0, meta.fresh_slots, 0.0)
    want_states = states.clone()
    want = kda_ops.kda_attention_torch(q, k, v, g, beta, want_states, meta)
    got = kda_ops._kda_fla(q, k, v, g, beta, states, meta)
    assert [name for name, _ in seen] == ["recurrent", "chunked"]
    first_block = "recurrent" if decodes_first else "chunked"  # its view starts at row 0
    for name, storages in seen:
        assert storages[:4] == wide
        copied = storages[4] != beta.untyped_storage().data_ptr()
        assert copied == (name != first_block)
    assert (got - want).abs().max().item() < TOL
    assert (states - want_states).abs().max().item() < TOL
    assert torch.equal(states[[4, 5, 7]], want_states[[4, 5, 7]])


def test_mixed_step_rows_interleaved_are_gathered():
    """One-token rows between prompt chunks cannot be one block: the split gathers them
    by row index, as test_mixed_step_splits_one_token_rows_from_prefill_chunks runs."""
    parts = [(3, 0), (1, 1), (2, 2), (1, 3)]
    seqs, row = [], 0
    for n, slot in parts:
        seqs.append(LinearSeq(q_start=row, q_len=n, slot=slot, has_state=True))
        row += n
    split = kda_ops._split(LinearAttentionMetadata.build(seqs, "cpu"), torch.device("cpu"))
    assert split.decode_rows.tolist() == [3, 6]
    assert split.prefill_rows.tolist() == [0, 1, 2, 4, 5]
    assert split.prefill_cu.tolist() == [0, 3, 5]
    assert split.decode_slots.tolist() == [1, 3] and split.prefill_slots.tolist() == [0, 2]

"""Batch-invariant ops (layers/batch_invariant.py): a row's bits do not depend on the
rows beside it, and the plain ops they replace do (CPU, float32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen.layers import batch_invariant as bi
from batchgen.layers.attention_torch import _attend
from batchgen.layers.norm import rms_norm_torch

ROW_COUNTS = [1, 2, 3, 15, 16, 17, 40, 64, 100, 257]


def _rows_differ(fn, x: torch.Tensor) -> list[int]:
    """Row counts m for which fn(x[:m])'s first row differs from fn(x[:1])'s."""
    alone = fn(x[:1])[0]
    return [m for m in ROW_COUNTS if not torch.equal(fn(x[:m])[0], alone)]


@pytest.mark.parametrize("shape", [(64, 192), (576, 1536), (1536, 576)])
def test_linear_rows_do_not_depend_on_the_row_count(shape):
    k, n = shape
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(300, k, generator=gen)
    # the plain op differs (MKL picks its kernel by the row count): the mode matters
    assert _rows_differ(lambda r: F.linear(r, w, b), x)
    with bi.invariant_mode():
        assert _rows_differ(lambda r: bi.linear(r, w, b), x) == []
        # and the first row's place in the batch does not matter either
        ref = bi.linear(x[:1], w, b)[0]
        for at in (5, 16, 33, 299):
            moved = torch.cat([x[1 : at + 1], x[:1], x[at + 1 :]])
            assert torch.equal(bi.linear(moved, w, b)[at], ref)
    torch.testing.assert_close(bi.linear(x, w, b), F.linear(x, w, b))


def test_linear_of_no_rows_is_empty():
    """An expert-parallel rank's slice of a step's tokens can be empty (one decode row
    over two ranks): its router's product still runs."""
    w = torch.randn(8, 64)
    with bi.invariant_mode():
        assert bi.linear(torch.randn(0, 64), w).shape == (0, 8)
        assert bi.linear(torch.randn(2, 0, 64), w, torch.randn(8)).shape == (2, 0, 8)


def test_the_mode_is_off_outside_and_nests():
    assert not bi.active()
    with bi.invariant_mode():
        assert bi.active()
        with bi.invariant_mode(False):
            assert not bi.active()
        assert bi.active()
    assert not bi.active()


def test_bmm_rows_do_not_depend_on_the_row_count():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(3, 300, 48, generator=gen)
    b = torch.randn(3, 48, 80, generator=gen)
    assert _rows_differ(lambda r: torch.bmm(a[:, : r.shape[0]], b).transpose(0, 1), a[0])
    with bi.invariant_mode():
        got = _rows_differ(lambda r: bi.bmm(a[:, : r.shape[0]], b).transpose(0, 1), a[0])
        assert got == []
        torch.testing.assert_close(bi.bmm(a, b), torch.bmm(a, b))


def test_row_reductions_are_already_invariant_on_the_cpu():
    """RMSNorm, softmax and log-softmax reduce within a row: no row tile needed."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(300, 576, generator=gen)
    w = torch.randn(576, generator=gen)
    assert _rows_differ(lambda r: rms_norm_torch(r, w, 1e-5), x) == []
    logits = torch.randn(300, 4099, generator=gen)
    assert _rows_differ(lambda r: torch.log_softmax(r, -1), logits) == []
    assert _rows_differ(lambda r: torch.softmax(r, -1), logits) == []


def _sequence(s: int, h: int = 4, hk: int = 2, d: int = 32, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(s, h, d, generator=gen)
    k = torch.randn(s, hk, d, generator=gen)
    v = torch.randn(s, hk, d, generator=gen)
    return q, k, v


@pytest.mark.parametrize("window", [None, 50])
def test_attend_matches_attention_and_each_query_is_chunk_invariant(window):
    s = 203
    q, k, v = _sequence(s)
    pos = torch.arange(s)
    allowed = (pos[None, :] <= pos[:, None]) & (
        True if window is None else pos[None, :] > pos[:, None] - window
    )
    ref = _attend(q[None], k[None], v[None], allowed[None], 0.3)[0]
    with bi.invariant_mode():
        whole = bi.attend(q[None], k[None], v[None], pos[None], 0.3, window)[0]
        torch.testing.assert_close(whole, ref)
        # the same queries in chunks (keys up to the chunk's end) and one at a time as
        # decode rows (keys padded past their sequence): the same bits
        for chunk in (1, 7, 64, 100):
            parts = []
            for start in range(0, s, chunk):
                end = min(s, start + chunk)
                parts.append(
                    bi.attend(
                        q[None, start:end],
                        k[None, :end],
                        v[None, :end],
                        pos[None, start:end],
                        0.3,
                        window,
                    )[0]
                )
            assert torch.equal(torch.cat(parts), whole), chunk
        rows = [150, 3, 202, 64]
        decode = bi.attend(
            q[rows][:, None],
            k[None].expand(4, -1, -1, -1),
            v[None].expand(4, -1, -1, -1),
            pos[rows][:, None],
            0.3,
            window,
        )[:, 0]
        assert torch.equal(decode, whole[rows])


def test_plain_attention_differs_by_key_count():
    """Without the mode the reference attention's bits for a query depend on how many
    keys its call holds (a decode row over its own keys vs the same query in a prefill
    of the whole sequence): the difference deterministic=True removes exists."""
    s = 203
    q, k, v = _sequence(s)
    pos = torch.arange(s)
    whole = _attend(q[None], k[None], v[None], (pos[None, :] <= pos[:, None])[None], 0.3)[0]
    differ = []
    for r in (5, 9, 100):
        alone = _attend(
            q[r][None, None],
            k[None, : r + 1],
            v[None, : r + 1],
            torch.ones(1, 1, r + 1, dtype=torch.bool),
            0.3,
        )[0, 0]
        differ.append(not torch.equal(alone, whole[r]))
    assert any(differ)
    with bi.invariant_mode():
        whole = bi.attend(q[None], k[None], v[None], pos[None], 0.3)[0]
        for r in (5, 9, 100):
            alone = bi.attend(
                q[r][None, None], k[None, : r + 1], v[None, : r + 1], pos[r].view(1, 1), 0.3
            )[0, 0]
            assert torch.equal(alone, whole[r])


def test_pointwise_rows_do_not_depend_on_the_row_count():
    """A sigmoid over narrow contiguous rows (8 router logits) takes the scalar tail for
    some rows alone and the vector loop in a batch; padded rows take the vector loop."""
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 2

    def differ(fn):
        return [m for m in range(1, 65) if not torch.equal(fn(x[:m])[m - 1], fn(x[m - 1 : m])[0])]

    assert differ(torch.sigmoid)
    with bi.invariant_mode():
        assert differ(lambda r: bi.pointwise(torch.sigmoid, r)) == []
        torch.testing.assert_close(bi.pointwise(torch.sigmoid, x), torch.sigmoid(x))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_triton_experts_rows_do_not_depend_on_the_token_counts(device):
    """The routed experts as deterministic=True runs them on CUDA (kernels/fused_moe.py's
    GEMMs with one fixed tuning; on the CPU under the interpreter): a token's sum is the
    same bits whatever other tokens the step routes to its experts."""
    from batchgen.kernels.fused_moe import TUNING
    from batchgen.layers.routed_experts import fused_experts

    gen = torch.Generator().manual_seed(4)
    e, h, inter, t = 4, 32, 16, 40
    gate_up = (torch.randn(e, 2 * inter, h, generator=gen) * 0.2).to(device)
    down = (torch.randn(e, h, inter, generator=gen) * 0.2).to(device)
    x = torch.randn(t, h, generator=gen).to(device)
    ids = torch.randint(0, e, (t, 2), generator=gen).to(device)
    weights = torch.rand(t, 2, generator=gen).to(device)

    def run(rows):
        return fused_experts(x[rows], gate_up, down, weights[rows], ids[rows], triton_moe=TUNING)

    full = run(slice(None))
    for rows in (slice(0, 1), slice(3, 5), slice(10, 27)):
        assert torch.equal(run(rows), full[rows])
    plain = fused_experts(x, gate_up, down, weights, ids, use_grouped_mm=False)
    torch.testing.assert_close(full, plain, atol=1e-4, rtol=1e-4)

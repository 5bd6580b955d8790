"""deterministic=True on the GPU, KDA layer by layer (bf16, fla-core's kernels with their
configs pinned, layers/kda_invariant.py): a sequence's output rows and final state are
the same bits alone, in a step of mixed lengths with decode rows, in a step of over 65,536
rows (where fla's l2norm and gated norm key their tuning on the step's size), and in
pieces ending at multiples of 64 (a one-token piece among them); the gated output norm's
rows likewise."""

from __future__ import annotations

import pytest
import torch

from batchgen.forward_context import LinearAttentionMetadata, LinearSeq
from batchgen.layers import batch_invariant, kda_ops

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if kda_ops.fla_kda() is None:
    pytest.skip("fla-core is not installed", allow_module_level=True)

H, DK, DV = 4, 128, 128  # tests/layers/test_kda_gpu.py's heads
BIG = 66_000  # rows of a step past fla's 65,536-row tuning bucket
LENGTHS = {"a": 130, "b": 65, "c": 200, "d": 37, "big": BIG, "x": 1, "y": 1}
SLOT = {name: i for i, name in enumerate(LENGTHS)}
TARGETS = ("a", "b", "c")


def _inputs():
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    seqs = {
        name: (randn(n, H, DK), randn(n, H, DK), randn(n, H, DV), randn(n, H, DK), randn(n, H))
        for name, n in LENGTHS.items()
    }
    raw = kda_ops.RawGates(
        -torch.rand(H, device="cuda", generator=gen), randn(H * DK, dtype=torch.float32)
    )
    start_states = torch.randn(len(LENGTHS), H, DV, DK, device="cuda", generator=gen)
    return seqs, raw, start_states


def _run(steps, seqs, raw, start_states):
    """Each step a list of (name, first row, rows); a piece from row 0 starts from a zeroed
    slot unless the name is a decode row's ("x", "y": from a random state). -> each
    target's output rows and final state."""
    states = start_states.clone()
    out = {name: [] for name in TARGETS}
    with batch_invariant.invariant_mode(True):
        for step in steps:
            parts, meta_seqs, row = [], [], 0
            for name, first, n in step:
                fresh = first == 0 and name not in ("x", "y")
                meta_seqs.append(LinearSeq(row, n, SLOT[name], has_state=not fresh))
                parts.append([t[first : first + n] for t in seqs[name]])
                row += n
            meta = LinearAttentionMetadata.build(meta_seqs, "cuda")
            states.index_fill_(0, meta.fresh_slots, 0.0)
            kda_ops.prepare_step(meta)
            args = [torch.cat(ts) for ts in zip(*parts)]
            o = kda_ops.kda_attention(*args, states, meta, raw=raw)
            for s, (name, _, n) in zip(meta_seqs, step):
                if name in TARGETS:
                    out[name].append(o[s.q_start : s.q_start + n])
    return {name: (torch.cat(out[name]), states[SLOT[name]]) for name in TARGETS}


def test_kda_rows_are_the_same_bits_alone_batched_and_in_pieces():
    seqs, raw, start = _inputs()
    alone = _run([[(n, 0, LENGTHS[n])] for n in TARGETS], seqs, raw, start)
    runs = {
        "mixed": [[("x", 0, 1), ("a", 0, 130), ("d", 0, 37), ("b", 0, 65), ("y", 0, 1),
                   ("c", 0, 200)]],
        "big": [[("big", 0, BIG), ("c", 0, 200), ("a", 0, 130), ("b", 0, 65)]],
        "pieces of 64": [
            [("a", 0, 64), ("b", 0, 64), ("c", 0, 64)],
            [("x", 0, 1), ("a", 64, 64), ("b", 64, 1), ("c", 64, 128)],
            [("c", 192, 8), ("a", 128, 2), ("d", 0, 37)],
        ],
        "pieces of 128": [
            [("c", 0, 128), ("b", 0, 64), ("a", 0, 128)],
            [("a", 128, 2), ("b", 64, 1), ("y", 0, 1), ("c", 128, 72)],
        ],
    }  # fmt: skip
    for note, steps in runs.items():
        got = _run(steps, seqs, raw, start)
        for name in TARGETS:
            assert torch.equal(got[name][0], alone[name][0]), (note, name, "output")
            assert torch.equal(got[name][1], alone[name][1]), (note, name, "state")


def test_gated_norm_rows_are_the_same_bits_in_any_step():
    gen = torch.Generator(device="cuda").manual_seed(1)
    o = torch.randn(BIG, H, DV, device="cuda", generator=gen).to(torch.bfloat16)
    gate = torch.randn(BIG, H, DV, device="cuda", generator=gen).to(torch.bfloat16)
    weight = torch.rand(DV, device="cuda", generator=gen).to(torch.bfloat16)
    with batch_invariant.invariant_mode(True):
        whole = kda_ops.output_norm(o, weight, gate, 1e-6)
        for rows in (slice(0, 3), slice(100, 1000), slice(BIG - 70, BIG)):
            part = kda_ops.output_norm(o[rows], weight, gate[rows], 1e-6)
            assert torch.equal(part, whole[rows]), rows

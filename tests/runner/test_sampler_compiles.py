"""What keeps a sampled job from compiling Triton kernels mid-run: the pointers the
sampling kernels get start 16-byte aligned whatever the batch's row count (Triton
compiles a kernel once per alignment pattern of its pointers), and `warm_kernels`
launches every kernel variant a sampled step can, at build time."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import sampling_nucleus
from batchgen.runner import sampler as sampler_module
from batchgen.runner.penalty_counts import PenaltyCounts
from batchgen.runner.sampler import Sampler, SamplingMetadata, warm_kernels
from batchgen.sampling_params import SamplingParams

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCAB = 64


def _meta(rows: int) -> SamplingMetadata:
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1, seed=i)
        for i in range(rows)
    ]
    return SamplingMetadata.build(
        params,
        [[1, 2]] * rows,
        [[3] * (i + 1) for i in range(rows)],
        VOCAB,
        DEVICE,
        [0],
        penalty_counts=PenaltyCounts(VOCAB, DEVICE),
        request_ids=[f"r{i}" for i in range(rows)],
    )


@pytest.mark.parametrize("rows", range(1, 8))
def test_metadata_tensors_start_16_byte_aligned(rows):
    meta = _meta(rows)
    tensors = {
        "temperature": meta.temperature,
        "top_p": meta.top_p,
        "min_p": meta.min_p,
        "seeds": meta.seeds,
        "positions": meta.positions,
        "repetition": meta.repetition_penalty,
        "frequency": meta.frequency_penalty,
        "presence": meta.presence_penalty,
        "row slots": meta.penalty_source[2],
        "penalised rows": meta.penalty_rows[0],
        "their slots": meta.penalty_rows[1],
    }
    misaligned = {k: t.data_ptr() % 16 for k, t in tensors.items() if t.data_ptr() % 16}
    assert not misaligned
    assert all(t.shape == (rows,) and t.is_contiguous() for t in tensors.values())
    # the values are those of the rows, the padding is not read
    assert meta.positions.tolist() == [i + 1 for i in range(rows)]
    assert meta.seeds.tolist() == list(range(rows))
    assert meta.penalty_rows[0].tolist() == list(range(rows))
    assert torch.equal(meta.top_p, torch.full((rows,), 0.95, device=DEVICE))


class _Recorder:
    """Stands for a @triton.jit kernel: records its pointer arguments' alignment, then
    launches the real one."""

    def __init__(self, kernel, seen: list) -> None:
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            ptrs = [a.data_ptr() % 16 for a in args if isinstance(a, torch.Tensor)]
            self.seen.append(tuple(ptrs))
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_nucleus_kernels_get_aligned_pointers(rows, monkeypatch):
    seen: list = []
    for name in ("_sample_kernel", "_mass_kernel", "_nucleus_kernel"):
        monkeypatch.setattr(
            sampling_nucleus, name, _Recorder(getattr(sampling_nucleus, name), seen)
        )
    meta = _meta(rows)
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
    sampling_nucleus.sample_nucleus(
        logits, meta.temperature, meta.seeds, meta.positions, meta.top_p
    )
    assert len(seen) == 3
    assert all(offset == 0 for launch in seen for offset in launch), seen


def test_warm_kernels_launches_every_variant(monkeypatch):
    calls = []

    def recorded(name, fn):
        def call(*args):
            calls.append((name, args[-1] is not None))  # (kernel, with a cut / rows)
            return fn(*args)

        return call

    for name in ("sample_nucleus", "sample_tokens", "penalized_logits"):
        monkeypatch.setattr(sampler_module, name, recorded(name, getattr(sampler_module, name)))
    warm_kernels(Sampler(kernels=True), VOCAB, torch.float32, DEVICE)
    assert set(calls) >= {
        ("sample_nucleus", False),
        ("sample_nucleus", True),
        ("sample_tokens", False),
        ("sample_tokens", True),
        ("penalized_logits", True),
    }

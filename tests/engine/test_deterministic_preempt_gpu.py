"""deterministic=True on the GPU (bf16, fla-core's KDA kernels, decode CUDA graphs), a
Kimi Linear preempted: each request's tokens and logprobs are the same bits as in an
ample pool's run, whether a tight pool recomputes it (no host tier) or swaps it to the
host tier, and after a recompute only prompt positions go through fla's chunked kernel
(its decoded tokens replay through the recurrent step they first took)."""

from __future__ import annotations

import pytest
import torch
from kimi_checkpoints import save_tiny_kimi
from test_deterministic_preempt import prompts_and_params, rows

from batchgen import LLM
from batchgen.layers import kda_ops

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

L, F = "linear_attention", "full_attention"
KW = dict(device="cuda", dtype="bfloat16", deterministic=True, max_model_len=128)
TIGHT = dict(num_kv_pages=12, page_size=16)
LINEAR = dict(linear_num_heads=4, linear_head_dim=128)  # tests/layers/test_kda_gpu.py's heads
NUM_KDA_LAYERS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi-preempt-gpu")
    save_tiny_kimi(path, layer_types=[L, F, L, F], **LINEAR)
    return str(path)


def test_preempted_kimi_linear_rows_match_the_ample_run_on_the_gpu(model_dir, monkeypatch):
    prompts, params = prompts_and_params()
    ample = rows(LLM(model=model_dir, **KW), prompts, params)

    recompute = LLM(model=model_dir, **TIGHT, **KW)
    chunked_rows = []  # eager calls (decode-only steps replay graphs, uncounted)
    plain = kda_ops._chunked

    def counted(step, *args, **kwargs):
        chunked_rows.append(step[0].shape[0])
        return plain(step, *args, **kwargs)

    monkeypatch.setattr(kda_ops, "_chunked", counted)
    assert rows(recompute, prompts, params) == ample
    monkeypatch.undo()
    metrics = recompute.engine.metrics()
    assert metrics["recomputes"] > 0
    # prompts of 20-63 tokens: one piece each, no 64k + 1 tail
    assert sum(chunked_rows) == NUM_KDA_LAYERS * metrics["prefill_tokens_computed"]

    swapping = LLM(model=model_dir, **TIGHT, host_kv_size_gib=0.25, **KW)
    assert rows(swapping, prompts, params) == ample
    metrics = swapping.engine.metrics()
    assert metrics["swaps_out"] > 0 and metrics["recomputes"] == 0

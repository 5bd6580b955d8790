"""The build runs the logits GEMM once for every row count a step may sample
(ModelRunner.warm_logits): under CUDA's lazy module loading the first launch of a kernel
not loaded yet waits for the GPU to drain, and cuBLAS chooses its kernel by the row
count, so a pipelined decode step would otherwise stall on a new batch size."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_model

from batchgen import LLM, SamplingParams
from batchgen.models.llama import DecoderStack


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint path, transformers' model of it)."""
    path = tmp_path_factory.mktemp("tiny-warm-logits")
    return str(path), save_tiny_model(path, "Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def model_dir(saved):
    return saved[0]


def _spy(monkeypatch) -> list[int]:
    rows: list[int] = []
    local_logits = DecoderStack.local_logits

    def spy(self, hidden):
        rows.append(hidden.shape[0])
        return local_logits(self, hidden)

    monkeypatch.setattr(DecoderStack, "local_logits", spy)
    return rows


def test_local_logits_are_compute_logits_on_one_process(saved):
    """The GEMM the warm-up runs is the one compute_logits runs: on one process both give
    the checkpoint's lm_head applied in float64 (its own matrix, not the tied embedding),
    to float32 rounding."""
    model_dir, hf = saved
    llm = LLM(model=model_dir, device="cpu", dtype="float32", max_num_seqs=4)
    model = llm.engine.model
    hidden = torch.randn(
        5, llm.engine.hf_config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    head = hf.get_output_embeddings().weight.detach().double()
    assert not torch.equal(head, hf.get_input_embeddings().weight.detach().double())
    want = (hidden.double() @ head.t()).float()
    torch.testing.assert_close(model.local_logits(hidden), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.compute_logits(hidden), want, rtol=1e-5, atol=1e-5)


def test_the_cpu_build_warms_nothing(model_dir, monkeypatch):
    rows = _spy(monkeypatch)
    LLM(model=model_dir, device="cpu", dtype="float32", max_num_seqs=4)
    assert rows == []


@pytest.mark.gpu
def test_the_gpu_build_runs_each_row_count_once_in_the_default_configuration(
    model_dir, monkeypatch
):
    rows = _spy(monkeypatch)
    llm = LLM(model=model_dir, device="cuda", dtype="bfloat16", max_num_seqs=24)
    assert sorted(rows) == list(range(1, 25))
    params = SamplingParams(temperature=0, max_tokens=8)
    out = llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    assert all(o.outputs[0].token_ids for o in out)

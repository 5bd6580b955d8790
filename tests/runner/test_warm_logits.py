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
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-warm-logits")
    save_tiny_model(path, "Qwen3ForCausalLM")
    return str(path)


def _spy(monkeypatch) -> list[int]:
    rows: list[int] = []
    local_logits = DecoderStack.local_logits

    def spy(self, hidden):
        rows.append(hidden.shape[0])
        return local_logits(self, hidden)

    monkeypatch.setattr(DecoderStack, "local_logits", spy)
    return rows


def test_local_logits_are_compute_logits_on_one_process(model_dir):
    """The GEMM the warm-up runs is the one compute_logits runs: equal logits."""
    llm = LLM(model=model_dir, device="cpu", dtype="float32", max_num_seqs=4)
    model = llm.engine.model
    hidden = torch.randn(
        5, llm.engine.hf_config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(model.local_logits(hidden), model.compute_logits(hidden))


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

"""The warm-up forward that memory planning measures on a GPU also runs on the CPU."""

from __future__ import annotations

from conftest import save_tiny_model

from batchgen import LLM
from batchgen.engine.memory import warmup_forward


def test_warmup_forward_runs_a_full_budget_step(tmp_path):
    save_tiny_model(tmp_path, "Qwen3ForCausalLM")
    llm = LLM(model=str(tmp_path), device="cpu", dtype="float32", page_size=4, max_model_len=64)
    eng = llm.engine
    free = eng.kv.num_free_pages
    warmup_forward(eng.model, eng.layout, eng.device, eng.hf_config, eng.eos_token_ids, 37)
    eng._profile_forward(10**6)  # capped at max_model_len
    assert eng.kv.num_free_pages == free  # a throw-away pool: the engine's is untouched

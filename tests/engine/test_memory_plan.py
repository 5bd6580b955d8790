"""The warm-up forward that memory planning measures on a GPU also runs on the CPU."""

from __future__ import annotations

import torch
from conftest import save_tiny_model

import batchgen.engine.memory as memory
from batchgen import LLM
from batchgen.engine.memory import warmup_forward
from batchgen.forward_context import get_forward_context
from batchgen.layers import attention, attention_torch


def test_warmup_forward_runs_a_full_budget_step(tmp_path, monkeypatch):
    save_tiny_model(tmp_path, "Qwen3ForCausalLM")
    llm = LLM(model=str(tmp_path), device="cpu", dtype="float32", page_size=4, max_model_len=64)
    eng = llm.engine
    pools, forwards = [], []

    class SpiedPool(memory.PagePool):  # the throw-away pools the warm-up builds
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pools.append(self)

    monkeypatch.setattr(memory, "PagePool", SpiedPool)
    # the torch reference under two more names: the forward context says which one ran
    monkeypatch.setitem(attention._BACKENDS, "asked", attention_torch)
    monkeypatch.setitem(attention._BACKENDS, "engine's", attention_torch)
    monkeypatch.setattr(eng.config, "attention_backend", "engine's")

    def seen(_, args):
        forwards.append((args[0].shape, get_forward_context().attention_backend))

    hook = eng.model.register_forward_pre_hook(seen)
    free = eng.kv.num_free_pages
    torch.manual_seed(0)
    eng.pool.kv.normal_()  # non-zero everywhere: any write shows
    engine_kv = eng.pool.kv.clone()

    layout, hf_config, eos = eng.layout, eng.hf_config, eng.eos_token_ids
    warmup_forward(eng.model, layout, eng.device, hf_config, eos, 37, attention_backend="asked")
    eng._profile_forward(10**6)  # capped at max_model_len, on the engine's backend
    hook.remove()

    # one forward of the requested number of tokens each, capped at max_model_len = 64,
    # on the backend asked for
    assert forwards == [(torch.Size([37]), "asked"), (torch.Size([64]), "engine's")]
    # each wrote the KV of exactly those tokens into its own pool, and nothing else
    assert len(pools) == 2
    for pool, n in zip(pools, (37, 64)):
        assert pool.kv is not eng.pool.kv
        slots = pool.kv.flatten(2, 3).abs().amax(dim=(0, 1, 3, 4))  # per token slot
        assert bool((slots[:n] > 0).all()) and not bool(slots[n:].any())
    # the engine's own pool is bit-for-bit untouched, its pages all still free
    assert torch.equal(eng.pool.kv, engine_kv)
    assert eng.kv.num_free_pages == free

"""The warm-up forward that memory planning measures on a GPU also runs on the CPU."""

from __future__ import annotations

import torch
from conftest import save_tiny_model

import batchgen.engine.memory as memory
from batchgen import LLM
from batchgen.config import EngineConfig
from batchgen.engine.memory import warmup_forward
from batchgen.forward_context import get_forward_context
from batchgen.kv.state_pool import StateLayout
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


def test_the_host_budget_gives_hybrid_models_a_state_slot_per_seat():
    layout = StateLayout(2, 2, 4, 4, 6, 4, torch.float32)  # 2 * (256 + 72) bytes a slot
    per = layout.bytes_per_slot
    config = EngineConfig(host_kv_size_gib=1.0, max_num_seqs=8, state_checkpoint_interval=0)
    assert memory.split_host_budget(config, None) == (1.0, 0)
    gib, slots = memory.split_host_budget(config, layout)
    assert slots == 8 and gib == 1.0 - 8 * per / 2**30
    small = EngineConfig(
        host_kv_size_gib=7 * per / 2**30, max_num_seqs=8, state_checkpoint_interval=0
    )
    gib, slots = memory.split_host_budget(small, layout)  # at most half the budget
    assert slots == 3 and abs(gib * 2**30 - 4 * per) < 1e-6
    # state checkpoints (on by default) get three more slots per seat
    gib, slots = memory.split_host_budget(
        EngineConfig(host_kv_size_gib=1.0, max_num_seqs=8), layout
    )
    assert slots == 32 and gib == 1.0 - 32 * per / 2**30

"""The engine on the Triton attention backend gives the torch backend's greedy tokens.

On the CPU the kernels run in Triton's interpreter, so the model and the run are tiny;
the run still mixes prefill chunks, cached prefixes and decodes in one step. The
Llama-family layers take the one-launch rope and K/V store there (layers/attention.py's
forward_qkv), Qwen3's with its q/k norm.
"""

from __future__ import annotations

import pytest
from conftest import save_tiny_model

from batchgen import LLM, SamplingParams
from batchgen.layers.rotary import RotaryEmbedding

PROMPTS = [
    [5, 17, 99, 4, 250, 31, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 40, 41, 42, 43, 44, 45],
    [5, 17, 99, 4, 250, 31, 7, 8, 9, 10, 11, 12, 300],  # shares a prefix with the first
    [77, 3, 480],
]


def _greedy(model_dir, backend: str) -> tuple[list[list[int]], str]:
    llm = LLM(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        attention_backend=backend,
        num_kv_pages=64,
        max_model_len=128,
        page_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=4,
    )
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine.runner.attention_backend


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_triton_backend_greedy_matches_torch_backend(tmp_path, monkeypatch, arch):
    save_tiny_model(tmp_path, arch)
    expected, _ = _greedy(tmp_path, "torch")
    fused = []
    store = RotaryEmbedding.forward_qkv_store

    def counted(self, *args, **kwargs):
        fused.append(args[-1] is not None)  # k_norm given: Qwen3's q/k norm in the launch
        return store(self, *args, **kwargs)

    monkeypatch.setattr(RotaryEmbedding, "forward_qkv_store", counted)
    got, used = _greedy(tmp_path, "triton")
    assert used == "triton", "attention_backend='triton' did not reach the model runner"
    assert fused and set(fused) == {arch == "Qwen3ForCausalLM"}, "the fused store was not taken"
    assert got == expected

"""INT4 checkpoints in compressed-tensors' pack-quantized format (Kimi-K2-Thinking's, g32)
load with their weights still packed, and generate what the same weights dequantized
(float32, a plain checkpoint) generate: tokens identical, logprobs within 1e-4.

Tiny random Llama, DeepSeek-V3 and Kimi Linear checkpoints are written by transformers,
then packed by the compressed-tensors library (tests/int4_blocks.py), in groups of 32
(and one Llama in groups of 128, down_proj's 256 columns two groups); the reference
checkpoint holds that library's own dequantization of them. The DeepSeek-V3 one is
Kimi-K2-Thinking's split (routed experts INT4, the rest float), the others pack every
linear layer but the lm_head (MLA's kv_b_proj, whose matrix the model reads, loads
dequantized). Each reference run picks as EOS a token its continuations emit, so the
default runs end both ways.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import record_queued, save_tiny_model
from deepseek_checkpoints import save_tiny_deepseek
from int4_blocks import TINY_INT4, write_pack_quantized
from kimi_checkpoints import save_tiny_kimi
from penalty_reference import set_eos

from batchgen import LLM, SamplingParams

MAX_NEW = 10
RUN = dict(device="cpu", dtype="float32", page_size=4, max_model_len=128, max_num_seqs=8)
PROMPTS = [[5, 6, 7, 8], [40, 41, 300, 2, 9, 10, 11], [100 + i for i in range(30)], [77] * 9]

MODELS = {  # (write the float checkpoint, which weights to pack, ignore list, group)
    "llama": TINY_INT4["llama"],
    "llama_g128": (
        lambda d: save_tiny_model(d, "LlamaForCausalLM", intermediate_size=256),
        lambda n: "proj" in n,
        None,
        128,
    ),
    "deepseek_v3": TINY_INT4["deepseek_v3"],
    "deepseek_v3_all_linear": (
        lambda d: save_tiny_deepseek(d, first_k_dense_replace=1, q_lora_rank=None),
        lambda n: "proj" in n,
        None,
    ),
    "kimi_linear": (
        lambda d: save_tiny_kimi(d, layer_types=["linear_attention", "full_attention"]),
        lambda n: "proj" in n or ".experts." in n,
        None,
    ),
}


class Checkpoints:
    """An INT4 checkpoint, its dequantized twin and the twin's greedy continuations
    (the reference), with EOS set in both to a token the continuations emit."""

    def __init__(self, base, name: str) -> None:
        save, packs, ignore, group = (*MODELS[name], 32)[:4]
        self.int4, self.plain = base / "int4", base / "plain"
        for d in (self.int4, self.plain):
            d.mkdir()
            save(d)
        self.packed = write_pack_quantized(self.int4, self.plain, packs, group, ignore)
        llm = LLM(model=str(self.plain), **RUN)
        params = SamplingParams(
            temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0
        )  # off-defaults: the reference, run to full length
        self.runs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        counts = Counter(t for o in self.runs for t in o.token_ids[1:-1])
        self.eos = next(t for t, _ in counts.most_common() if t > 2)
        for d in (self.int4, self.plain):
            set_eos(d, self.eos)
        self.stops = {self.eos, 2}

    def expected(self, i: int) -> tuple[list[int], str]:
        tokens = self.runs[i].token_ids
        for n, t in enumerate(tokens):
            if t in self.stops:
                return tokens[: n + 1], "stop"
        return tokens, "length"


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoints(request, tmp_path_factory):
    return Checkpoints(tmp_path_factory.mktemp(request.param), request.param)


def _packed_bytes_ratio(model) -> float:
    """Bytes of the packed layers' parameters over the same weights' bytes in bf16."""
    packed = dense = 0
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if name.endswith("_packed"):
                assert p.dtype == torch.int32
                scale = getattr(module, name[: -len("_packed")] + "_scale")
                packed += p.nbytes + scale.nbytes
                dense += p.numel() * 8 * 2
    return packed / dense


def test_int4_checkpoint_loads_packed_and_greedy_matches_in_the_default_configuration(checkpoints):
    """Pipelined decode, EOS endings: each request's tokens and finish reason are the
    dequantized twin's."""
    llm = LLM(model=str(checkpoints.int4), **RUN)
    queued = record_queued(llm.engine.runner)
    model = llm.engine.runner.model
    ratio = _packed_bytes_ratio(model)
    assert 0.25 < ratio <= 0.32, f"packed layers hold {ratio:.2f}x of their bf16 bytes"
    assert not any(n.endswith("_proj.weight") and "kv_b_proj" not in n and "lm_head" not in n
                   for n, p in model.named_parameters() if p.dtype == torch.int32)  # fmt: skip
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    reasons = Counter()
    for i, out in enumerate(outs):
        tokens, reason = checkpoints.expected(i)
        assert out.outputs[0].token_ids == tokens, f"request {i}"
        assert out.outputs[0].finish_reason == reason, f"request {i}"
        reasons[reason] += 1
    assert reasons["stop"] and reasons["length"], reasons
    assert any(queued), "no decode step was queued ahead"


def test_weight_bytes_count_the_packed_words_and_scales(checkpoints):
    """engine.metrics()["weight_bytes"]: the float32 twin's bytes less, for every packed
    weight but kv_b_proj's (loaded dequantized), its float32 matrix plus its packed words
    and float32 scales (the model's dtype)."""
    from safetensors.torch import load_file

    kw = dict(RUN, num_kv_pages=32)
    int4_bytes = LLM(model=str(checkpoints.int4), **kw).engine.metrics()["weight_bytes"]
    float_bytes = LLM(model=str(checkpoints.plain), **kw).engine.metrics()["weight_bytes"]
    saved = 0
    for name, t in load_file(str(checkpoints.int4 / "model.safetensors")).items():
        if name.endswith(".weight_packed") and "kv_b_proj" not in name:
            saved += 4 * t.numel() * 8 - t.nbytes
        elif name.endswith(".weight_scale") and "kv_b_proj" not in name:
            saved -= 4 * t.numel()
    assert saved > 0 and int4_bytes == float_bytes - saved


def test_int4_checkpoint_logprobs_match_the_dequantized_weights(checkpoints):
    llm = LLM(model=str(checkpoints.int4), **RUN)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    worst = 0.0
    for out, ref in zip(llm.generate(PROMPTS, params, use_tqdm=False), checkpoints.runs):
        assert out.outputs[0].token_ids == ref.token_ids
        for step, tok in enumerate(ref.token_ids):
            got = out.outputs[0].logprobs[step][tok].logprob
            worst = max(worst, abs(got - ref.logprobs[step][tok].logprob))
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"

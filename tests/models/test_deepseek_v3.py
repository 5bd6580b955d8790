"""DeepSeek-V3 (MLA over the latent paged cache) against transformers on tiny random
checkpoints, CPU fp32: greedy tokens identical, logprobs within 1e-4.

Runs are shaped to exercise chunked prefill (small token budget), prefix-cache hits
(shared prefixes), preemption (a small pool), the host tier (swaps), pipelined decode
and EOS endings (the checkpoint's EOS is a token the model does emit).
"""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch
from conftest import record_queued
from deepseek_checkpoints import CONFIGS, YARN, save_tiny_deepseek, tiny_config
from parity import reference_greedy

from batchgen import LLM, SamplingParams
from batchgen.models.loader import ModelSource, build_model

MAX_NEW = 10
RUN = dict(device="cpu", dtype="float32", page_size=4, max_model_len=128, max_num_seqs=8)


def _prompts(n: int = 12, shared_len: int = 24) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randint(3, 500) for _ in range(shared_len)]
    prompts = []
    for i in range(n):
        tail = [rng.randint(3, 500) for _ in range(rng.randint(1, 40))]
        prompts.append(shared + tail if i % 3 == 0 else tail + shared[: i % 7])
    return prompts


class Reference:
    """transformers' greedy continuations, without EOS, and the checkpoint's EOS set to a
    token some of them emit: the expected output of a request stops at its first EOS."""

    def __init__(self, model, path, prompts) -> None:
        self.runs = [reference_greedy(model, p, MAX_NEW, eos=None) for p in prompts]
        counts = Counter(t for tokens, _ in self.runs for t in tokens[1:-1])
        self.eos = next(t for t, _ in counts.most_common() if t > 2)
        for name in ("config.json", "generation_config.json"):
            file = path / name
            data = json.loads(file.read_text())
            data["eos_token_id"] = self.eos
            file.write_text(json.dumps(data))
        self.stops = {self.eos, 2}  # the tokenizer's </s> ends a request too

    def expected(self, i: int) -> tuple[list[int], str]:
        tokens = self.runs[i][0]
        for n, t in enumerate(tokens):
            if t in self.stops:
                return tokens[: n + 1], "stop"
        return tokens, "length"

    def check(self, outs, logprobs: bool = False) -> float:
        """Tokens and finish reasons equal; returns the largest logprob difference."""
        worst = 0.0
        for i, out in enumerate(outs):
            completion = out.outputs[0]
            tokens, reason = self.expected(i)
            assert completion.token_ids == tokens, f"request {i}"
            assert completion.finish_reason == reason, f"request {i}"
            for step, tok in enumerate(tokens if logprobs else []):
                ours = completion.logprobs[step][tok].logprob
                worst = max(worst, abs(ours - self.runs[i][1][step][tok].item()))
        reasons = Counter(o.outputs[0].finish_reason for o in outs)
        assert reasons["stop"] and reasons["length"], reasons  # both endings seen
        return worst


def _checkpoint(path, overrides: dict) -> tuple[str, list[list[int]], Reference]:
    model = save_tiny_deepseek(path, **overrides)
    prompts = _prompts()
    return str(path), prompts, Reference(model, path, prompts)


@pytest.fixture(scope="module")
def q_lora(tmp_path_factory):
    """The first config's checkpoint and reference, shared by the tests that need one."""
    return _checkpoint(tmp_path_factory.mktemp("deepseek-q-lora"), CONFIGS["q_lora"])


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_and_logprobs_match_transformers(tmp_path, q_lora, name):
    path, prompts, ref = q_lora if name == "q_lora" else _checkpoint(tmp_path, CONFIGS[name])
    llm = LLM(model=path, num_kv_pages=40, max_num_batched_tokens=32, **RUN)
    queued = record_queued(llm.engine.runner)
    engine = llm.engine
    assert engine.layout.num_components == 1 and engine.layout.head_dim == 32 + 8
    assert engine.eos_token_ids == sorted(ref.stops)

    # the default configuration: pipelined decode, EOS endings
    ref.check(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW)))
    assert any(queued), "no decode step was queued ahead"
    assert engine.scheduler.num_preemptions > 0, "the run should have preempted"
    assert engine.kv.prefix_hit_tokens > 0, "the run should have hit the prefix cache"
    assert max(len(p) for p in prompts) > 32, "a prompt should need chunked prefill"

    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
    worst = ref.check(llm.generate(prompts, params, use_tqdm=False), logprobs=True)
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"


def test_prefix_cache_hit_keeps_parity(tmp_path):
    """A second request whose long prefix the first left in the cache computes only its
    tail, and attends over the cached latents decompressed."""
    model = save_tiny_deepseek(tmp_path, seed=1, rope_scaling=YARN)
    rng = random.Random(4)
    shared = [rng.randint(3, 500) for _ in range(45)]
    prompts = [shared + [7, 8, 9], shared + [rng.randint(3, 500) for _ in range(5)]]
    ref = Reference(model, tmp_path, prompts)
    llm = LLM(model=str(tmp_path), num_kv_pages=64, max_num_batched_tokens=64, **RUN)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert llm.engine.kv.prefix_hit_tokens >= 44  # all of the shared full pages
    assert llm.engine.metrics()["prefill_tokens_computed"] <= len(prompts[0]) + 5 + 4
    worst = 0.0
    for i, out in enumerate(outs):  # both endings need not occur in two requests
        tokens, reason = ref.expected(i)
        assert out.outputs[0].token_ids == tokens and out.outputs[0].finish_reason == reason
        for step, tok in enumerate(tokens):
            got = out.outputs[0].logprobs[step][tok].logprob
            worst = max(worst, abs(got - ref.runs[i][1][step][tok].item()))
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"


@pytest.mark.parametrize(
    "tier",
    [{}, {"decode_append": "layer", "batchgen_debug": True}],
    ids=["default", "layer_appends_debug"],
)
def test_host_tier_swaps_latent_pages(q_lora, tier):
    """A pool too small for the batch swaps latent pages to the host and back (the debug
    run reads every offloaded page back) and the outputs stay transformers'."""
    path, prompts, ref = q_lora
    llm = LLM(
        model=path,
        num_kv_pages=36,
        host_kv_size_gib=0.002,
        max_num_batched_tokens=48,
        **RUN,
        **tier,
    )
    ref.check(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW)))
    llm.engine.tier.drain()
    m = llm.engine.metrics()
    assert m["swaps_out"] > 0 and m["swaps_in"] > 0, m
    assert m["recomputes"] == 0
    if tier:
        assert m["readback_checks"] > 0


def test_refusals_name_what_is_missing(tmp_path):
    save_tiny_deepseek(tmp_path)
    source = ModelSource.resolve(tmp_path)
    gelu = tiny_config(hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        build_model(source, gelu, torch.float32, torch.device("cpu"), 64, "dummy")


def test_checkpoint_names(tmp_path):
    """Dense and MoE MLP names map to their parameters; multi-token-prediction layers
    (past num_hidden_layers) are skipped; a checkpoint missing experts is refused."""
    save_tiny_deepseek(tmp_path, first_k_dense_replace=1)
    source = ModelSource.resolve(tmp_path)
    config = source.load_config()
    model = build_model(source, config, torch.float32, torch.device("cpu"), 64)
    assert model.checkpoint_target("model.layers.2.self_attn.q_a_proj.weight") is None
    module, param, shard = model.checkpoint_target("model.layers.0.mlp.up_proj.weight")
    assert (module, param, shard) == (model.layers[0].mlp.gate_up_proj, "weight", "up")
    experts = model.layers[1].mlp.experts
    assert model.checkpoint_target("model.layers.1.mlp.experts.3.down_proj.weight") == (
        experts,
        "down_proj",
        "3.down",
    )
    with pytest.raises(KeyError):
        model.checkpoint_target("model.layers.1.mlp.up_proj.weight")  # an MoE layer
    weights = dict(source.weights(config))
    assert any(".mlp.experts.7.gate_proj." in n for n in weights)  # per-expert names
    from safetensors.torch import save_file

    (tmp_path / "model.safetensors").unlink()
    kept = {n: t for n, t in weights.items() if "experts.5.up_proj" not in n}
    save_file(kept, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"experts.gate_up_proj\[5.up\]"):
        build_model(source, config, torch.float32, torch.device("cpu"), 64)
    with pytest.raises(KeyError):
        model.checkpoint_target("model.layers.0.self_attn.k_proj.weight")


def test_fp8_checkpoint_equals_its_dequantized_weights(tmp_path):
    """DeepSeek-V3's own format: every projection (attention, dense and expert MLPs) as
    float8_e4m3fn with per-block scales loads as the same model as its dequantized
    weights."""
    from safetensors.torch import load_file, save_file
    from test_fp8_checkpoint import BLOCK, _quantize

    from batchgen.models import fp8

    quant, plain = tmp_path / "fp8", tmp_path / "plain"
    for d in (quant, plain):
        save_tiny_deepseek(d, **CONFIGS["moe_dense_first"])
    fp8_tensors, dequantized = {}, {}
    for name, t in load_file(str(quant / "model.safetensors")).items():
        if name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight"):
            q, scale = _quantize(t.float(), BLOCK)
            fp8_tensors[name], fp8_tensors[name + "_scale_inv"] = q, scale
            dequantized[name] = fp8.dequantize(q, scale, BLOCK).contiguous()
        else:
            fp8_tensors[name] = dequantized[name] = t
    assert sum(n.endswith("_scale_inv") for n in fp8_tensors) > 30  # experts included
    save_file(fp8_tensors, str(quant / "model.safetensors"))
    save_file(dequantized, str(plain / "model.safetensors"))
    config = json.loads((quant / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(BLOCK)}
    (quant / "config.json").write_text(json.dumps(config))
    prompts = _prompts(4)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    a = LLM(model=str(quant), num_kv_pages=64, **RUN).generate(prompts, params, use_tqdm=False)
    b = LLM(model=str(plain), num_kv_pages=64, **RUN).generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            for tid, entry in lx.items():
                assert entry.logprob == pytest.approx(ly[tid].logprob, abs=1e-6)

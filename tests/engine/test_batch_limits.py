"""max_num_seqs and max_num_batched_tokens left unset are set for the device when the
engine is built: 1024 rows and 16,384 tokens on a GPU of 70 GiB or more that is not an
A100 (vLLM's offline defaults there), 32,768 tokens there for a mixture-of-experts model,
fewer rows there for a model with linear-attention layers whose state slots would fill
more than an eighth of the GPU, 256 and 8,192 elsewhere; values given are kept. On the GPU, a default engine
decodes 700 requests in one captured step (a bucket above 512)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from conftest import save_tiny_model

from batchgen import LLM, SamplingParams
from batchgen.config import EngineConfig
from batchgen.engine.builder_plan import has_moe_layers, state_bytes_per_seq
from batchgen.engine.limits import DEFAULT_MAX_MODEL_LEN, max_model_len
from batchgen.runner.cuda_graphs import bucket_for

GIB = 2**30
MB = 10**6


def _on_gpu(monkeypatch, name: str, gib: float) -> torch.device:
    props = SimpleNamespace(name=name, total_memory=int(gib * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    return torch.device("cuda", 0)


@pytest.mark.parametrize(
    "name,gib,state_bytes,moe,want",
    [
        ("NVIDIA H200", 139.8, 0, False, (1024, 16384)),
        ("NVIDIA H100 80GB HBM3", 79.2, 0, False, (1024, 16384)),
        ("NVIDIA H200", 139.8, 0, True, (1024, 32768)),  # W4
        ("NVIDIA H200", 139.8, 1 * MB, False, (1024, 16384)),  # 1 GB of slots
        ("NVIDIA H200", 139.8, 19 * MB, True, (512, 32768)),  # W6: 1024 rows would take 20 GB
        ("NVIDIA H200", 139.8, 19 * MB, False, (512, 16384)),
        ("NVIDIA H200", 139.8, 42 * MB, True, (256, 32768)),  # Kimi-Linear-48B's size
        ("NVIDIA H200", 139.8, 400 * MB, False, (256, 16384)),  # never below the default's
        ("NVIDIA H100 80GB HBM3", 79.2, 19 * MB, False, (512, 16384)),
        ("NVIDIA A100-SXM4-80GB", 79.2, 0, False, (256, 8192)),
        ("NVIDIA A100-SXM4-80GB", 79.2, 0, True, (256, 8192)),  # small limits: no MoE rule
        ("NVIDIA L4", 22.0, 0, True, (256, 8192)),
        ("NVIDIA A10G", 69.9, 0, False, (256, 8192)),
    ],
)
def test_unset_limits_follow_the_gpu(monkeypatch, name, gib, state_bytes, moe, want):
    device = _on_gpu(monkeypatch, name, gib)
    config = EngineConfig().with_batch_limits(device, state_bytes, moe)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == want


def test_limits_given_are_kept_and_the_cpu_takes_the_small_ones(monkeypatch):
    cpu = EngineConfig().with_batch_limits(torch.device("cpu"), 19 * MB)
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (256, 8192)
    device = _on_gpu(monkeypatch, "NVIDIA H200", 139.8)
    one = EngineConfig(max_num_seqs=64).with_batch_limits(device)
    assert (one.max_num_seqs, one.max_num_batched_tokens) == (64, 16384)
    other = EngineConfig(max_num_batched_tokens=2048).with_batch_limits(device, 42 * MB, True)
    assert (other.max_num_seqs, other.max_num_batched_tokens) == (256, 2048)
    given = EngineConfig(max_num_seqs=8, max_num_batched_tokens=128)
    assert given.with_batch_limits(device) == given


@pytest.mark.parametrize("name", ["max_num_seqs", "max_num_batched_tokens"])
@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_limits_are_refused_by_name(name, bad):
    with pytest.raises(ValueError, match=name):
        EngineConfig(**{name: bad})


def test_max_model_len_is_the_models_context_or_less():
    stated = SimpleNamespace(max_position_embeddings=1024)
    assert max_model_len(EngineConfig(), stated) == 1024
    assert max_model_len(EngineConfig(max_model_len=1024), stated) == 1024
    assert max_model_len(EngineConfig(max_model_len=96), stated) == 96
    with pytest.raises(ValueError, match=r"^max_model_len=1025 is more than .* \(1024, "):
        max_model_len(EngineConfig(max_model_len=1025), stated)
    # a config that states no context length: the default, or what was asked
    assert max_model_len(EngineConfig(), SimpleNamespace()) == DEFAULT_MAX_MODEL_LEN
    assert max_model_len(EngineConfig(max_model_len=9000), SimpleNamespace()) == 9000


def test_a_hybrid_configs_state_bytes_come_from_its_linear_layers():
    w6_like = SimpleNamespace(
        layer_types=["full_attention"] + ["linear_attention"] * 3,
        linear_num_heads=16,
        linear_head_dim=128,
        linear_conv_kernel_dim=4,
    )
    # three layers of a float32 16x128x128 state and a 3-token window of q, k and v
    assert state_bytes_per_seq(w6_like) == 3 * (16 * 128 * 128 * 4 + 3 * 3 * 16 * 128 * 2)
    assert state_bytes_per_seq(SimpleNamespace(layer_types=["full_attention"] * 2)) == 0
    assert state_bytes_per_seq(SimpleNamespace(layer_types=None)) == 0
    assert state_bytes_per_seq(SimpleNamespace()) == 0


def test_moe_configs_are_told_from_dense_ones():
    from transformers import DeepseekV3Config, KimiLinearConfig, LlamaConfig

    assert has_moe_layers(DeepseekV3Config(n_routed_experts=8))
    assert has_moe_layers(KimiLinearConfig(num_experts=8))
    assert not has_moe_layers(KimiLinearConfig(num_experts=0))
    assert not has_moe_layers(LlamaConfig())


def test_an_engine_on_the_cpu_runs_with_the_small_limits(tmp_path):
    save_tiny_model(tmp_path, "Qwen3ForCausalLM")
    llm = LLM(model=str(tmp_path), device="cpu", page_size=4, max_model_len=64)
    config = llm.engine.config
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (256, 8192)
    assert llm.engine.scheduler.max_num_seqs == 256
    assert llm.engine.scheduler.max_num_batched_tokens == 8192
    outs = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) <= 3


def test_buckets_above_512_pad_by_at_most_a_quarter():
    assert bucket_for(513, 1024) == 640
    assert bucket_for(700, 1024) == 768
    assert bucket_for(1000, 1024) == 1024
    for n in range(257, 1025):
        assert n <= bucket_for(n, 1024) <= n * 1.25 + 1, n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_default_engine_on_the_gpu_decodes_700_rows_in_one_graph(tmp_path):
    """Defaults (pipelined decode, graphs, EOS on): the limits are the device's; 700
    requests admitted at once decode in the 768-row graph, step for step the same as
    unpipelined steps (identical outputs); then EOS and stop-string endings finish every
    request and leave every page free."""
    save_tiny_model(tmp_path, "Qwen3ForCausalLM")
    props = torch.cuda.get_device_properties(0)
    large = props.total_memory >= 70 * GIB and "A100" not in props.name
    if not large:
        pytest.skip(f"{props.name} takes the small limits")
    rng = random.Random(0)
    prompts = [[rng.randint(3, 500) for _ in range(rng.randint(4, 12))] for _ in range(700)]
    params = [
        SamplingParams(temperature=0, max_tokens=2 + i % 7, ignore_eos=True) for i in range(700)
    ]
    kw = dict(device="cuda", dtype="bfloat16", page_size=16, max_model_len=64, num_kv_pages=4096)
    runs, buckets = [], []
    for pipeline in (False, True):
        llm = LLM(model=str(tmp_path), pipeline_decode=pipeline, **kw)
        config = llm.engine.config
        assert (config.max_num_seqs, config.max_num_batched_tokens) == (1024, 16384)
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.max_bs == 1024
        seen: list[int] = []
        bucket = graphs.bucket
        graphs.bucket = lambda n, seen=seen, bucket=bucket: seen.append(bucket(n)) or seen[-1]
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
        buckets.append(seen)
        del llm
    assert all(768 in seen for seen in buckets), buckets
    differ = [i for i in range(700) if runs[0][i] != runs[1][i]]
    assert not differ, f"rows {differ}: {[(runs[0][i], runs[1][i]) for i in differ[:3]]}"
    llm = LLM(model=str(tmp_path), **kw)
    texts = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    stop = next(t.split()[1] for t in texts if len(t.split()) > 2)
    defaults = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    outs = llm.generate(prompts, defaults, use_tqdm=False)
    reasons = {o.outputs[0].finish_reason for o in outs}
    assert reasons <= {"stop", "length"} and "stop" in reasons, reasons
    assert llm.engine.kv.num_free_pages == llm.engine.kv.allocator.num_pages

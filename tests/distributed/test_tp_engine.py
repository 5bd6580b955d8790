"""The engine at tensor_parallel_size=2 (this process rank 0, one spawned gloo worker)
against tensor_parallel_size=1: the same greedy tokens, decode pipelined (rank 0's
samples reach the worker by a broadcast) and rows stopped by a token mid-pipeline; a dead
worker is an error."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_model

from batchgen import LLM, SamplingParams
from batchgen.config import EngineConfig
from batchgen.engine.tensor_parallel import check_supported

KW = dict(
    device="cpu",
    dtype="float32",
    num_kv_pages=48,
    max_model_len=64,
    page_size=4,
    max_num_batched_tokens=24,  # chunked prefills next to decodes
)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21], list(range(30, 49)), [7] * 5]


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_tp2_engine_equals_tp1_and_a_dead_worker_fails_the_next_step(tmp_path, arch):
    save_tiny_model(tmp_path, arch)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(tmp_path), **KW).generate(PROMPTS, params)]
    # the default ending: a token the pipeline cannot foresee stops a row mid-step
    stop = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[want[0][3]])
    want_stopped = [
        o.outputs[0].token_ids for o in LLM(str(tmp_path), **KW).generate(PROMPTS, stop)
    ]
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **KW)
    try:
        assert llm.engine.layout.num_kv_heads == 1  # 2 KV heads, one per rank
        launches = []  # rank 0's decode steps queued after the one still running
        launch = llm.engine.runner.launch_decode
        llm.engine.runner.launch_decode = lambda s, prev=None: (
            launches.append(prev is not None),
            launch(s, prev),
        )[1]
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert got == want
        assert all(len(t) == 8 for t in got)
        assert sum(launches) >= 4, "decode was not pipelined under tensor parallel"
        stopped = llm.generate(PROMPTS, stop, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in stopped] == want_stopped
        assert len(want_stopped[0]) == 4 and stopped[0].outputs[0].finish_reason == "stop"
        worker = llm.engine.tp_workers.processes[0]
        worker.kill()
        worker.join(10)
        with pytest.raises(RuntimeError, match=r"worker rank\(s\) \[1\] stopped responding"):
            llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert not torch.distributed.is_initialized()


def test_what_tensor_parallel_cannot_run_yet_is_named():
    config = EngineConfig(tensor_parallel_size=2, host_kv_size_gib=1.0, decode_append="layer")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .*decode_append='layer'"):
        check_supported(config, torch.device("cpu"))
    check_supported(EngineConfig(tensor_parallel_size=2, host_kv_size_gib=1.0), torch.device("cpu"))
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)


def test_tensor_parallel_on_gpus_needs_a_gpu_a_rank_and_eager_steps(monkeypatch):
    """On CUDA: a rank per GPU (NCCL refuses two ranks on one), and decode without
    graphs for now; a pool sized by the warm-up profile is planned across the ranks."""
    cuda = torch.device("cuda")
    eager = EngineConfig(tensor_parallel_size=2, enforce_eager=True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 GPUs, one a rank; 1"):
        check_supported(eager, cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_supported(eager, cuda)  # no num_kv_pages or kv_cache_size_gib: the plan sizes it
    with pytest.raises(ValueError, match=r"does not support CUDA graphs"):
        check_supported(EngineConfig(tensor_parallel_size=2), cuda)

"""The engine at tensor_parallel_size=2 (this process rank 0, one spawned gloo worker)
against tensor_parallel_size=1: the same greedy tokens, decode pipelined (rank 0's
samples reach the worker by a broadcast) and rows stopped by a token mid-pipeline; a dead
worker is an error."""

from __future__ import annotations

import signal
import time
from contextlib import nullcontext
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import save_tiny_model
from eager_graphs import install_eager_graphs

from batchgen import LLM, SamplingParams
from batchgen.config import EngineConfig
from batchgen.distributed.messages import Setup
from batchgen.engine.tensor_parallel import TPModelRunner, TPStep
from batchgen.engine.tp_peers import check_supported
from batchgen.engine.tp_worker import _Worker
from batchgen.layers.tp_group import SINGLE
from batchgen.runner.batch import NewRequest, ScheduledRequest, SchedulerOutput
from batchgen.runner.cuda_graphs import DecodeGraphs

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
        llm.engine.runner.launch_decode = lambda s, prev=None, *copies: (
            launches.append(prev is not None),
            launch(s, prev, *copies),
        )[1]
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert got == want
        assert all(len(t) == 8 for t in got)
        assert sum(launches) >= 4, "decode was not pipelined under tensor parallel"
        stopped = llm.generate(PROMPTS, stop, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in stopped] == want_stopped
        assert len(want_stopped[0]) == 4 and stopped[0].outputs[0].finish_reason == "stop"
        workers = llm.engine.executor
        assert workers.exited == {}
        workers.processes[0].kill()
        workers.processes[0].join(10)
        deadline = time.monotonic() + 10
        while not workers.exited and time.monotonic() < deadline:
            time.sleep(0.05)
        assert workers.exited == {1: -signal.SIGKILL}  # the watcher saw it end
        with pytest.raises(
            RuntimeError, match=r"worker rank\(s\) \[1\] stopped responding.* 1: -9"
        ):
            llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert not torch.distributed.is_initialized()


def test_a_worker_killed_mid_step_fails_the_call_naming_it(tmp_path):
    """Killed once a decode step is on its way to it: rank 0's collective in that step
    fails (gloo: the connection resets) and the error names the worker, as NCCL's abort
    on a GPU makes it do (test_tp_gpu.py)."""
    save_tiny_model(tmp_path, "LlamaForCausalLM")
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **KW)
    workers = llm.engine.executor
    send, sent = workers.send, []

    def send_then_kill(message):
        send(message)
        sent.append(message)
        if len(sent) == 6:
            workers.processes[0].kill()

    workers.send = send_then_kill
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    try:
        with pytest.raises(RuntimeError, match=r"worker rank\(s\) \[1\] stopped responding"):
            llm.generate(PROMPTS, params, use_tqdm=False)
        assert isinstance(sent[5], TPStep) and sent[5].sched is not None
    finally:
        workers.send = send
        llm.engine.shutdown()


def test_a_worker_that_ends_at_shutdown_is_not_reported_dead(tmp_path):
    save_tiny_model(tmp_path, "LlamaForCausalLM")
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **KW)
    workers = llm.engine.executor
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    llm.engine.shutdown()
    workers._watcher.join(10)
    assert not workers._watcher.is_alive()
    assert workers.exited == {} and workers.processes[0].exitcode == 0


def test_tensor_parallel_size_must_be_positive():
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)


def test_tensor_parallel_on_gpus_needs_a_gpu_a_rank(monkeypatch):
    """On CUDA: a rank per GPU (NCCL refuses two ranks on one); the defaults (decode
    graphs, a pool sized by the warm-up profile, planned across the ranks) run."""
    cuda = torch.device("cuda")
    config = EngineConfig(tensor_parallel_size=2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 GPUs, one a rank; 1"):
        check_supported(config, cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_supported(config, cuda)
    check_supported(EngineConfig(tensor_parallel_size=2, enforce_eager=True), cuda)


GRAPH_RUN = dict(max_num_seqs=4, max_model_len=64, page_size=4)


def test_each_step_tells_the_workers_whether_rank_0_replays_a_graph(tmp_path):
    """Rank 0's runner with decode graphs (replayed eagerly on the CPU) and stand-in
    workers: every step's TPStep.graph is what rank 0's forward then did, so a worker
    replays exactly when rank 0 does (their captured collectives pair). A worker that
    ended while a pipelined step ran fails the step once its tokens are read back."""
    save_tiny_model(tmp_path, "LlamaForCausalLM")
    llm = LLM(
        str(tmp_path),
        device="cpu",
        dtype="float32",
        attention_backend="triton",
        num_kv_pages=48,
        **GRAPH_RUN,
    )
    params = SamplingParams(temperature=0, max_tokens=6)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    replays = install_eager_graphs(llm, GRAPH_RUN)
    sent, ended = [], []

    def check():
        if ended:
            raise RuntimeError("worker rank(s) [1] stopped responding")

    runner = llm.engine.runner
    runner.__class__ = TPModelRunner  # rank 0 of a group whose workers are stand-ins
    runner.workers = SimpleNamespace(
        send=sent.append,
        check=check,
        failures_named=nullcontext,
        # one rank: the pipelined step's input tokens are rank 0's own already
        tp=SINGLE,
    )
    runner.take_copies = list
    # as the builder makes a group's step loop: prefilling steps are not launched ahead
    llm.engine.overlap.launch_steps = False
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    steps = [m for m in sent if isinstance(m, TPStep)]
    assert len(steps) == len(sent)
    told = [s.graph for s in steps]
    assert sum(told) == len(replays) > 0, (told, replays)
    assert not all(told)  # the prefill steps run eagerly on every rank
    for s in steps:
        decode = all(len(r.new_token_ids) == 1 for r in s.sched.requests)
        assert s.graph == decode, s.sched.requests
    assert any(s.pipelined and s.graph for s in steps)

    sent.clear()
    send = runner.workers.send
    # the worker ends once the first decode step is queued behind another
    runner.workers.send = lambda m: (send(m), m.pipelined and ended.append(True))
    with pytest.raises(RuntimeError, match="stopped responding") as raised:
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert any(entry.name == "result" for entry in raised.traceback)  # InFlightDecode's


def test_a_worker_builds_graphs_only_when_rank_0_replays_them(tmp_path):
    """The setup message says whether rank 0 captures decode graphs; a worker builds its
    own then (captured under its tier mirror's copy pause), none otherwise, and one told
    to replay with none raises instead of running collectives rank 0's do not pair."""
    save_tiny_model(tmp_path, "LlamaForCausalLM")
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", num_kv_pages=16, **GRAPH_RUN)
    engine = llm.engine
    config = replace(engine.config, host_kv_size_gib=0.01)
    setup = dict(
        num_pages=16,
        host_pages=8,
        host_state_slots=0,
        eos_token_ids=tuple(engine.eos_token_ids),
        attention_backend="triton",
    )
    on = _Worker(config, engine.model, engine.hf_config, engine.device, engine.dtype, SINGLE)
    on.handle(Setup(**setup, graphs=True))
    assert isinstance(on.runner.graphs, DecodeGraphs)
    assert on.runner.graphs.capture_guard == on.mirror.copies.paused
    ptrs = [[t.data_ptr() for t in layer] for layer in on.pool.layer_caches()]
    assert [[t.data_ptr() for t in layer] for layer in on.runner.graphs.kv_caches] == ptrs
    assert on.runner.graphs.max_bs == GRAPH_RUN["max_num_seqs"]
    off = _Worker(config, engine.model, engine.hf_config, engine.device, engine.dtype, SINGLE)
    off.handle(Setup(**setup, graphs=False))
    assert off.runner.graphs is None
    new = NewRequest(SamplingParams(), [1, 2, 3], [])
    decode = SchedulerOutput([ScheduledRequest("r", [5], 3, [0], True, new=new)])
    with pytest.raises(RuntimeError, match="told to replay a decode CUDA graph"):
        off.handle(TPStep(decode, [], graph=True))
    for worker in (on, off):
        worker.mirror.copies.close()


def test_rank_0_refuses_to_launch_a_step_its_workers_would_not_run():
    """A prefill (or eager decode) step launched on rank 0 alone would leave the workers'
    collectives unpaired: launch_step hands graph decode steps to launch_decode (mirrored)
    and raises for any other."""
    decode = SchedulerOutput([ScheduledRequest("r", [5], 3, [0], True)])
    launched = []
    rank0 = SimpleNamespace(
        _graph_ok=lambda sched, copies: graph,
        launch_decode=lambda sched, prev, copies: launched.append(sched) or "flight",
    )
    graph = True
    assert TPModelRunner.launch_step(rank0, decode) == "flight" and launched == [decode]
    graph = False
    with pytest.raises(RuntimeError, match="launches decode steps only"):
        TPModelRunner.launch_step(rank0, decode)
    assert launched == [decode]

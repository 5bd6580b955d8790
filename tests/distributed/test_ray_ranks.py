"""One engine across the nodes of a Ray cluster (distributed_executor_backend="ray"):
ranks 1..N-1 are Ray actors of a placement group, rank 0 this process. A local cluster
of two logical nodes of two CPUs each (ray.cluster_utils.Cluster), one of this node's
held by an actor but for the four-rank test, so a group of two ranks spans both nodes
and one of four takes two ranks on each; gloo between them. Tensor parallel and attention data parallel with
expert parallel on a tiny DeepSeek-V3 give one process's greedy tokens; a rank whose
actor is killed mid-decode fails the call within 60 s naming it and its node; a batch
job cut short that way resumes on the rerun (`batchgen run --distributed-executor-backend
ray`). Not covered here: GPUs (NCCL, rank 0's GPU held by its bundle) and real hosts."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import ray
import torch
from batch_files import read_answers, write_chat_batch
from deepseek_ranks import (
    GREEDY,
    KW,
    add_long_requests,
    generated,
    mixed_params,
    one_process,
    save_with_emitted_eos,
    shared_head_prompts,
)
from kimi_ranks import KW as KIMI_KW
from kimi_ranks import kimi_params, kimi_prompts
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tp_workers import DiesWhileStarting, fails_once_joined, never_called

from batchgen import LLM, SamplingParams
from batchgen.api.batch_job import JobOptions, run_batch_job
from batchgen.api.cli import main
from batchgen.config import EngineConfig
from batchgen.distributed.messages import PlanBegin
from batchgen.distributed.ray_ranks import RayRanks, local_index
from batchgen.distributed.workers import Workers, WorkerStartError

RAY = dict(distributed_executor_backend="ray")
TP2 = dict(tensor_parallel_size=2)
DP2 = dict(data_parallel_size=2, enable_expert_parallel=True)


HELD = "batchgen-test-head-cpu"  # the actor holding one of this node's two CPUs


@ray.remote(num_cpus=1)
class _HoldsACpu:
    def ready(self) -> bool:
        return True


def _hold_a_cpu_here() -> None:
    """An actor on this node takes one of its CPUs: a group of two ranks ({CPU: 1} a
    bundle, rank 0's here) then finds one free CPU here and puts rank 1 on the other
    node."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    # detached: held without a handle, until killed or the cluster ends
    options = dict(name=HELD, lifetime="detached", scheduling_strategy=here)
    holder = _HoldsACpu.options(**options).remote()
    ray.get(holder.ready.remote())


@pytest.fixture(scope="module")
def cluster():
    """Two logical nodes of two CPUs each, one of this node's held (_hold_a_cpu_here):
    rank 0's bundle (this node) and rank 1's land on different nodes."""
    if ray.is_initialized():
        ray.shutdown()
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    nodes.add_node(num_cpus=2)
    # the actors import what this process does (the tests' helpers too), as spawned
    # processes do: they get the parent's sys.path
    paths = {"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}}
    ray.init(address=nodes.address, include_dashboard=False, runtime_env=paths)
    nodes.wait_for_nodes()
    _hold_a_cpu_here()
    yield nodes
    ray.shutdown()
    nodes.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_with_emitted_eos(tmp_path_factory.mktemp("deepseek_ray"))


@pytest.fixture(scope="module")
def greedy(checkpoint) -> tuple[list[list[int]], list]:
    """Eight prompts and one process's greedy rows for them (each layout's test compares
    with the same run)."""
    prompts = shared_head_prompts(8)
    return prompts, one_process(checkpoint, prompts, GREEDY)


@pytest.fixture(scope="module")
def batch_file(checkpoint, tmp_path_factory) -> tuple[Path, dict]:
    """A chat batch file of 12 lines and one process's answers to it (`batchgen run`)."""
    folder = tmp_path_factory.mktemp("batch")
    inp = write_chat_batch(folder / "in.jsonl", 12, max_tokens=24)
    assert _run(checkpoint, inp, folder / "one.jsonl") == 0
    return inp, read_answers(folder / "one.jsonl")


def _workers(llm: LLM):
    engine = llm.engine
    return engine.workers if hasattr(engine, "workers") else engine.executor


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [TP2, DP2], ids=["tp2", "dp2_ep2"])
def test_ranks_on_two_nodes_give_one_processs_tokens(cluster, checkpoint, greedy, parallel):
    prompts, want = greedy
    llm = LLM(checkpoint, **KW, **parallel, **RAY)
    try:
        ranks = _workers(llm).ranks
        assert isinstance(ranks, RayRanks)
        here = ray.get_runtime_context().get_node_id()
        assert ranks.nodes[1][1] != here  # rank 1's actor on the other node
        got = generated(llm, prompts, GREEDY)
        moe = llm.engine.model.layers[1].mlp  # rank 0's share of the experts
    finally:
        llm.engine.shutdown()
    assert got == want
    assert {r for _, r in got} == {"stop", "length"}
    assert moe.experts.local_experts == range(0, 4)
    assert ray.util.placement_group_table() == {} or all(
        g["state"] == "REMOVED" for g in ray.util.placement_group_table().values()
    )


@pytest.mark.slow
def test_a_rank_that_cannot_start_fails_the_start_naming_it_and_its_node(cluster):
    started = time.monotonic()
    with pytest.raises(WorkerStartError, match=r"rank\(s\) \[1\] exited while starting") as e:
        Workers.spawn(never_called, (DiesWhileStarting(),), 2, "gloo", launcher="ray")
    assert time.monotonic() - started < 60
    assert "1 on node" in str(e.value) and "batchgen and the model's files" in str(e.value)
    assert not torch.distributed.is_initialized()  # rank 0 never entered the rendezvous


@pytest.mark.slow
def test_a_rank_that_fails_once_joined_is_named_with_its_error(cluster):
    workers = Workers.spawn(fails_once_joined, (), 2, "gloo", launcher="ray")
    try:
        deadline = time.monotonic() + 60
        while not workers.exited and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] stopped responding") as e:
            workers.send(PlanBegin())
        assert "raised RuntimeError('rank 1 could not build its share')" in str(e.value)
    finally:
        workers.shutdown()
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_four_ranks_two_on_each_of_two_nodes_give_one_processs_tokens(cluster, checkpoint):
    """Attention data parallel 4 with expert parallel 4 (two routed experts a rank), this
    node's held CPU freed: ranks 0 and 1 on this node, 2 and 3 on the other; greedy,
    seeded and unseeded sampled rows draw one process's tokens."""
    prompts, params = shared_head_prompts(8), mixed_params(8)
    want = one_process(checkpoint, prompts, params)
    ray.kill(ray.get_actor(HELD))
    try:
        llm = LLM(checkpoint, **KW, data_parallel_size=4, enable_expert_parallel=True, **RAY)
        try:
            nodes = [node for _, node in llm.engine.workers.ranks.nodes.values()]
            got = generated(llm, prompts, params)
            moe = llm.engine.model.layers[1].mlp
            ranks = llm.engine.rank_metrics()
        finally:
            llm.engine.shutdown()
    finally:
        _hold_a_cpu_here()
    assert got == want
    here = ray.get_runtime_context().get_node_id()
    assert sorted(Counter([here, *nodes]).values()) == [2, 2]  # two nodes, two ranks each
    assert moe.experts.local_experts == range(0, 2)
    assert [m["prompt_tokens"] > 0 for m in ranks] == [True] * 4


@pytest.mark.slow
def test_kimi_linear_ranks_swapping_to_their_host_tiers_give_one_processs_tokens(cluster, tmp_path):
    """Kimi Linear (KDA + MLA + MoE), attention data parallel 2 with expert parallel 2 on
    two nodes, pools too small for either rank's share: each rank swaps its latent pages
    and state slots to its own host tier and back; greedy and sampled rows draw one
    process's tokens."""
    pytest.importorskip("transformers.models.kimi_linear")
    from kimi_checkpoints import save_tiny_kimi

    save_tiny_kimi(tmp_path, layer_types=["linear_attention"] * 3 + ["full_attention"])
    prompts, params = kimi_prompts(), kimi_params()
    kw = dict(KIMI_KW, max_model_len=128)
    one = LLM(str(tmp_path), **kw, num_kv_pages=400)
    try:
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    finally:
        one.engine.shutdown()
    llm = LLM(str(tmp_path), **kw, num_kv_pages=32, host_kv_size_gib=0.002, **DP2, **RAY)
    try:
        assert llm.engine.workers.ranks.nodes[1][1] != ray.get_runtime_context().get_node_id()
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        ranks = llm.engine.rank_metrics()
    finally:
        llm.engine.shutdown()
    assert got == want
    assert [m["swaps_out"] > 0 and m["swaps_in"] > 0 for m in ranks] == [True, True], ranks


@pytest.mark.slow
def test_a_rank_killed_mid_decode_fails_the_call_naming_it_and_its_node(cluster, checkpoint):
    llm = LLM(checkpoint, **KW, **DP2, **RAY)
    try:
        engine = llm.engine
        add_long_requests(engine)
        engine.step()
        ranks = engine.workers.ranks
        ip, actor = ranks.nodes[1][0], ranks.actors[0]
        killed = []
        kill = threading.Timer(1.0, lambda: killed.append(time.monotonic()) or ray.kill(actor))
        kill.start()
        name = r"data-parallel worker rank\(s\) \[1\] stopped responding: "
        pattern = name + rf".*1 on node {re.escape(ip)}"
        more = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        rounds = 0
        with pytest.raises(RuntimeError, match=pattern) as e:
            while engine.has_unfinished or not killed:
                if not engine.has_unfinished:  # done before the kill landed: more of the same
                    rounds += 1
                    for i, ids in enumerate(shared_head_prompts(4)):
                        engine.add_request(f"more{rounds}-{i}", ids, more)
                engine.step()
        assert killed and time.monotonic() - killed[0] < 60
        assert "ray.kill" in str(e.value)  # what ended the actor, as Ray tells it
    finally:
        llm.engine.shutdown()


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _run(model: str, inp: Path, out: Path, *extra: str) -> int:
    argv = ["run", str(inp), "-o", str(out), "--model", model, "--device", "cpu"]
    return main(
        [*argv, "--dtype", "float32", "--max-model-len", "128", "--temperature", "0", *extra]
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel, role, flags",
    [
        (TP2, "tensor-parallel", ("--tp", "2")),
        (DP2, "data-parallel", ("--data-parallel", "2", "--enable-expert-parallel")),
    ],
    ids=["tp2", "dp2_ep2"],
)
def test_a_batch_job_cut_short_by_a_dead_rank_resumes_on_the_rerun(
    cluster, checkpoint, batch_file, tmp_path, parallel, role, flags
):
    """A job under tensor parallel, or attention data parallel with expert parallel,
    over Ray whose worker's actor is killed once some answers are written fails; the
    same job rerun through `batchgen run` with the same layout and
    `--distributed-executor-backend ray` writes the rest, every answer one process's."""
    inp, one = batch_file
    out = tmp_path / "out.jsonl"
    llm = LLM(checkpoint, **dict(KW, max_num_seqs=2), **parallel, **RAY)
    ranks = _workers(llm).ranks

    def kill_once_answers_are_written() -> None:
        deadline = time.monotonic() + 120
        while _lines(out) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        ray.kill(ranks.actors[0])

    killer = threading.Thread(target=kill_once_answers_are_written)
    killer.start()
    defaults = {"temperature": 0.0, "top_p": 1.0}  # as the CLI's flags give them
    opts = JobOptions(inp, out, Path(checkpoint).name, defaults=defaults, progress=False)
    try:
        with pytest.raises(RuntimeError, match=role + r" worker rank\(s\) \[1\]"):
            run_batch_job(llm, opts)
    finally:
        killer.join()
        llm.engine.shutdown()
    written = _lines(out)
    assert 2 <= written < 12
    ray_flags = (*flags, "--distributed-executor-backend", "ray")
    assert _run(checkpoint, inp, out, *ray_flags) == 0
    assert read_answers(out) == one
    assert _lines(out) == 12  # each line once: the rerun wrote only what was missing


@pytest.mark.slow
def test_a_lost_node_fails_the_call_naming_the_rank_on_it(cluster, checkpoint):
    """The node rank 1 runs on goes (its raylet and processes with it): the next steps
    fail within 60 s, naming rank 1, its node and that the node died."""
    llm = LLM(checkpoint, **KW, **TP2, **RAY)
    try:
        engine = llm.engine
        add_long_requests(engine)
        engine.step()
        (node,) = cluster.worker_nodes
        lost = time.monotonic()
        cluster.remove_node(node)
        with pytest.raises(RuntimeError, match=r"worker rank\(s\) \[1\] stopped") as e:
            while engine.has_unfinished:
                engine.step()
        assert time.monotonic() - lost < 60
        assert "its node has died" in str(e.value)
    finally:
        llm.engine.shutdown()
        cluster.add_node(num_cpus=2)  # two nodes again for any test after this one
        cluster.wait_for_nodes()


def test_the_launcher_is_one_of_mp_and_ray():
    assert EngineConfig().distributed_executor_backend == "mp"
    with pytest.raises(ValueError, match="distributed_executor_backend must be 'mp' or 'ray'"):
        EngineConfig(distributed_executor_backend="slurm")


def test_ray_data_parallel_engines_refuse_the_ray_launcher(tmp_path, caplog):
    """Ray data parallel's engines (no --enable-expert-parallel) start their own ranks:
    the option that spreads one engine's ranks over Ray is refused before anything runs."""
    inp = write_chat_batch(tmp_path / "in.jsonl", 1, max_tokens=24)
    flags = ("--data-parallel-size", "2", "--distributed-executor-backend", "ray")
    assert _run(str(tmp_path / "none"), inp, tmp_path / "out.jsonl", *flags) == 2
    assert "with --data-parallel it needs --enable-expert-parallel" in caplog.text
    assert not (tmp_path / "out.jsonl").exists()


def test_rank_0_runs_on_the_gpu_its_bundle_holds_as_this_process_numbers_it():
    assert local_index("3", "") == 3  # every GPU visible: Ray's ids are torch's
    assert local_index("6", "4,6,7") == 1  # Ray numbers them as CUDA_VISIBLE_DEVICES lists
    with pytest.raises(RuntimeError, match="does not see"):
        local_index("2", "4,6")


def test_the_host_tier_budget_counts_the_ranks_this_host_runs(monkeypatch):
    """A host tier's pre-check counts the ranks on this host: every one under "mp";
    under Ray on GPUs at most this host's GPUs (16 ranks over two hosts of 8 check 8)."""
    from batchgen.engine.builder_load import ranks_here

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    gpus = EngineConfig(device="cuda")
    assert ranks_here(gpus, 16) == 16
    assert ranks_here(EngineConfig(device="cuda", **RAY), 16) == 8
    assert ranks_here(EngineConfig(device="cuda", **RAY), 4) == 4
    assert ranks_here(EngineConfig(device="cpu", **RAY), 16) == 16  # a local test cluster


def test_run_takes_vllms_names_for_the_parallel_flags():
    from batchgen.api.cli import build_parser

    argv = ["run", "in.jsonl", "-o", "out.jsonl", "-tp", "2", "--enable-expert-parallel"]
    args = build_parser().parse_args([*argv, "--data-parallel-size", "2"])
    assert (args.tp, args.data_parallel, args.distributed_executor_backend) == (2, 2, "mp")
    args = build_parser().parse_args(
        [*argv, "-dp", "4", "--tensor-parallel-size", "1", "--distributed-executor-backend", "ray"]
    )
    assert (args.tp, args.data_parallel, args.distributed_executor_backend) == (1, 4, "ray")

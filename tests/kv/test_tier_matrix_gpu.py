"""The host-tier matrix on the GPU (bf16, Triton attention): tier on x CUDA graphs
{on (default), enforce_eager} x pipelined decode {on, off} x decode_append {off, batched,
layer}, debug off, the mixed-endings batch of tier_workload.py. Rows are compared with
the tier-off run under the logprob-closeness rule (batchgen.eval.closeness): identical,
close (at the first differing token both tokens are in the top-5 of a tier-off scoring
pass of prompt + common prefix) or broken; none may break. Plus the reported crash:
decode graphs captured lazily while the copy worker issues write-through stores.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch
from conftest import record_queued
from parity import top5_after
from tier_workload import (
    KINDS,
    assert_nothing_held,
    build,
    endings,
    rows,
    spy_finishes,
)

from batchgen import LLM
from batchgen.eval.closeness import close_under_top5

pytestmark = pytest.mark.gpu

GPU = dict(
    device="cuda",
    dtype="bfloat16",
    attention_backend="triton",
    page_size=4,
    max_model_len=160,
    max_num_batched_tokens=48,
    max_num_seqs=32,  # 7 graph buckets per engine
)
TIER = dict(num_kv_pages=40, host_kv_size_gib=0.02)
ROWS = (
    [  # the first row is the default configuration (copies issued by the asking thread)
        pytest.param(graphs, pipeline, append, "inline", "copy", id=f"{g}-{p}-append-{append}")
        for graphs, g in ((True, "graphs"), (False, "eager"))
        for pipeline, p in ((True, "pipelined"), (False, "plain"))
        for append in ("off", "batched", "layer")
    ]
    + [  # copies issued by the copy worker
        pytest.param(
            True, True, append, "worker", "copy", id=f"graphs-pipelined-append-{append}-worker"
        )
        for append in ("off", "layer")
    ]
    + [  # loads scattered on the compute stream (tier_load_scatter="compute")
        pytest.param(
            graphs, True, append, "inline", "compute", id=f"{g}-pipelined-append-{append}-compute"
        )
        for graphs, g in ((True, "graphs"), (False, "eager"))
        for append in ("off", "layer")
    ]
)


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    """The model, prompts, params, the tier-off reference rows and the tier-off engine
    (kept for scoring passes)."""
    path, prompts, params = build(tmp_path_factory, num_kv_pages=600, **GPU)
    ref = LLM(model=path, num_kv_pages=600, **GPU)
    reference = rows(ref.generate(prompts, params, use_tqdm=False))
    counts = endings(reference)
    assert all(counts[k] >= 1 for k in KINDS), f"the workload lost an ending kind: {counts}"
    return path, prompts, params, reference, ref


def _classify(ref: LLM, prompt: list[int], params, got: tuple, want: tuple) -> str:
    """identical, close or broken under the closeness rule, endings included (a row equal
    in tokens must be equal in everything: finish and stop reasons, text)."""
    if got == want:
        return "identical"
    a, b = got[0], want[0]
    if a == b:
        return "broken"

    def top5(i: int) -> list[int]:
        return top5_after(ref, prompt, a, i)

    eos = {*ref.engine.eos_token_ids, *params.stop_token_ids}
    ends = dict(a_finish=got[1], b_finish=want[1], eos_ids=eos)
    return "close" if close_under_top5(a, b, top5, top5, **ends) else "broken"


def _judge(ref, prompts, params, got, reference) -> tuple[Counter, list]:
    rows_ = zip(prompts, params, got, reference, strict=True)
    verdicts = [_classify(ref, *row) for row in rows_]
    broken = [(i, got[i], reference[i]) for i, v in enumerate(verdicts) if v == "broken"]
    return Counter(verdicts), broken


@pytest.mark.parametrize("graphs,pipeline,decode_append,copy_issue,scatter", ROWS)
def test_mixed_endings_close_to_tier_off(
    workload, graphs, pipeline, decode_append, copy_issue, scatter
):
    path, prompts, params, reference, ref = workload
    llm = LLM(
        model=path,
        enforce_eager=not graphs,
        pipeline_decode=pipeline,
        decode_append=decode_append,
        tier_copy_issue=copy_issue,
        tier_load_scatter=scatter,
        **TIER,
        **GPU,
    )
    launches = record_queued(llm.engine.runner)
    finishes = spy_finishes(llm.engine)
    counts, broken = _judge(
        ref, prompts, params, rows(llm.generate(prompts, params, use_tqdm=False)), reference
    )
    m = llm.engine.metrics()
    assert_nothing_held(llm.engine)
    # again: the prompts' pages are gone from the device and come back from host
    again, broken2 = _judge(
        ref, prompts, params, rows(llm.generate(prompts, params, use_tqdm=False)), reference
    )
    counts += again
    msg = f"{dict(counts)} of {2 * len(prompts)} rows; broken: {(broken + broken2)[:2]}"
    assert counts["broken"] == 0, msg
    assert m["swaps_out"] > 0 and m["swaps_in"] > 0, m
    hits = llm.engine.metrics()["host_prefix_hit_pages"]
    assert hits > m["host_prefix_hit_pages"], "no host prefix hit in the second call"
    assert_nothing_held(llm.engine)
    runner = llm.engine.runner
    if not graphs:
        assert runner.graphs is None
    else:
        # decode_append="layer" hooks only the steps that fill a page: others replay
        assert runner.graphs.graphs, f"decode_append={decode_append!r}: no graph replayed"
    if not pipeline:
        assert not launches, "pipeline_decode=False launched a pipelined decode step"
        return
    assert sum(launches) > 0, f"decode_append={decode_append!r}: no decode step was queued"
    assert sum(finishes.values()) > 0, "no request ended by a stop while a step was queued"


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "plain"])
@pytest.mark.parametrize("decode_append", ["off", "batched"])
def test_graphs_captured_while_stores_are_issued(workload, pipeline, decode_append):
    """The reported crash: the first decode step captures the graphs lazily right after
    a prefill whose write-through stores are queued. The copy worker is held back and
    let go from inside the capture, so it issues those copies while the stream captures
    (the worst case of the real race); generate() must complete with sound rows, and
    again after reconfigure() re-captures. A fix that drains copies before capturing
    passes too (the hold then times out after 2 s)."""
    path, prompts, params, reference, ref = workload
    llm = LLM(
        model=path,
        pipeline_decode=pipeline,
        decode_append=decode_append,
        host_kv_size_gib=0.02,
        tier_copy_issue="worker",  # the race needs a second thread issuing copies
        **{**GPU, "num_kv_pages": 600, "max_num_batched_tokens": 2048},  # one prefill step
    )
    engine = llm.engine
    graphs = engine.runner.graphs
    hold = threading.Event()
    engine.tier.copies.submit("hold", 0, lambda h: hold.wait(2.0))  # later copies queue
    forward, stored_before_capture = graphs._forward, []

    def forward_releasing_copies(bs: int) -> None:
        if torch.cuda.is_current_stream_capturing() and not hold.is_set():
            stored_before_capture.append(engine.tier.metrics.pages_offloaded)
            hold.set()  # the worker now issues the queued stores, mid-capture
            time.sleep(0.05)
        forward(bs)

    graphs._forward = forward_releasing_copies
    captured_up_front = bool(graphs.graphs)  # a fix may capture before any copy exists
    got = rows(llm.generate(prompts, params, use_tqdm=False))
    assert graphs.graphs, "the decode graphs were never captured"
    if not captured_up_front and decode_append != "off":  # "off" stores only on eviction
        assert stored_before_capture and stored_before_capture[0] > 0, stored_before_capture
    counts, broken = _judge(ref, prompts, params, got, reference)
    assert counts["broken"] == 0, f"{dict(counts)}; broken: {broken[:2]}"
    assert_nothing_held(engine)
    # reconfigure() drops the graphs; they are captured again, lazily, while this call's
    # host prefix loads and write-through stores are in flight (natural timing)
    engine.reconfigure(600)
    got = rows(llm.generate(prompts, params, use_tqdm=False))
    assert graphs.graphs
    if decode_append == "batched":  # "off" keeps on host only pages wanted or shared
        assert engine.metrics()["host_prefix_hit_pages"] > 0
    counts, broken = _judge(ref, prompts, params, got, reference)
    assert counts["broken"] == 0, f"after reconfigure(): {dict(counts)}; broken: {broken[:2]}"
    assert_nothing_held(engine)


def _kernel_streams(prof, path) -> Counter:
    """Kernels a profiled region ran, counted by the CUDA stream they ran on."""
    import json

    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    return Counter(e["args"]["stream"] for e in events if e.get("cat") == "kernel")


@pytest.mark.parametrize("decode_append", ["off", "batched"])
@pytest.mark.parametrize("scatter", ["copy", "compute"])
def test_which_streams_run_the_tiers_kernels(workload, scatter, decode_append, tmp_path):
    """tier_load_scatter="compute" promises that the page tier runs no kernel on a copy
    stream (on an H200 one kernel on a second stream slowed every later decode replay
    ~3%): with it, a call whose pages come back from host (loads) and, with
    decode_append="batched", are written through runs every kernel on one stream; with
    "copy" the loads' scatters run on a copy stream. The graphs are captured (on their
    own stream) by a first call, before the profiled one. The profiled call's prompts
    extend the first call's: their first pages come back from host, and the pages of
    the new tails and outputs are new, so "batched" writes them through."""
    path, prompts, params, _, _ = workload
    llm = LLM(model=path, decode_append=decode_append, tier_load_scatter=scatter, **TIER, **GPU)
    llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.runner.graphs.graphs
    before = llm.engine.metrics()
    longer = [p + [300 + i, 301 + i, 302 + i, 303 + i] * 2 for i, p in enumerate(prompts)]
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        llm.generate(longer, params, use_tqdm=False)
        llm.engine.tier.drain()
        torch.cuda.synchronize()
    after = llm.engine.metrics()
    loaded = after["pages_loaded"] - before["pages_loaded"]
    assert loaded > 0, "the profiled call loaded nothing from host"
    if decode_append == "batched":
        assert after["pages_offloaded"] > before["pages_offloaded"]
    streams = _kernel_streams(prof, tmp_path / "trace.json")
    if scatter == "compute":
        assert len(streams) == 1, f"kernels by stream: {dict(streams)}"
    else:
        assert len(streams) >= 2, f"kernels by stream: {dict(streams)}"

"""benchmarks/mla.py --small: the W4 script end to end on the CPU, peer included."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load, rate_of, run_timed


def test_small_run_writes_its_result(tmp_path):
    mla = load("mla")
    out = tmp_path / "out"
    argv = ["--small", "--out", str(out), "--ckpt", str(tmp_path / "config")]
    elapsed = run_timed(mla, argv)
    result = json.loads((out / "mla.json").read_text())
    ours, peer = result["batchgen"], result["peer"]
    assert ours["steps"] > 0 and 0 < ours["prefill_phase_s"] <= ours["wall_s"]
    # both timed runs ran one after the other inside the script's call
    assert ours["wall_s"] + peer["wall_s"] < elapsed
    want = rate_of(ours, 6 * 6, elapsed) / rate_of(peer, 6 * 6, elapsed)
    assert result["ratio"] == pytest.approx(want)
    assert ours["allocator"] is None  # the allocator counters are CUDA's


def test_peer_warms_up_on_two_tokens_then_times_whole_batches(tmp_path, monkeypatch):
    """The peer's warm-up is the first batch's prompts for two new tokens; the timed
    batches are the next ones, whole, and only they are counted."""
    import argparse

    peers = load("peers")
    workloads = load("workloads")
    ckpt = workloads.config_dir(tmp_path / "config", workloads.SMALL_MOONLIGHT, "float32")
    calls = []

    def fake_batch(model, prompts, out_lens, b, args, new_tokens=None):
        n = new_tokens or max(out_lens[b : b + peers.PEER_BATCH])
        calls.append((b, n))
        return n * len(prompts[b : b + peers.PEER_BATCH])

    monkeypatch.setattr(peers, "_peer_batch", fake_batch)
    prompts = [[1, 2, 3]] * (3 * peers.PEER_BATCH)
    out_lens = [5] * len(prompts)
    args = argparse.Namespace(device="cpu", dtype="float32")
    result = peers.padded_generate(ckpt, prompts, out_lens, args, batches=1)
    assert calls == [(0, 2), (peers.PEER_BATCH, 5)]
    assert result["output_tokens"] == 5 * peers.PEER_BATCH and result["timed_batches"] == 1


def test_profile_prefill_times_whole_prefill_chunks(tmp_path):
    mla = load("mla")
    out = tmp_path / "out"
    argv = ["--small", "--skip-peer", "--out", str(out), "--ckpt", str(tmp_path / "config")]
    assert mla.main([*argv, "--profile-prefill", "--max-batched-tokens", "16"]) == 0
    prof = json.loads((out / "mla.json").read_text())["batchgen"]["profile_prefill"]
    assert prof["steps"] == 3 and prof["tokens_per_step"] == 16  # every step a full chunk
    assert prof["step_wall_ms"] > 0 and prof["prefill_tok_s"] > 0
    assert prof["kernels"] == [] and prof["gpu_ms_by_family"] == {}  # no GPU profile on a CPU


def test_the_compile_log_records_kernels_met_in_the_block_and_restores_the_hook():
    """compile_log puts its hook in Triton's jit_cache_hook (which Triton calls before it
    specialises a kernel), chains the hook it found, and gives it back on exit. The
    hook is called here as Triton would, with its keyword arguments."""
    from triton import knobs

    engine_runs = load("engine_runs")
    earlier = []

    def hook(**kwargs):
        earlier.append(kwargs["repr"])

    saved = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        step = 0
        with engine_runs.compile_log(lambda: step) as entries:
            knobs.runtime.jit_cache_hook(key=1, repr="kernel_a[num_warps=4]", fn=None)
            step = 7
            knobs.runtime.jit_cache_hook(key=2, repr="kernel_b[num_warps=8]", fn=None)
        assert entries == ["step 0: kernel_a[num_warps=4]", "step 7: kernel_b[num_warps=8]"]
        assert earlier == ["kernel_a[num_warps=4]", "kernel_b[num_warps=8]"]
        assert knobs.runtime.jit_cache_hook is hook
    finally:
        knobs.runtime.jit_cache_hook = saved


def test_gc_pauses_counts_the_collections_run_in_the_block():
    import gc

    engine_runs = load("engine_runs")
    callbacks = len(gc.callbacks)
    with engine_runs.gc_pauses() as pauses:
        gc.collect()  # a full collection: generation 2
        gc.collect(0)
    assert pauses["gen2"]["collections"] >= 1 and pauses["gen0"]["collections"] >= 1
    assert all(entry["ms"] >= 0 for entry in pauses.values())
    assert len(gc.callbacks) == callbacks  # its callback removed on exit
    full = pauses["gen2"]["collections"]
    gc.collect()
    assert pauses["gen2"]["collections"] == full  # nothing counted after the block


def test_allocator_line_names_each_counter_and_is_absent_on_the_cpu():
    moe_runs = load("moe_runs")
    assert moe_runs.allocator_lines(None) == []
    alloc = {
        "device_mallocs": 3,
        "device_frees": 1,
        "alloc_retries": 2,
        "segments": 159,
        "reserved_peak_bytes": 3 << 30,
    }
    (line,) = moe_runs.allocator_lines(alloc)
    assert "3 cudaMalloc, 1 cudaFree, 2 retries" in line
    assert "159 segments" in line and "3.00 GiB" in line
    # --allocator-steps: counts so far after each step; the steps where they grew are named
    _, by_step = moe_runs.allocator_lines(alloc, [[0, 0], [2, 0], [2, 0], [3, 2]])
    assert by_step.split(None, 2)[2] == "#1 2 cudaMalloc; #3 1 cudaMalloc 2 retries"
    _, quiet = moe_runs.allocator_lines(alloc, [[0, 0], [0, 0]])
    assert quiet.endswith("none")


def test_sampling_runs_beside_greedy(tmp_path):
    """--sampling all: W4's script runs greedy and each sampled configuration in one
    process (no peer, no mla.json), each run's rate and its ratio to greedy."""
    mla = load("mla")
    out = tmp_path / "out"
    argv = ["--small", "--sampling", "all", "--out", str(out), "--ckpt", str(tmp_path / "c")]
    elapsed = run_timed(mla, argv)
    runs = json.loads((out / "sampling.json").read_text())["sampling"]
    assert list(runs) == ["greedy", "sampled", "top_k", "penalty"]
    rates = {name: rate_of(run, 6 * 6, elapsed) for name, run in runs.items()}
    assert sum(run["wall_s"] for run in runs.values()) < elapsed
    for name, run in runs.items():
        assert run["output_tokens"] == 6 * 6
        assert run["ratio_to_greedy"] == pytest.approx(rates[name] / rates["greedy"])
    assert not (out / "mla.json").exists()

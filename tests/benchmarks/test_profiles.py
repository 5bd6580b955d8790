"""benchmarks/profiles.py: a profile's kernels grouped by family and the GPU's idle gaps
put down to the host or the device, from traces written by hand."""

from __future__ import annotations

from bench_scripts import load


def test_kernel_families_group_the_profile_by_name():
    profiles = load("profiles")
    rows = [
        ("_decode_split_kernel", 4.0),
        ("_store_kv_kernel", 0.1),
        ("_mla_split_kernel", 2.0),
        ("_mla_merge_kernel", 0.25),
        ("chunk_kda_fwd_kernel_intra_sub_chunk", 1.5),
        ("nvjet_sm90_tst_64x32_64x16_1x2_h_bz_TNT", 0.5),
        ("_rms_norm_kernel", 0.2),
        ("_mla_rope_kernel", 0.0625),  # MLA's rope (and latent store) launch
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16", 0.05),
        ("Memcpy HtoD (Pinned -> Device)", 0.01),
        ("something_new", 0.3),
        ("_nucleus_kernel", 0.125),  # the sampler's own Triton kernels count as sampling
    ]
    fam = profiles.kernel_families(rows)
    assert fam["attention"] == 6.35 and fam["gemm"] == 0.5 and fam["norm_rope_act"] == 0.2625
    assert fam["linear_attention"] == 1.5
    assert fam["sampling"] == 0.175 and fam["copies"] == 0.01 and fam["other"] == 0.3


def _x(cat, name, ts, dur, corr=None):
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {}}
    if corr is not None:
        event["args"]["correlation"] = corr
    return event


def test_gpu_idle_puts_each_gap_down_to_the_host_or_the_device():
    """A trace of two steps: kernel A; a gap of 55 us ended by a graph launched late, while
    the host was in next_decode (30 us), then in launch (10 us) before the call, and the
    call and its latency (15 us); a gap of 25 us ended by a kernel launched long before
    (the device waited); a copy overlapping that kernel; a 1 us gap below the threshold."""
    profiles = load("profiles")
    events = [
        _x("cuda_runtime", "cudaLaunchKernel", -50, 2, corr=0),
        _x("kernel", "A", 0, 120, corr=0),
        _x("user_annotation", "batchgen.next_decode", 100, 50),
        _x("user_annotation", "batchgen.launch", 150, 20),
        _x("cuda_runtime", "cudaGraphLaunch", 160, 5, corr=1),
        _x("kernel", "B", 175, 100, corr=1),
        _x("cuda_runtime", "cudaLaunchKernel", 200, 3, corr=2),
        _x("kernel", "C", 300, 10, corr=2),
        _x("cuda_runtime", "cudaMemcpyAsync", 201, 3, corr=3),
        _x("gpu_memcpy", "D", 305, 20, corr=3),
        _x("cuda_runtime", "cudaLaunchKernel", 204, 3, corr=4),
        _x("kernel", "E", 326, 4, corr=4),
        _x("cpu_op", "aten::mm", 0, 400),  # not a range of ours: ignored
    ]
    idle = profiles.gpu_idle(events, steps=2)
    assert idle["gpu_busy_ms"] == (120 + 100 + 25 + 4) / 2000
    assert idle["gpu_idle_ms"] == (55 + 25 + 1) / 2000
    assert idle["gaps"] == 2
    assert idle["idle_by_cause"] == {
        "host: batchgen.next_decode": 30 / 2000,
        "device": 25 / 2000,
        "launch: batchgen.launch": 15 / 2000,
        "host: batchgen.launch": 10 / 2000,
    }
    assert idle["small_gaps_ms"] == 1 / 2000
    assert idle["streams"] == {"?": {"activities": 2.5, "ms": (120 + 100 + 10 + 20 + 4) / 2000}}
    assert idle["host_ms"] == {"batchgen.next_decode": 50 / 2000, "batchgen.launch": 20 / 2000}
    assert idle["idle_before_ms"] == {"B": 55 / 2000, "C": 25 / 2000}
    assert idle["largest_gaps"] == [
        "    55.0 us at     0.120 ms: A -> B",
        "    25.0 us at     0.275 ms: B -> C",
    ]
    assert idle["runtime_ms"] == {
        "cudaLaunchKernel": (2 + 3 + 3) / 2000,
        "cudaGraphLaunch": 5 / 2000,
        "cudaMemcpyAsync": 3 / 2000,
    }


def test_gpu_idle_of_an_empty_trace_is_zero():
    idle = load("profiles").gpu_idle([], steps=3)
    assert idle == {
        "gpu_busy_ms": 0.0,
        "gpu_idle_ms": 0.0,
        "idle_by_cause": {},
        "small_gaps_ms": 0.0,
        "host_ms": {},
        "runtime_ms": {},
        "streams": {},
        "gaps": 0,
        "idle_before_ms": {},
        "largest_gaps": [],
    }

"""benchmarks/throughput.py --small: the W1 script end to end on the CPU (no peer)."""

from __future__ import annotations

import json

from bench_scripts import load


def test_small_run_writes_its_result(tmp_path):
    throughput = load("throughput")
    small_requests = load("workloads").small_requests
    out = tmp_path / "out"
    ckpt = tmp_path / "ckpt"
    assert throughput.main(["--small", "--skip-peer", "--out", str(out), "--ckpt", str(ckpt)]) == 0
    result = json.loads((out / "throughput.json").read_text())
    ours = result["batchgen"]
    _, out_lens = small_requests()
    assert ours["output_tokens"] == sum(out_lens)
    assert ours["tok_s"] > 0 and 0 < result["fraction_of_roofline"] < 1
    assert len(ours["timeline"]) >= max(out_lens)
    assert ours["timeline"][-1][1] == sum(out_lens)


def test_kernel_families_group_the_profile_by_name():
    throughput = load("throughput")
    rows = [
        ("_decode_split_kernel", 4.0),
        ("_store_kv_kernel", 0.1),
        ("_mla_split_kernel", 2.0),
        ("_mla_merge_kernel", 0.25),
        ("chunk_kda_fwd_kernel_intra_sub_chunk", 1.5),
        ("nvjet_sm90_tst_64x32_64x16_1x2_h_bz_TNT", 0.5),
        ("_rms_norm_kernel", 0.2),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16", 0.05),
        ("Memcpy HtoD (Pinned -> Device)", 0.01),
        ("something_new", 0.3),
    ]
    fam = throughput.kernel_families(rows)
    assert fam["attention"] == 6.35 and fam["gemm"] == 0.5 and fam["norm_rope_act"] == 0.2
    assert fam["linear_attention"] == 1.5
    assert fam["sampling"] == 0.05 and fam["copies"] == 0.01 and fam["other"] == 0.3

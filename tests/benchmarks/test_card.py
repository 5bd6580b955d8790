"""benchmarks/card.py on the CPU: the ceilings it measures, and none for host copies."""

from __future__ import annotations

from bench_scripts import load


def test_measure_on_the_cpu_times_the_copy_and_the_matmul_only():
    card = load("card")
    got = card.measure("cpu", copy_gib=1 / 1024, matmul=64, repeats=1)
    assert sorted(got) == ["copy_bytes_per_s", "d2h_gb_s", "h2d_gb_s", "matmul_flops"]
    assert got["h2d_gb_s"] is None and got["d2h_gb_s"] is None  # pinned copies need a GPU
    assert got["copy_bytes_per_s"] > 2**20 and got["matmul_flops"] > 2 * 64**3

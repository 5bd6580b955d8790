"""benchmarks/throughput.py --small: the W1 script end to end on the CPU (no peer)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_small_run_writes_its_result(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        import throughput
        from workloads import small_requests
    finally:
        sys.path.remove(str(BENCH))
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

"""benchmarks/dp_ep.py --small: W8's script end to end on the CPU, a tiny DeepSeek-V3 over
two gloo ranks in its three layouts (attention DP + EP, TP, two Ray engines), each in a
process of its own."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load, rate_of, run_timed


@pytest.mark.slow
def test_small_run_answers_every_request_in_each_layout(tmp_path):
    pytest.importorskip("ray")  # the engines layout runs on Ray data parallel
    dp_ep = load("dp_ep")
    out = tmp_path / "out"
    argv = ["--small", "--model", "moonlight-w4", "--out", str(out)]
    elapsed = run_timed(dp_ep, [*argv, "--ckpt", str(tmp_path / "config")])
    result = json.loads((out / "dp_ep.json").read_text())
    # 12 requests a rank of 24 tokens (2 pages of 16 each with their 8 output tokens)
    _, out_lens = load("workloads").w4_requests(n=24, prompt_len=24, out_len=8, max_token=500)
    assert (result["gpus"], result["requests"], result["output_len"]) == (2, 24, 8)
    assert list(result["layouts"]) == ["dp-ep", "tp", "engines"]
    rates = {}
    for name, run in result["layouts"].items():
        assert run["requests_answered"] == 24 and run["all_outputs"], name
        rates[name] = rate_of(run, sum(out_lens), elapsed)
        assert run["tok_s_per_gpu"] == pytest.approx(rates[name] / 2)
        assert run["kv_pages_per_gpu"] == [40, 40]  # the --small pool a rank, read back
    dp, tp, engines = (result["layouts"][name] for name in ("dp-ep", "tp", "engines"))
    # each dp-ep rank holds its own 12 requests' pages only; tp's ranks hold every
    # request's, as many as the pool takes
    assert all(0 < held <= 24 for held in dp["kv_pages_held_peak"])
    assert tp["kv_pages_held_peak"][0] == tp["kv_pages_held_peak"][1] > 24
    assert (dp["kv_capacity_pages"], tp["kv_capacity_pages"], engines["kv_capacity_pages"]) == (
        80,
        40,
        80,
    )
    # dp-ep's first tick carries the requests (24-token prompts to rank 1), every later
    # tick the same few bytes whatever the ranks hold
    first, *rest = dp["step_bytes"]
    assert first > 12 * 24 and len(set(rest)) == 1 and rest[0] < first / 10
    assert dp["bytes_per_step_max"] == first and len(dp["step_bytes"]) == dp["steps"]
    assert sum(dp["step_bytes"]) == dp["counters"]["step_message_bytes_total"]
    assert engines["bytes_per_step_mean"] is None  # independent engines send none
    ratios = result["ratios"]
    assert ratios["dp_ep_over_tp"] == pytest.approx(rates["dp-ep"] / rates["tp"])
    assert ratios["dp_ep_over_engines_per_gpu"] == pytest.approx(rates["dp-ep"] / rates["engines"])


def test_an_unknown_layout_is_a_usage_error(tmp_path, capsys):
    dp_ep = load("dp_ep")
    with pytest.raises(SystemExit) as exit_:
        dp_ep.main(["--small", "--layouts", "dp-ep,pp", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "--layouts" in capsys.readouterr().err

"""benchmarks/dp_one.py --small: both models on the CPU, each on a plain engine and one
built with data_parallel_size=1 and expert parallel off, two timed passes an engine."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load, rate_of, run_timed


def test_small_run_times_both_engines_of_both_models(tmp_path):
    dp_one = load("dp_one")
    workloads = load("workloads")
    out = tmp_path / "out"
    elapsed = run_timed(dp_one, ["--small", "--out", str(out), "--ckpt", str(tmp_path / "c")])
    result = json.loads((out / "dp_one.json").read_text())
    assert result["repeats"] == 2 and list(result["models"]) == ["moonlight-w4", "kimi-w6"]
    assert "needs tensor_parallel_size or data_parallel_size > 1" in result["ep_at_one_rank"]
    # the small configs' MoE layers: every layer past the first dense one
    sparse = {
        "moonlight-w4": workloads.SMALL_MOONLIGHT["num_hidden_layers"]
        - workloads.SMALL_MOONLIGHT["first_k_dense_replace"],
        "kimi-w6": workloads.SMALL_KIMI["mlp_layer_types"].count("sparse"),
    }
    for model, run in result["models"].items():
        assert (run["requests"], run["output_tokens_asked"]) == (6, 6 * 6), model
        assert list(run["flavours"]) == ["plain", "dp1-ep1"]
        means = {}
        for name, flavour in run["flavours"].items():
            # every pass produced every requested token, its rate its own wall time's
            rates = [rate_of(r, 6 * 6, elapsed) for r in flavour["runs"]]
            assert len(rates) == 2 and flavour["all_outputs"]
            means[name] = sum(rates) / 2
            assert flavour["mean_tok_s"] == pytest.approx(means[name])
            assert flavour["spread"] == pytest.approx((max(rates) - min(rates)) / means[name])
            assert flavour["built"] == {
                "engine": "EngineCore",
                "executor": "OneRank",
                "pairing": False,
                "moe_layers": {"DeepseekV3MoE": sparse[model]},
                "expert_parallel_layers": 0,
                "dp_metrics_keys": [],
                "parallel": {
                    "data_parallel_size": 1,
                    "tensor_parallel_size": 1,
                    "enable_expert_parallel": False,
                },
            }
        assert run["ratio"] == pytest.approx(means["dp1-ep1"] / means["plain"])
        noise = max(f["spread"] for f in run["flavours"].values())
        assert run["noise"] == pytest.approx(noise)
        assert run["within_noise"] == (abs(run["ratio"] - 1) <= noise)
        assert run["same_build"]
    # the four engines' passes ran one after another inside the call
    passes = [
        r for m in result["models"].values() for f in m["flavours"].values() for r in f["runs"]
    ]
    assert sum(r["wall_s"] for r in passes) < elapsed


@pytest.mark.parametrize(
    "options, named",
    [(["--models", "moonlight-w4,llama"], "--models"), (["--repeats", "1"], "--repeats")],
)
def test_an_unknown_model_or_a_single_pass_is_a_usage_error(tmp_path, capsys, options, named):
    dp_one = load("dp_one")
    with pytest.raises(SystemExit) as exit_:
        dp_one.main(["--small", *options, "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "dp_one.json").exists()

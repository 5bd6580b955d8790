"""benchmarks/precision.py --small: memory and tok/s by precision end to end on the CPU."""

from __future__ import annotations

import json

import pytest
import torch
from bench_scripts import load, run_timed


def _run(tmp_path, model: str, *more: str) -> dict:
    precision = load("precision")
    out = tmp_path / "out"
    argv = ["--model", model, "--small", "--out", str(out), "--ckpt", str(tmp_path / "cfg")]
    run_timed(precision, [*argv, *more])
    return json.loads((out / f"precision-{model}.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("model", ["w4", "w6"])
def test_weights_stay_quantized_and_match_their_dequantized_model(tmp_path, capsys, model):
    """W4's DeepSeek-V3 and W6's Kimi Linear, CPU-sized."""
    result = _run(tmp_path, model)
    runs = result["runs"]
    assert list(runs) == ["fp8", "int4", "bf16"] and result["reference"] == "bf16"
    plain = runs["bf16"]["weight_bytes"]
    # float32 reference: FP8 holds every quantizable linear and the experts in a byte a
    # weight, INT4 the experts in half a byte (the rest stays float32)
    assert runs["fp8"]["weight_bytes"] < 0.4 * plain
    assert runs["int4"]["weight_bytes"] < 0.5 * plain
    want = 6 * 6  # the small workload: 6 requests of 6 tokens
    for name, run in runs.items():
        assert run["e2e"]["output_tokens"] == want, name
        assert run["decode"]["output_tokens"] == 8 * 8, name
    for name in ("fp8", "int4"):
        close = runs[name]["closeness"]
        # on the CPU the quantized layers dequantize a tile into float32 and multiply, as
        # the reference model's float32 weights do: the CPU rule, tokens
        # identical and logprobs within 1e-4
        assert close["identical_rows"] == close["rows"] == 6, name
        assert close["token_agreement"] == 1.0 and close["collapsed_rows"] == 0, name
        assert close["max_logprob_diff"] <= 1e-4, name
    assert "closeness" not in runs["bf16"]
    assert f"memory and tok/s by precision ({model}, small, CPU)" in capsys.readouterr().out


@pytest.mark.slow
def test_w1_fp8_kv_holds_four_times_the_pages_of_float32_kv(tmp_path):
    runs = _run(tmp_path, "w1", "--requests", "3")["runs"]
    fp8, ref = runs["fp8 KV"], runs["bf16 KV"]
    _, out_lens = load("workloads").small_requests()
    for run in (fp8, ref):  # end to end on the first 3 requests only
        assert run["e2e"]["output_tokens"] == sum(out_lens[:3])
    assert fp8["weight_bytes"] == ref["weight_bytes"]  # the same weights, the KV differs
    assert fp8["kv_pages"] == 4 * ref["kv_pages"]  # the CPU pool's bytes, 1 byte vs 4
    assert fp8["closeness"]["collapsed_rows"] == 0


def test_load_state_copies_in_place_and_refuses_another_models_state():
    """The reference's weights go into a built model's own tensors (its CUDA graphs read
    them), derived forms remade into the tensors they held."""
    runs = load("precision_runs")

    class Derived(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False)
            self.register_buffer("doubled", torch.zeros(2, 3), persistent=False)

        def after_load(self):
            self.doubled = self.weight * 2  # a new tensor, as MoEGate.after_load makes

    model = torch.nn.Sequential(Derived())
    weight, doubled = model[0].weight, model[0].doubled
    runs.load_state(model, {"0.weight": torch.ones(2, 3)})
    assert model[0].weight is weight and model[0].doubled is doubled
    assert torch.equal(doubled, torch.full((2, 3), 2.0))
    with pytest.raises(ValueError, match="another model"):
        runs.load_state(model, {"1.weight": torch.ones(2, 3)})
    with pytest.raises(ValueError, match="0.weight"):
        runs.load_state(model, {"0.weight": torch.ones(3, 2)})


def test_only_keeps_the_named_engines_and_always_the_reference():
    precision = load("precision")

    def names(model, only):
        return [name for name, _, _ in precision.variants(model, {}, only)]

    assert names("w4", None) == ["fp8", "int4", "bf16"]
    assert names("w4", ["int4"]) == ["int4", "bf16"]
    assert names("w1", []) == ["bf16 KV"]
    int4 = precision.variants("w6", {"hidden_size": 8}, ["int4"])[0]
    assert int4[1]["quantization_config"]["format"] == "pack-quantized"
    assert int4[1]["hidden_size"] == 8 and int4[2] == {}

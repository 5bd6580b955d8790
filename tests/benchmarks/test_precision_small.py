"""benchmarks/precision.py --small: memory and tok/s by precision end to end on the CPU."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

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


@pytest.mark.slow
def test_w1_profile_splits_each_run_and_profiles_both_kv_dtypes(tmp_path, capsys):
    """--profile: both engines' end-to-end runs again on fresh prompts, their phases, and
    prefill and decode steps profiled (a 16-token budget: the prefill steps are chunks)."""
    out = tmp_path / "out"
    argv = ["--model", "w1", "--small", "--out", str(out), "--ckpt", str(tmp_path / "cfg")]
    run_timed(load("precision"), [*argv, "--profile", "--max-batched-tokens", "16"])
    runs = json.loads((out / "precision-w1.json").read_text())["runs"]
    prompts, out_lens = load("workloads").small_requests()
    for name, run in runs.items():
        for key in ("e2e", "e2e_again"):
            r = run[key]
            assert r["output_tokens"] == sum(out_lens), (name, key)
            # ~190 prompt tokens at 16 a step: every request has its first token only
            # after a dozen steps, and the decode phase has steps of its own
            assert 10 <= r["prefill_phase_steps"] < r["steps"], (name, key)
            assert 0 < r["prefill_phase_s"] < r["wall_s"] and r["decode_tok_s"] > 0
            assert len(r["slowest_steps"]) == 5 and r["compiles"] == []  # nothing compiles
    profiles = json.loads((out / "precision-w1-profile.json").read_text())
    assert list(profiles) == ["fp8 KV", "bf16 KV"]
    for name, prof in profiles.items():
        assert prof["prefill"]["tokens_per_step"] == 16, name  # every step a full chunk
        decode = prof["decode"]
        # all 8 requests decoding at their own contexts (prompts of 8-40 tokens)
        assert decode["batch"] == 8 and decode["mean_context"] > 24, name
        assert decode["step_wall_ms"] > 0 and decode["kernels"] == []  # no GPU profile
    printed = capsys.readouterr().out
    assert "| fp8 KV | e2e_again |" in printed and "| bf16 KV | decode |" in printed


class _Engine:
    """An engine stand-in for precision_runs.timed: request i gets its first token at
    step i, then one a step; the second step meets a new Triton specialization."""

    device = torch.device("cpu")

    def __init__(self):
        self.stats = SimpleNamespace(output_tokens=0)
        self.requests = {}
        self.steps = 0

    def add_request(self, rid, prompt, params):
        self.requests[rid] = SimpleNamespace(
            output_token_ids=[], index=len(self.requests), left=params.max_tokens
        )

    @property
    def has_unfinished(self):
        return bool(self.requests)

    def step(self):
        from triton import knobs

        if self.steps == 1 and knobs.runtime.jit_cache_hook is not None:
            knobs.runtime.jit_cache_hook(key=1, repr="_decode_split_kernel[num_warps=4]", fn=None)
            time.sleep(0.05)  # as a compile would: the run's slowest step
        for rid, r in list(self.requests.items()):
            if r.index <= self.steps:
                r.output_token_ids.append(7)
                self.stats.output_tokens += 1
                r.left -= 1
                if r.left == 0:
                    del self.requests[rid]
        self.steps += 1


def test_timed_splits_the_run_at_every_first_token_and_logs_what_it_compiled():
    runs = load("precision_runs")
    result = runs.timed(SimpleNamespace(engine=_Engine()), [[1], [2], [3]], [4, 4, 4], "t")
    assert result["output_tokens"] == 12 and result["steps"] == 6
    assert result["prefill_phase_steps"] == 3  # the third request's first token: step 2
    assert result["compiles"] == ["step 1: _decode_split_kernel[num_warps=4]"]
    assert len(result["slowest_steps"]) == 5 and result["slowest_steps"][0].startswith("step 1:")
    assert 0.05 < result["prefill_phase_s"] < result["wall_s"]


def test_the_phase_and_family_tables_show_each_engine_and_run():
    precision = load("precision")

    def run(tok_s, again=False):
        e2e = dict(tok_s=tok_s, prefill_phase_s=2.185, prefill_phase_steps=9, decode_tok_s=21744.3)
        e2e.update(
            steps=1040, compiles=["step 3: k", "step 5: k"], slowest_steps=["step 3: 812.0 ms"]
        )
        return {"e2e": e2e, **({"e2e_again": dict(e2e, compiles=[])} if again else {})}

    result = {"runs": {"fp8 KV": run(16074.2, again=True), "bf16 KV": run(19260.4)}}
    lines = precision.phase_table(result).splitlines()
    assert lines[4] == (
        "| fp8 KV | e2e | 16074 | 2.185 | 9 | 21744 | 1040 | 2 | step 3: 812.0 ms |"
    )
    assert lines[5].startswith("| fp8 KV | e2e_again | 16074 | 2.185 | 9 | 21744 | 1040 | 0 |")
    assert lines[6].startswith("| bf16 KV | e2e | 19260 |") and len(lines) == 7
    prof = {"gpu_ms_by_family": {"attention": 1.5, "gemm": 2.25}, "step_wall_ms": 7.0}
    table = precision.family_table({"fp8 KV": {"prefill": prof, "decode": dict(prof)}})
    row = table.splitlines()[4]
    assert row.startswith("| fp8 KV | prefill | 7.00 | 1.500 | - | 2.250 |")
    prompts = [[5, 6], [0, 6], [3], [1, 2]]
    fresh = precision.fresh(prompts)
    assert fresh == [[7, 6], [2, 6], [5], [3, 2]]
    # --profile's prefill profile (profiles.fresh_prompts) runs after e2e_again on
    # prompts of its own: no first token meets the workload's or e2e_again's
    profiled = load("profiles").fresh_prompts(prompts)
    for p, f, q in zip(prompts, fresh, profiled):
        assert len({p[0], f[0], q[0]}) == 3 and p[1:] == f[1:] == q[1:]


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

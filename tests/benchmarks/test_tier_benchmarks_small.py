"""benchmarks/pressure.py and shared_prefix.py --small: the W2 and W3 scripts end to end
on the CPU, each with its host tier on and off."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _import(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCH))


def _run(script: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "out"
    argv = ["--small", "--out", str(out), "--ckpt", str(tmp_path / "ckpt"), *extra]
    assert _import(script).main(argv) == 0
    return json.loads((out / f"{script}.json").read_text())


def test_pressure_small_swaps_with_the_tier_and_recomputes_without(tmp_path):
    result = _run("pressure", tmp_path, "--tier-policy", "always")
    _, out_lens = _import("pressure").small_workload()
    on, off = result["tier_on"], result["tier_off"]
    for run in (on, off):
        assert run["all_outputs"] and run["output_tokens"] == sum(out_lens)
        assert run["metrics"]["output_tokens"] == sum(out_lens)
        assert run["metrics"]["preemptions"] > 0
    assert on["metrics"]["swaps_out"] > 0 and on["metrics"]["swaps_in"] > 0
    assert on["metrics"]["bytes_offloaded"] > 0 and on["metrics"]["copy_seconds"] > 0
    assert "swaps_out" not in off["metrics"] and off["metrics"]["recomputes"] > 0
    # swapping resumes where it stopped; recompute computes the dropped context again
    assert on["metrics"]["computed_tokens"] < off["metrics"]["computed_tokens"]
    assert result["ratio"] > 0 and result["fraction_of_ceiling"] > 0
    m = on["metrics"]
    assert result["swap_bytes"] == m["bytes_swap_out"] + m["bytes_swap_in"] > 0
    assert result["swap_gb_per_s"] > 0
    assert result["checks"]["tier_on_swapped"] and all(result["checks"].values())
    assert result["engine"]["tier_policy"] == "always"
    assert result["engine"]["load_format"] == "dummy"


def test_pressure_small_llama_with_admission_and_policy_passed_through(tmp_path):
    result = _run("pressure", tmp_path, "--model", "llama-3.1-8b", "--admission", "arrival")
    assert result["model"] == "llama-3.1-8b (small)"
    assert result["engine"]["admission"] == "arrival"
    assert result["engine"]["tier_policy"] == "auto"  # the engine's default
    config = json.loads((tmp_path / "ckpt-small" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and not config["tie_word_embeddings"]
    assert config["rope_parameters"]["rope_type"] == "llama3"
    assert not list((tmp_path / "ckpt-small").glob("*.safetensors"))  # weights: dummy
    assert "tier_on_swapped" not in result["checks"]  # "auto" may recompute instead
    assert all(result["checks"].values())


def test_shared_prefix_small_computes_less_prefill_with_host_hits(tmp_path):
    result = _run("shared_prefix", tmp_path)
    _, out_lens = _import("shared_prefix").small_workload()
    on, off = result["host_hits_on"], result["host_hits_off"]
    for run in (on, off):
        assert run["all_outputs"] and run["output_tokens"] == sum(out_lens)
    assert on["metrics"]["host_prefix_hit_pages"] > 0 and on["metrics"]["bytes_loaded"] > 0
    assert "host_prefix_hit_pages" not in off["metrics"]
    prefill_on = on["metrics"]["prefill_tokens_computed"]
    prefill_off = off["metrics"]["prefill_tokens_computed"]
    assert prefill_on < prefill_off
    # nothing preempted: every prompt token is either computed or a prefix hit
    for run in (on, off):
        m = run["metrics"]
        assert m["preemptions"] == 0
        hits = m["prefix_hit_tokens"] + m.get("host_prefix_hit_tokens", 0)
        assert m["prefill_tokens_computed"] + hits == result["prompt_tokens"]
    assert all(result["checks"].values())

"""benchmarks/pressure.py and shared_prefix.py --small: the W2 and W3 scripts end to end
on the CPU, each with its host tier on and off."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

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


def page_bytes(config: dict, page_size: int = 16, dtype_bytes: int = 4) -> int:
    """One KV page of every layer, K and V, from the model config (float32 on the CPU)."""
    kv = config["num_key_value_heads"] * config["head_dim"]
    return config["num_hidden_layers"] * 2 * page_size * kv * dtype_bytes


@pytest.fixture
def observed(monkeypatch):
    """Bytes and pages the tier's copy bodies really moved, by the reason each page was
    queued for. The wrapped bodies record the host page list they were handed and the
    staging tensor they copied through; the wrapped submissions record the per-page
    reasons of the task they queued, under the same host page list. Joined afterwards
    (a body may run on the copy worker before its submission returns)."""
    import batchgen.kv.tiered as tiered

    reasons: dict[int, list[str]] = {}
    calls: list[tuple[list[int], int]] = []  # (host pages, bytes moved)
    keep: list = []  # the lists whose ids are keys: alive, so ids stay unique

    def noting(method: str) -> None:
        orig = getattr(tiered.TieredKVManager, method)

        def wrapped(self, q, *a, **kw):
            before = len(self._pending)
            out = orig(self, q, *a, **kw)
            if len(self._pending) > before:
                host_pages = self._pending[-1].host_pages
                reasons[id(host_pages)] = list(q.reasons[: len(host_pages)])
                keep.append(host_pages)
            return out

        monkeypatch.setattr(tiered.TieredKVManager, method, wrapped)

    def counting(name: str, host_pages_at: int, layers) -> None:
        body = getattr(tiered, name)

        def wrapped(*a, **kw):
            out = body(*a, **kw)
            calls.append((a[host_pages_at], out[0].nbytes * layers(a)))
            keep.append(a[host_pages_at])
            return out

        monkeypatch.setattr(tiered, name, wrapped)

    noting("_submit_store")
    noting("_submit_load")
    # a store stages every layer of its pages; a load one layer at a time
    counting("device_to_host_pages", 3, lambda a: 1)
    counting("host_to_device_pages", 2, lambda a: a[1].shape[0])

    def totals() -> tuple[Counter, Counter]:
        moved, pages = Counter(), Counter()
        for host_pages, nbytes in calls:
            for reason in reasons.get(id(host_pages), ["unattributed"] * len(host_pages)):
                moved[reason] += nbytes // len(host_pages)
                pages[reason] += 1
        return moved, pages

    return totals


def test_pressure_small_swaps_with_the_tier_and_recomputes_without(tmp_path, observed):
    result = _run("pressure", tmp_path, "--tier-policy", "always")
    moved, pages = observed()
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
    # the swap traffic reported is what the copy bodies moved for swaps (the warm-up
    # swaps nothing), whole pages of the model's KV geometry
    assert "unattributed" not in pages
    swapped = moved["swap_out"] + moved["swap_in"]
    assert swapped > 0 and result["swap_bytes"] == swapped
    small_model = _import("workloads").SMALL_MODEL
    assert swapped == (pages["swap_out"] + pages["swap_in"]) * page_bytes(small_model)
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

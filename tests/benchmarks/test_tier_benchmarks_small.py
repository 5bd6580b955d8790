"""benchmarks/pressure.py and shared_prefix.py --small: the W2 and W3 scripts end to end
on the CPU, each with its host tier on and off."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest
from bench_scripts import load, rate_of, run_timed

# host<->device, each way, pinned: the ceiling the scripts report copy rates against
# (benchmarks/HISTORY.md)
CEILING_GB_S = 55.0


def _timed_run(script: str, tmp_path: Path, *extra: str) -> tuple[dict, float]:
    """The script's result, and the seconds its call took by this test's clock."""
    out = tmp_path / "out"
    argv = ["--small", "--out", str(out), "--ckpt", str(tmp_path / "ckpt"), *extra]
    elapsed = run_timed(load(script), argv)
    return json.loads((out / f"{script}.json").read_text()), elapsed


def _run(script: str, tmp_path: Path, *extra: str) -> dict:
    return _timed_run(script, tmp_path, *extra)[0]


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
    import batchgen.kv.copy_ledger as copy_ledger
    import batchgen.kv.tiered as tiered

    reasons: dict[int, list[str]] = {}
    calls: list[tuple[list[int], int]] = []  # (host pages, bytes moved)
    keep: list = []  # the lists whose ids are keys: alive, so ids stay unique

    def noting(method: str) -> None:
        orig = getattr(tiered.TieredKVManager, method)

        def wrapped(self, q, *a, **kw):
            before = self.ledger.num_in_flight
            out = orig(self, q, *a, **kw)
            if self.ledger.num_in_flight > before:
                host_pages = self.ledger._pending[-1].host_ids
                reasons[id(host_pages)] = list(q.reasons[: len(host_pages)])
                keep.append(host_pages)
            return out

        monkeypatch.setattr(tiered.TieredKVManager, method, wrapped)

    def counting(name: str, host_pages_at: int, layers) -> None:
        body = getattr(copy_ledger, name)

        def wrapped(*a, **kw):
            out = body(*a, **kw)
            calls.append((a[host_pages_at], out[0].nbytes * layers(a)))
            keep.append(a[host_pages_at])
            return out

        monkeypatch.setattr(copy_ledger, name, wrapped)

    noting("_submit_store")
    noting("_submit_load")
    # a store stages every layer of its pages (a store of freed pages gets that staging
    # from flush()); a load one layer at a time
    counting("device_to_host_pages", 3, lambda a: 1)
    counting("device_to_host_staged", 2, lambda a: 1)
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
    result, elapsed = _timed_run("pressure", tmp_path, "--tier-policy", "always")
    moved, pages = observed()
    _, out_lens = load("pressure").small_workload()
    on, off = result["tier_on"], result["tier_off"]
    for run in (on, off):
        assert run["all_outputs"] and run["output_tokens"] == sum(out_lens)
        assert run["metrics"]["output_tokens"] == sum(out_lens)
        assert run["metrics"]["preemptions"] > 0
    assert on["metrics"]["swaps_out"] > 0 and on["metrics"]["swaps_in"] > 0
    # the cost rule's figures are reported as the engine gives them, not as deltas
    assert on["metrics"]["tier_loads_pay"] is True  # tier_policy="always"
    assert on["metrics"]["tier_recompute_us_per_token"] > 0
    assert on["metrics"]["bytes_offloaded"] > 0 and on["metrics"]["copy_seconds"] > 0
    assert "swaps_out" not in off["metrics"] and off["metrics"]["recomputes"] > 0
    # swapping resumes where it stopped; recompute computes the dropped context again
    assert on["metrics"]["computed_tokens"] < off["metrics"]["computed_tokens"]
    want = rate_of(on, sum(out_lens), elapsed) / rate_of(off, sum(out_lens), elapsed)
    assert result["ratio"] == pytest.approx(want)
    # the copy rate: every byte the copy bodies moved over the copy-stream seconds
    copy_s = on["metrics"]["copy_seconds"]
    assert 0 < copy_s < on["wall_s"]
    want = sum(moved.values()) / copy_s / 1e9 / CEILING_GB_S
    assert result["fraction_of_ceiling"] == pytest.approx(want)
    # the swap traffic reported is what the copy bodies moved for swaps (the warm-up
    # swaps nothing), whole pages of the model's KV geometry
    assert "unattributed" not in pages
    swapped = moved["swap_out"] + moved["swap_in"]
    assert swapped > 0 and result["swap_bytes"] == swapped
    small_model = load("workloads").SMALL_MODEL
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


def test_pressure_profile_times_a_decode_step_of_each_engine(tmp_path, capsys):
    result = _run("pressure", tmp_path, "--runs", "on,off", "--profile", "3")
    for run in ("tier_on", "tier_off"):
        prof = result[run]["after"]
        assert prof["batch"] == 3 and prof["step_wall_ms"] > 0
        assert {"schedule", "forward", "update"} <= set(prof["phase_ms"])
    out = capsys.readouterr().out
    assert out.count("decode step at 3 rows") == 2


def test_pressure_step_phases_time_the_engine_calls_of_every_step(tmp_path, capsys):
    """--step-phases: a row a step in each run, the swap-outs and flushes timed only where
    the tier swapped, the means split by step kind; the engine's methods given back."""
    from batchgen.runner.model_runner import InFlightDecode

    result_of = InFlightDecode.result
    result = _run("pressure", tmp_path, "--tier-policy", "always", "--step-phases")
    on, off = result["tier_on"], result["tier_off"]
    columns = on["step_phases"]["columns"]
    assert columns[:3] == ["schedule", "swap_out", "flush"] and "result" in columns
    for run in (on, off):
        assert len(run["step_phases"]["rows"]) == len(run["timeline"])
    flush = columns.index("flush")
    assert sum(row[flush] for row in on["step_phases"]["rows"]) > 0
    assert sum(row[flush] for row in off["step_phases"]["rows"]) == 0  # no tier, no flush
    split = result["phase_split"]
    assert set(split) == set(result["step_split"])
    assert all(set(cells) == set(columns) for cells in split.values())
    assert "host ms a step, decode" in capsys.readouterr().out
    assert InFlightDecode.result is result_of


def test_pressure_profile_only_profiles_fresh_engines_three_times(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--small", "--out", str(out), "--ckpt", str(tmp_path / "ckpt")]
    assert (
        load("pressure").main([*argv, "--profile-only", "--profile", "3", "--runs", "off,on"]) == 0
    )
    result = json.loads((out / "pressure_profile.json").read_text())
    assert list(result) == ["off", "on"]
    for runs in result.values():
        assert [p["batch"] for p in runs] == [3, 3, 3]
        assert all(p["step_wall_ms"] > 0 and "update" in p["phase_ms"] for p in runs)
    assert not (out / "pressure.json").exists()  # no timed run
    assert capsys.readouterr().out.count(" profile ") == 6


def test_pressure_small_runs_in_the_order_given_or_one_engine_alone(tmp_path):
    both, elapsed = _timed_run(
        "pressure", tmp_path / "both", "--runs", "off,on", "--tier-policy", "always"
    )
    assert both["order"] == ["off", "on"]
    copied = [row[4] for row in both["tier_on"]["timeline"]]  # tier pages copied so far
    assert copied == sorted(copied) and copied[-1] > 0
    m = both["tier_on"]["metrics"]
    assert copied[-1] == m["pages_offloaded"] + m["pages_loaded"]
    assert {row[4] for row in both["tier_off"]["timeline"]} == {0}
    tokens = sum(load("pressure").small_workload()[1])
    want = rate_of(both["tier_on"], tokens, elapsed) / rate_of(both["tier_off"], tokens, elapsed)
    assert both["ratio"] == pytest.approx(want)
    alone = _run("pressure", tmp_path / "off", "--runs", "off")
    assert alone["order"] == ["off"] and "tier_on" not in alone and "ratio" not in alone
    assert alone["checks"]["tier_off_recomputed"] and all(alone["checks"].values())
    # the same engine and requests: the same schedule whichever engine came first
    for key in ("output_tokens", "computed_tokens", "preemptions", "recomputes"):
        assert alone["tier_off"]["metrics"][key] == both["tier_off"]["metrics"][key]
    with pytest.raises(argparse.ArgumentTypeError, match="on,off"):
        load("pressure").parse_runs("on,sideways")


def _prefill_accounting(result: dict) -> None:
    """Without preemption every prompt token is either computed or a prefix hit."""
    for run in result["runs"].values():
        m = run["metrics"]
        if m["preemptions"] == 0:
            hits = m["prefix_hit_tokens"] + m.get("host_prefix_hit_tokens", 0)
            assert m["prefill_tokens_computed"] + hits == result["prompt_tokens"]


def test_shared_prefix_small_runs_the_four_engines(tmp_path, observed):
    sp = load("shared_prefix")
    result, elapsed = _timed_run("shared_prefix", tmp_path, "--tier-policy", "always")
    moved, pages = observed()
    prompts, out_lens = sp.small_workload()
    runs = result["runs"]
    assert list(runs) == ["defaults", "baseline", "tier-off-prefix", "tier-on-arrival"]
    expected = {name: (admission, tier) for name, (admission, tier) in sp.RUNS.items()}
    for name, run in runs.items():
        assert (run["admission"], run["host_tier"]) == expected[name]
        assert run["all_outputs"] and run["output_tokens"] == sum(out_lens)
        m = run["metrics"]
        if name == "tier-on-arrival":
            rate = run["prefix_load"]
            assert rate["bytes"] == m["bytes_prefix_load"] > 0
            assert 0 < rate["copy_seconds"] < run["wall_s"] < elapsed
        elif run["host_tier"]:  # defaults: grouped admission finds the prefixes on device
            assert run["prefix_load"]["bytes"] == m.get("bytes_prefix_load", 0)
        else:
            assert "host_prefix_hit_pages" not in m and "prefix_load" not in run
    # the prefix-load traffic reported is what the copy bodies moved for prefix loads
    # (only the tier runs copy), whole pages of the model's KV geometry
    assert "unattributed" not in pages
    reported = sum(run["prefix_load"]["bytes"] for run in runs.values() if run["host_tier"])
    assert reported == moved["prefix_load"] > 0
    small_model = load("workloads").SMALL_MODEL
    assert moved["prefix_load"] == pages["prefix_load"] * page_bytes(small_model)
    # the tier-on-arrival run alone loads prefixes (the defaults find them on device): its
    # rate is what the copy bodies moved over its copy-stream seconds
    assert runs["defaults"]["prefix_load"]["bytes"] == 0
    rate = runs["tier-on-arrival"]["prefix_load"]
    gb_per_s = moved["prefix_load"] / rate["copy_seconds"] / 1e9
    assert rate["gb_per_s"] == pytest.approx(gb_per_s)
    assert rate["fraction_of_ceiling"] == pytest.approx(gb_per_s / CEILING_GB_S)
    # round-robin arrival evicts every prefix before its next use: host hits replace
    # recompute only with the tier on
    on, off = runs["tier-on-arrival"]["metrics"], runs["baseline"]["metrics"]
    assert on["host_prefix_hit_pages"] > 0
    assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"]
    assert set(result["ratios"]) == set(sp.RATIOS)
    r = result["ratios"]["tier_on_vs_off_arrival"]
    assert r["runs"] == ["tier-on-arrival", "baseline"]
    # no preemption: each run computes the workload's prompt tokens less its prefix hits
    prompt_tokens = sum(len(p) for p in prompts)
    assert prompt_tokens == result["prompt_tokens"]
    assert on["preemptions"] == off["preemptions"] == 0

    def computed(m: dict) -> int:
        return prompt_tokens - m["prefix_hit_tokens"] - m.get("host_prefix_hit_tokens", 0)

    assert r["prefill_computed"] == pytest.approx(computed(off) / computed(on))
    assert computed(off) > computed(on)
    _prefill_accounting(result)
    assert result["checks"]["defaults_fewer_prefill_than_baseline"]
    assert result["checks"]["tier_on_arrival_host_prefix_hits"]
    assert all(result["checks"].values())
    assert "profile" not in result


def test_shared_prefix_small_runs_a_subset_and_skips_the_profile_on_the_cpu(tmp_path, capsys):
    argv = ["--model", "llama-3.1-8b", "--runs", "tier-on-arrival,baseline", "--profile"]
    result = _run("shared_prefix", tmp_path, *argv)
    assert list(result["runs"]) == ["tier-on-arrival", "baseline"]  # the order given
    assert list(result["ratios"]) == ["tier_on_vs_off_arrival"]
    assert result["model"] == "llama-3.1-8b (small)"
    assert result["engine"]["tier_policy"] == "auto"
    assert "tier_on_arrival_host_prefix_hits" not in result["checks"]  # "auto" may recompute
    assert set(result["checks"]) == {"all_outputs", "same_output_tokens"}
    assert "CPU" in result["profile"]["skipped"]
    assert "profile: skipped" in capsys.readouterr().out
    _prefill_accounting(result)


def test_shared_prefix_measures_a_hybrid_models_state_checkpoints(tmp_path, capsys):
    """W3's shape on a Kimi-Linear-shaped model: with no checkpoints no prefix is reused
    (a hit needs the KDA state at its end); with one every 32 tokens, hits through them
    skip prompt tokens, and the run's checkpoint copies are reported."""
    runs = {}
    for interval in (0, 32):
        result = _run(
            "shared_prefix",
            tmp_path / str(interval),
            *("--model", "kimi-w6", "--runs", "defaults", "--checkpoint-interval", str(interval)),
            *(("--checkpoint-policy", "all") if interval else ()),
        )
        assert result["checkpoint_interval"] == interval
        assert result["engine"]["state_checkpoint_interval"] == interval
        if interval:  # --checkpoint-policy reaches the engine
            assert result["engine"]["state_checkpoint_policy"] == "all"
        runs[interval] = result["runs"]["defaults"]["metrics"]
    off, on = runs[0], runs[32]
    assert off.get("state_checkpoints", 0) == 0  # no checkpoint store is built at 0
    assert off.get("state_checkpoint_hit_tokens", 0) == 0
    assert on["state_checkpoints"] > 0 and on["bytes_state_checkpoint"] > 0
    assert on["state_checkpoint_hit_tokens"] > 0
    assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"]
    out = capsys.readouterr().out
    assert "state checkpoints every 0 tokens: 0 stored" in out
    assert "state checkpoints every 32 tokens" in out
    assert "policy the engine default" in out and "tokens; policy all" in out


def test_shared_prefix_runs_option_refuses_unknown_names(tmp_path, capsys):
    sp = load("shared_prefix")
    with pytest.raises(SystemExit):
        sp.main(["--small", "--runs", "defaults,nope", "--out", str(tmp_path)])
    assert "nope" in capsys.readouterr().err


def test_copy_overlap_measures_copies_under_compute_kernels():
    """Chrome-trace events as torch.profiler writes them (microseconds): the compute
    stream 7 is busy 0-100 and 150-250; copy stream 20 copies host->device 50-180 (two
    overlapping copies) and stream 21 at 300-310 (nothing computes then)."""
    sp = load("shared_prefix")

    def ev(cat, name, stream, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
                "tid": stream, "args": dict(args, stream=stream)}  # fmt: skip

    events = [
        ev("kernel", "nvjet_gemm", 7, 0, 60),
        ev("kernel", "_prefill_kernel", 7, 60, 40),
        ev("kernel", "_rms_norm_kernel", 7, 150, 100),
        ev("kernel", "index_copy_kernel", 20, 180, 5),  # the copy stream's own scatter
        ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 20, 50, 100, bytes=1000),
        ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 20, 120, 60, bytes=600),
        ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 21, 300, 10, bytes=400),
        ev("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 7, 140, 5, bytes=8),
        ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 21, 260, 20, bytes=999),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 0, "dur": 999},
    ]
    got = sp.copy_overlap(events)
    assert got["compute_stream"] == 7 and got["copy_streams"] == [20, 21]
    assert got["compute_ms"] == pytest.approx(0.2)
    # copies active 50-180 and 300-310: 140 us; under compute 50-100 and 150-180: 80 us
    assert got["htod_copy_ms"] == pytest.approx(0.14)
    assert got["htod_overlapped_ms"] == pytest.approx(0.08)
    assert got["overlap_fraction"] == pytest.approx(80 / 140)
    assert got["htod_copies"] == 3 and got["htod_bytes"] == 2000
    assert got["htod_on_compute_stream_ms"] == pytest.approx(0.005)
    assert got["window_ms"] == pytest.approx(0.31)
    fam = got["compute_ms_by_family"]
    assert fam["gemm"] == pytest.approx(0.06) and fam["attention"] == pytest.approx(0.04)
    assert fam["norm_rope_act"] == pytest.approx(0.1) and fam["copies"] == 0
    assert sp.copy_overlap([ev("gpu_memcpy", "Memcpy HtoD", 3, 0, 1)]) == {
        "error": "the trace has no kernel events"
    }


def test_summary_reports_the_profile_and_a_window_without_loads():
    sp = load("shared_prefix")
    kernel = {"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 10, "args": {"stream": 7}}
    profile = dict(sp.copy_overlap([kernel]), run="defaults", steps=3, trace="t.json")
    result = {
        "workload": "W3",
        "model": "m",
        "requests": 1,
        "prefixes": 1,
        "questions": 1,
        "prompt_tokens": 1,
        "expected_output_tokens": 1,
        "tier_policy": "auto",
        "runs": {},
        "ratios": {},
        "checks": {"all_outputs": True},
        "profile": dict(profile, prefix_load_bytes=0),
    }
    text = sp.summary(result)
    assert "profile (defaults, 3 steps" in text and "0.0% of it under compute" in text
    assert "no prefix load in the window" in text
    result["profile"]["prefix_load_bytes"] = 1
    assert "no prefix load" not in sp.summary(result)


def test_tier_replay_small_replays_both_tiers_and_moves_pages(tmp_path):
    replay = load("tier_replay")
    out = tmp_path / "replay"
    assert replay.main(["--small", "--workload", "w2", "--out", str(out)]) == 0
    result = json.loads((out / "tier_replay.json").read_text())
    on, off = result["runs"]
    assert on["host_tier"] and not off["host_tier"]
    _, out_lens = replay.workload("w2", small=True)
    # every request ran to its length: each sampled token was one computed decode token
    # or a prompt's last, so computed tokens cover all output tokens but the last each
    assert on["computed_tokens"] >= sum(out_lens) - len(out_lens)
    assert off["recomputes"] > 0 and on["recomputes"] < off["recomputes"]
    assert on["swaps_out"] > 0 and on["gib_by_reason"]["swap_in"] > 0
    assert on["computed_tokens"] < off["computed_tokens"]
    assert on["pages_per_block"] >= 1
    for run in (on, off):  # host seconds of the add path and of the steps, apart
        assert run["add_seconds"] > 0 and run["step_cpu_seconds"] > 0
        assert run["tokens_per_step"] == run["computed_tokens"] / run["steps"]


def test_tier_replay_pipelines_decode_steps_as_the_engine_does(tmp_path):
    """A decode step is followed by one `next_decode` builds (the engine's default), so
    steps and tokens are those of the engine; --no-pipeline builds every step in
    schedule(). Outputs are complete either way, in either order of the tiers."""
    replay = load("tier_replay")
    runs = {}
    for flag in ([], ["--no-pipeline", "--off-first"]):
        out = tmp_path / ("plain" if flag else "pipelined")
        assert replay.main(["--small", "--workload", "w2", "--out", str(out), *flag]) == 0
        runs[bool(flag)] = json.loads((out / "tier_replay.json").read_text())
    assert runs[False]["pipeline"] and not runs[True]["pipeline"]
    assert runs[True]["off_first"]  # tier off replayed first, tier on still reported first
    assert [run["host_tier"] for run in runs[True]["runs"]] == [True, False]
    _, out_lens = replay.workload("w2", small=True)
    for result in runs.values():
        for run in result["runs"]:
            assert run["computed_tokens"] >= sum(out_lens) - len(out_lens)


def test_tier_replay_w4_splits_host_time_between_prefill_and_decode_steps(tmp_path):
    """W4 (prompts of one length): prefill steps and decode steps, the host time of each
    kind reported per step (the small pool of 20 pages preempts)."""
    replay = load("tier_replay")
    out = tmp_path / "w4"
    args = ["--small", "--workload", "w4", "--model", "moonlight-w4", "--out", str(out)]
    assert replay.main(args) == 0
    prompts, out_lens = replay.workload("w4", small=True)
    for run in json.loads((out / "tier_replay.json").read_text())["runs"]:
        kinds = run["steps_by_kind"]
        assert kinds["other"] > 0 and kinds["decode"] > 0
        assert kinds["other"] + kinds["decode"] == run["steps"]
        prompt_tokens = sum(len(p) for p in prompts)
        assert run["computed_tokens"] >= prompt_tokens + sum(n - 1 for n in out_lens)
        assert all(ms > 0 for ms in run["host_ms_per_step"].values())


def test_profile_reports_host_time_per_step_phase_and_names_the_traced_runs():
    sp = load("shared_prefix")
    events = [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 10, "args": {"stream": 7}},
        {"ph": "X", "cat": "user_annotation", "name": "batchgen.schedule", "ts": 0, "dur": 3000},
        {"ph": "X", "cat": "user_annotation", "name": "batchgen.schedule", "ts": 9, "dur": 1000},
        {"ph": "X", "cat": "user_annotation", "name": "batchgen.copy", "ts": 0, "dur": 500},
        {"ph": "X", "cat": "user_annotation", "name": "other.range", "ts": 0, "dur": 700},
        {"ph": "X", "cat": "cpu_op", "name": "batchgen.update", "ts": 0, "dur": 900},
    ]
    assert sp.host_ranges(events, 2) == {"copy": 0.25, "schedule": 2.0}
    prof = dict(sp.copy_overlap(events), run="tier-off-prefix", steps=2, trace="t.json")
    prof.update(prefix_load_bytes=0, host_tier=False, host_ms_per_step={"schedule": 2.0})
    text = "\n".join(sp.profile_lines(prof))
    assert "host ms per step: schedule 2.00" in text
    assert "no prefix load" not in text  # a tier-off run has none to load

    runs = ["defaults", "baseline", "tier-off-prefix"]
    args = argparse.Namespace(profile=True, runs=runs, profile_runs=None)
    assert sp.profile_target(args, "cuda") == (["defaults"], None)
    args.profile_runs = ["tier-off-prefix", "defaults"]
    assert sp.profile_target(args, "cuda") == (["defaults", "tier-off-prefix"], None)
    names, why = sp.profile_target(args, "cpu")
    assert names == [] and "CPU" in why

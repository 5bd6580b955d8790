"""benchmarks/probe_offload.py: the default-configuration and debug probes on the CPU, and
the closeness verdict with top-5s scored after the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bench_scripts import load
from transformers import AutoConfig

from batchgen.engine.builder_plan import state_bytes_per_seq


def _run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "out"
    argv = ["--small", "--out", str(out), "--ckpt", str(tmp_path / "ckpt"), *extra]
    assert load("probe_offload").main(argv) == 0
    return json.loads((out / "probe_offload.json").read_text())


def test_default_configuration_probe_swaps_and_breaks_no_row(tmp_path):
    result = _run(tmp_path, "--tier-policy", "always", "--decode-append", "batched")
    assert result["mode"] == "default" and result["requests"] == 16
    assert result["tier_run"]["tier_policy"] == "always"
    assert result["tier_run"]["decode_append"] == "batched"
    assert "batchgen_debug" not in result["tier_run"]
    assert result["broken_rows"] == 0 and result["rows_without_output"] == 0
    assert result["identical_rows"] + result["close_rows"] == 16
    m = result["offload_run"]
    assert m["swaps_out"] > 0 and m["swaps_in"] > 0 and m["readback_checks"] == 0
    assert "swaps_out" not in result["ample_run"]


def test_swap_every_preempts_every_request_at_least_once(tmp_path):
    result = _run(tmp_path, "--readback", "--tier-policy", "always", "--swap-every", "4")
    m = result["offload_run"]
    assert m["requests_preempted"] == 16 and m["reconfigures"] > 0
    assert m["swaps_out"] >= 16 and m["recomputes"] == 0
    assert result["broken_rows"] == 0 and result["readback_mismatches"] == 0


def test_control_judges_a_run_that_only_batches_differently(tmp_path):
    result = _run(tmp_path, "--control", "--max-num-seqs", "8")
    control = result["control"]
    assert result["control_max_num_seqs"] == 4
    assert control["identical_rows"] + control["close_rows"] + control["broken_rows"] == 16
    assert control["broken_rows"] == 0  # float32 on the CPU: batching changes ~nothing
    assert result["broken_rows"] == 0


def test_debug_probe_reads_back_every_offloaded_page(tmp_path):
    result = _run(tmp_path, "--debug", "--tier-policy", "always")
    assert result["mode"] == "debug" and result["broken_rows"] == 0
    m = result["offload_run"]
    assert m["readback_checks"] >= m["pages_offloaded"] > 0
    assert result["eos_endings"] == {"tier": 0, "ample": 0}  # ignore_eos


@pytest.mark.parametrize("model", ["moonlight-w4", "kimi-w6"])
def test_readback_probe_of_the_w4_and_w6_models(tmp_path, model):
    """The forced-offload probe of the MLA and hybrid models with --readback: EOS endings
    and no logprobs, tier_policy "always", and batchgen_debug on the tier run alone,
    reading back each offloaded page (and state slot); debug turns that run's pipelined
    decode off."""
    result = _run(tmp_path, "--model", model, "--readback", "--tier-policy", "always")
    assert result["mode"] == "default + readback" and result["readback_mismatches"] == 0
    assert result["tier_run"]["batchgen_debug"] is True
    assert result["broken_rows"] == 0 and result["rows_without_output"] == 0
    m = result["offload_run"]
    assert m["swaps_out"] > 0 and m["readback_checks"] >= m["pages_offloaded"] > 0
    if model == "kimi-w6":  # a hybrid request swaps its compressed state with its pages
        assert m["state_swaps_out"] > 0 and m["state_swaps_in"] > 0
        # each swap moves one slot of every KDA layer (float32 windows on the CPU)
        config = AutoConfig.from_pretrained(tmp_path / "ckpt-small")
        slot = state_bytes_per_seq(config, torch.float32)
        copies = result["copies"]
        assert set(copies) >= {"state_swap_out", "state_swap_in", "swap_out", "swap_in"}
        assert "loaded" not in copies  # totals, not reasons
        assert copies["state_swap_out"]["bytes"] == m["state_swaps_out"] * slot
        assert copies["state_swap_in"]["bytes"] == m["state_swaps_in"] * slot
        assert copies["state_swap_out"]["gb_per_s"] > 0
    assert "readback_checks" not in result["ample_run"]


def _ended(rows, finish="length"):
    return [(r, finish) for r in rows]


def test_compare_scores_each_divergence_once_with_the_common_prefix():
    probe = load("probe_offload")
    prompts = [[1], [2], [3], [4], [5]]
    tier = _ended([[7, 8, 9], [7, 8, 9], [7, 8, 9], [7, 8], [7]])
    ample = _ended([[7, 8, 9], [7, 5, 6], [7, 8, 4], [7, 8, 3], [7, 2]])
    asked = []

    def score(ps):
        asked.append(ps)
        # row 1 diverges at 1: 8 and 5 both likely; row 2 at 2: 4 is 6th, below the top-5
        return [
            [(8, -0.5), (5, -0.6), (0, -3.0), (10, -4.0), (11, -5.0)],
            [(9, -1.0), (1, -1.1), (0, -1.2), (10, -1.3), (11, -1.4), (4, -1.5)],
        ]

    got = probe.compare(prompts, tier, ample, score)
    # rows 3 and 4 are cut short: different lengths with no differing token
    assert asked == [[[2, 7], [3, 7, 8]]]
    assert got["identical_rows"] == 1 and got["close_rows"] == 1
    assert got["broken_rows"] == 3 and got["broken"] == [2, 3, 4]
    assert got["divergence_positions"] == [1, 2]
    row2, row3, row4 = got["broken_detail"]
    assert row2["row"] == 2 and row2["position"] == 2 and row2["tokens"] == [9, 4]
    assert row2["ranks"] == [0, 5] and row2["top"][5] == [4, -1.5]
    assert row3["row"] == 3 and row3["lengths"] == [2, 3]
    assert row3["ending"].startswith("one stopped where the other went on")
    assert row4["row"] == 4 and row4["lengths"] == [1, 2]
    assert probe.compare(prompts, tier, tier, score)["identical_rows"] == 5
    assert len(asked) == 1  # nothing to score: no call


def test_compare_judges_endings():
    """Equal tokens with other finish reasons, a run past an EOS (after a near-tie, where
    the rows may otherwise diverge freely) and an EOS chosen at a near-tie."""
    probe = load("probe_offload")
    eos = 99
    prompts = [[1], [2], [3]]
    tier = [([7, 8], "stop"), ([7, 5, eos, 6], "length"), ([7, eos], "stop")]
    ample = [([7, 8], "length"), ([7, 8, eos], "stop"), ([7, 8, 9], "length")]
    top = [(8, -0.5), (5, -0.6), (eos, -0.7), (10, -4.0), (11, -5.0)]
    got = probe.compare(prompts, tier, ample, lambda ps: [top] * len(ps), [eos])
    assert got["broken"] == [0, 1] and got["close_rows"] == 1
    row0, row1 = got["broken_detail"]
    assert row0["ending"] == "the same 2 tokens, finish reasons 'stop' and 'length'"
    assert row1["ending"].startswith("a ran past the EOS 99 at 2")
    assert row1["finish"] == ["length", "stop"]


def test_a_token_below_the_scored_list_has_no_rank():
    probe = load("probe_offload")
    top = [(t, -0.1 * t) for t in range(10)]
    got = probe.compare([[1]], _ended([[3, 4]]), _ended([[3, 99]]), lambda ps: [top])
    assert got["broken"] == [0] and got["broken_detail"][0]["ranks"] == [4, None]


def test_top_scorer_ranks_the_greedy_token_first(tmp_path):
    probe = load("probe_offload")
    workloads = load("workloads")
    from batchgen import LLM, SamplingParams

    path = workloads.config_dir(tmp_path / "m", workloads.SMALL_MODEL)
    llm = LLM(model=str(path), load_format="dummy", device="cpu", num_kv_pages=32, max_model_len=64)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    tops = probe.top_scorer(llm)(prompts)
    assert [len(t) for t in tops] == [probe.SCORED, probe.SCORED]
    assert [t[0][0] for t in tops] == [o.outputs[0].token_ids[0] for o in greedy]
    for top in tops:
        lps = [lp for _, lp in top]
        assert lps == sorted(lps, reverse=True) and lps[0] <= 0


@pytest.mark.parametrize("model,ranks", [("kimi-w6", 2), ("kimi-w6-x8", 8)])
def test_readback_probe_at_two_and_eight_tensor_parallel_ranks(tmp_path, model, ranks):
    """The issue-15 probe's CPU form: the hybrid model's tier run split over 2 gloo
    ranks, and the 8-GPU contract's model (its CPU size, every head and expert count
    divisible by 8) over 8; readback on every rank, each rank's copies counted; no row
    broken against the ample run, which splits the same way."""
    argv = ["--model", model, "--tp", str(ranks), "--readback", "--tier-policy", "always"]
    result = _run(tmp_path, *argv, "--swap-every", "1", "--requests", "8")
    assert result["tier_run"]["tensor_parallel_size"] == ranks  # the ample run too
    assert result["broken_rows"] == 0 and result["rows_without_output"] == 0
    m = result["offload_run"]
    assert m["requests_preempted"] == 8 and m["reconfigures"] > 0  # every request swapped
    assert m["recomputes"] == 0 and m["swaps_out"] >= 8 and m["state_swaps_out"] >= 8
    workers = m["worker_tiers"]
    assert len(workers) == ranks - 1
    for worker in workers:
        assert worker["pages_offloaded"] == m["pages_offloaded"] > 0
        assert worker["state_stores"] >= m["state_swaps_out"]  # checkpoints store too
        assert worker["readback_checks"] == m["readback_checks"] > 0


def test_replay_judges_the_tier_run_against_its_own_batching(tmp_path):
    """--replay: the W4 model's tier run in defaults (EOS endings, pipelined decode) and
    the ample pool computing the very same rows: identical tokens, and the exit status
    follows that verdict."""
    result = _run(tmp_path, "--model", "moonlight-w4", "--tier-policy", "always", "--replay")
    assert result["offload_run"]["swaps_out"] > 0
    assert result["replay"]["identical_rows"] == 16 and result["replay"]["broken_rows"] == 0
    assert result["replay_steps"] > 0 and result["replay_wall_s"] > 0

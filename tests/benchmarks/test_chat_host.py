"""chat_host's stand-in sampler: a row's token depends on its seed and position alone, so
two trees that batch W7's rows differently give the same answers."""

from __future__ import annotations

import json
import pstats
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.chat_host import GreedyLogits, StandInSampler, profiled
from benchmarks.engine_runs import timed_into


def _draw(sampler, seeds, positions):
    meta = SimpleNamespace(seeds=torch.tensor(seeds), positions=torch.tensor(positions))
    return sampler(torch.zeros(len(seeds), 4), meta).sampled_token_ids.tolist()


def test_a_rows_token_depends_on_its_seed_and_position_only():
    sampler = StandInSampler(vocab=1000, eos=2, eos_every=8)
    seeds = [11, -5, 2**62, 7, 11]
    positions = [0, 3, 9, 1, 1]
    alone = [_draw(sampler, [s], [p])[0] for s, p in zip(seeds, positions)]
    assert _draw(sampler, seeds, positions) == alone
    assert _draw(sampler, seeds[::-1], positions[::-1]) == alone[::-1]
    assert alone[0] != alone[4]  # the same seed one position on
    assert all(t == 2 or 3 <= t < 1000 for t in alone)


def test_eos_comes_about_once_in_eos_every_draws():
    sampler = StandInSampler(vocab=49152, eos=2, eos_every=16)
    n = 20000
    tokens = _draw(sampler, list(range(n)), [i % 50 for i in range(n)])
    share = tokens.count(2) / n
    assert 0.8 / 16 < share < 1.2 / 16
    assert len(set(tokens)) > n // 3  # the other tokens spread over the vocabulary


def test_a_greedy_rows_token_is_the_sampled_rows_for_its_seed_and_position():
    """--greedy's stand-in reads each row's request seed (its fixed data's, two's
    complement as the metadata holds it) and output index: the sampled run's tokens."""
    sampler = StandInSampler(vocab=1000, eos=2, eos_every=8)
    seeds = [11, 2**63 + 5, 2**62, 7, 11]
    positions = [0, 3, 9, 1, 1]
    rows = SimpleNamespace(fixed=[SimpleNamespace(seed=s) for s in seeds])
    greedy = GreedyLogits(rows, positions, lambda: sampler).argmax(dim=-1).tolist()
    as_int64 = [s - 2**64 if s >= 2**63 else s for s in seeds]
    assert greedy == _draw(sampler, as_int64, positions)
    listed = [SimpleNamespace(seed=s) for s in seeds[::-1]]  # StepRows or StepRow lists
    assert GreedyLogits(listed, positions[::-1], lambda: sampler).argmax().tolist() == greedy[::-1]


def test_the_greedy_run_answers_as_the_sampled_run_without_its_metadata(tmp_path):
    """The same lines at temperature 0 take the runner's plain-greedy path (no sampling
    metadata built) and give the sampled run's lines (ids and times aside)."""
    from benchmarks.chat_host import main

    results = {}
    for greedy in (False, True):
        out = tmp_path / f"out{greedy}"
        argv = ["--requests", "8", "--rows", "4", "--eos-every", "4", "--clock", "thread"]
        argv += ["--work", str(tmp_path / "work"), "--out", str(out)]
        main(argv + (["--greedy"] if greedy else []))
        results[greedy] = json.loads((out / "chat_host.json").read_text())

    def answers(result):
        lines = [json.loads(x) for x in Path(result["output"]).read_text().splitlines()]
        return sorted((x["custom_id"], x["response"]["body"]["choices"]) for x in lines)

    assert [r["greedy"] for r in results.values()] == [False, True]
    assert answers(results[True]) == answers(results[False])
    assert results[True]["completion_tokens"] == results[False]["completion_tokens"] > 8
    assert results[False]["mean_ms_all_steps"]["sampling_meta"] > 0
    assert results[True]["mean_ms_all_steps"]["sampling_meta"] == 0


def test_the_profile_is_written_where_its_folders_do_not_exist_yet(tmp_path):
    path = tmp_path / "not" / "made" / "chat.prof"
    with profiled(path):
        sorted(range(1000), key=lambda i: -i)
    stats = pstats.Stats(str(path))
    assert any(name == "<lambda>" for _, _, name in stats.stats)
    with profiled(None):
        pass
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["chat.prof"]


def test_runs_sharing_a_work_folder_keep_their_own_batch_and_output(tmp_path):
    """Two runs with one --work (its default is shared by every run on a machine): each
    writes its batch file and output in a folder of its own, and each job answers all of
    its requests (a run that cleared or appended to another's output lost lines)."""
    from benchmarks.chat_host import main

    results = []
    for k in range(2):
        out = tmp_path / f"out{k}"
        argv = ["--requests", "6", "--rows", "4", "--eos-every", "4"]
        main(argv + ["--work", str(tmp_path / "work"), "--out", str(out)])
        results.append(json.loads((out / "chat_host.json").read_text()))
    first, second = (Path(r["output"]) for r in results)
    assert first.parent != second.parent and first.parent.parent == tmp_path / "work"
    for result, output in zip(results, (first, second)):
        assert result["succeeded"] == 6
        assert len(output.read_text().splitlines()) == 6


def test_a_phase_excludes_the_timed_calls_it_makes():
    """Nested phases count once, each in its own (chat_host's `launch` holds `apply`,
    `prepare` and the forward): a clock that ticks one unit a reading shows it."""
    ticks = iter(range(100))
    spent: dict[str, float] = {}
    open_calls: list = []

    def clock():
        return float(next(ticks))

    inner = timed_into(spent, "inner", lambda: None, clock, open_calls)
    outer = timed_into(spent, "outer", lambda: inner() or inner(), clock, open_calls)
    outer()  # readings: outer 0, inner 1-2, inner 3-4, outer 5
    assert spent == {"inner": 2.0, "outer": 3.0}
    assert open_calls == []
    outer()  # each call adds to its phase
    assert spent == {"inner": 4.0, "outer": 6.0}

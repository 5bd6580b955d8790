"""An attention data-parallel rank's side of the runner (runner/paired.py), on the CPU
over stand-ins: the mode and decode bucket a step is offered in, the agreed bucket a
paired step replays (its own rows, then padding), and an idle rank's padding replay (the
decode graphs' buffers set to padding rows alone, the round's bucket replayed)."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from batchgen.runner.batch import NO_COPIES, StepCopies
from batchgen.runner.cuda_graphs import DecodeGraphs
from batchgen.runner.paired import (
    FIXED,
    VARIABLE,
    decode_bucket,
    idle_replay,
    offered_mode,
    paired_forward,
)
from batchgen.runner.staging import HostStaging

CPU = torch.device("cpu")


def _step(*tokens: int):
    entries = [SimpleNamespace(new_token_ids=[5] * n) for n in tokens]
    return SimpleNamespace(requests=entries, blind=False)


def test_a_decode_step_is_offered_fixed_where_it_can_run_the_fixed_exchange():
    cpu = SimpleNamespace(graphs=None, device=CPU)
    assert offered_mode(cpu, _step(1, 1, 1), NO_COPIES) == FIXED
    assert offered_mode(cpu, _step(1, 9), NO_COPIES) == VARIABLE  # a prefill beside
    per_layer = StepCopies(on_kv_written=lambda layer: None)
    assert offered_mode(cpu, _step(1, 1), per_layer) == VARIABLE
    # a GPU without graphs (enforce_eager): every step eager, under the variable exchange
    eager_gpu = SimpleNamespace(graphs=None, device=torch.device("cuda"))
    assert offered_mode(eager_gpu, _step(1, 1), NO_COPIES) == VARIABLE
    # with graphs: what the runner's replay test says
    said = []
    graphs = SimpleNamespace(
        graphs=object(),
        device=torch.device("cuda"),
        _graph_ok=lambda sched, copies: said.append(len(sched.requests)) or len(said) == 1,
    )
    assert offered_mode(graphs, _step(1, 1), NO_COPIES) == FIXED
    assert offered_mode(graphs, _step(1), NO_COPIES) == VARIABLE
    assert said == [2, 1]


def test_a_decode_step_offers_the_bucket_its_graph_replay_would_take():
    runner = SimpleNamespace(_max_num_seqs=100)
    assert [decode_bucket(runner, _step(*[1] * n)) for n in (1, 3, 8, 9, 99, 100)] == [
        *(1, 4, 8, 16, 100, 100)
    ]


class _Graph:
    def __init__(self, replayed: list, bs: int) -> None:
        self.replayed, self.bs = replayed, bs

    def replay(self) -> None:
        self.replayed.append(self.bs)


def test_an_idle_rank_replays_the_rounds_bucket_with_padding_alone():
    """Whatever an earlier replay left in the static buffers, the bucket's rows become
    padding rows: token 0, position 0, slot -1 (no KV written), a one-token context and
    the state pool's spare slot."""
    spare = 4
    states = [(torch.zeros(5, 2), torch.zeros(5, 2))]
    graphs = DecodeGraphs(
        None, [], "triton", 4, 8, 16, CPU, torch.float32, None, None, states, spare
    )
    replayed: list[int] = []
    graphs.graphs = {bs: _Graph(replayed, bs) for bs in graphs.buckets}
    for buf, value in (
        (graphs.input_ids, 7),
        (graphs.positions, 30),
        (graphs.slots, 12),
        (graphs.seq_lens, 31),
        (graphs.table, 3),
        (graphs.state_slots, 2),
    ):
        buf.fill_(value)
    runner = SimpleNamespace(
        graphs=graphs, stage=HostStaging(CPU), linear_states=states, deterministic=False
    )
    idle_replay(runner, 1)
    assert replayed == [1]
    row = [
        int(buf[0]) for buf in (graphs.input_ids, graphs.positions, graphs.slots, graphs.seq_lens)
    ]
    assert row == [0, 0, -1, 1]
    assert int(graphs.state_slots[0]) == spare
    assert int(graphs.table[0, 0]) == 0
    assert int(graphs.slots[1]) == 12  # past bucket 1: untouched
    idle_replay(runner, 4)  # a round whose largest batch needs bucket 4
    assert replayed == [1, 4]
    assert graphs.slots.tolist() == [-1] * 4 and graphs.input_ids.tolist() == [0] * 4
    assert graphs.state_slots.tolist() == [spare] * 4


class _Pairing:
    """A lockstep whose rounds answer `agreed` (mode, bucket), recording the offers."""

    def __init__(self, agreed: tuple[int, int]) -> None:
        self.agreed, self.offers = agreed, []

    @contextmanager
    def forward(self, mode: int, bucket: int = 0):
        self.offers.append((mode, bucket))
        yield self.agreed


def test_a_paired_decode_replays_the_agreed_bucket_not_its_own():
    """Three decodes offer bucket 4; where another rank needs 16, the runner replays 16;
    a VARIABLE round runs the same step eagerly, with no bucket."""
    calls = []
    for agreed, want in (((FIXED, 16), (True, 16)), ((VARIABLE, 4), (False, None))):
        runner = SimpleNamespace(
            graphs=object(),
            _graph_ok=lambda sched, copies: True,
            _max_num_seqs=64,
            pairing=_Pairing(agreed),
            _forward=lambda *args, graph, bucket=None: calls.append((graph, bucket)),
        )
        paired_forward(runner, _step(1, 1, 1), [], NO_COPIES, None)
        assert runner.pairing.offers == [(FIXED, 4)]
        assert calls[-1] == want


def test_a_replay_of_a_larger_bucket_pads_past_the_rows():
    graphs = DecodeGraphs(None, [], "triton", 8, 4, 16, CPU, torch.float32, None)
    replayed: list[int] = []
    graphs.graphs = {bs: _Graph(replayed, bs) for bs in graphs.buckets}
    graphs.slots.fill_(9)
    ids = np.array([5, 6], dtype=np.int64)
    table = np.array([[3], [4]], dtype=np.int64)
    graphs.run(ids, ids, ids, table, HostStaging(CPU), bucket=8)
    assert replayed == [8]
    assert graphs.input_ids.tolist() == [5, 6] + [0] * 6
    assert graphs.slots.tolist() == [5, 6] + [-1] * 6  # padding rows write no KV
    graphs.run(ids, ids, ids, table, HostStaging(CPU))  # no bucket: the rows' own
    assert replayed == [8, 2]
    with pytest.raises(ValueError, match="cannot replay bucket 3"):
        graphs.run(ids, ids, ids, table, HostStaging(CPU), bucket=3)

"""An attention data-parallel rank's side of the runner (runner/paired.py), on the CPU
over stand-ins: the mode and decode bucket a step is offered in, and an idle rank's
padding replay (the decode graphs' buffers set to padding rows alone, the round's bucket
replayed)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from batchgen.runner.batch import NO_COPIES, StepCopies
from batchgen.runner.cuda_graphs import DecodeGraphs
from batchgen.runner.paired import FIXED, VARIABLE, decode_bucket, idle_replay, offered_mode
from batchgen.runner.staging import HostStaging

CPU = torch.device("cpu")


def _step(*tokens: int):
    return SimpleNamespace(requests=[SimpleNamespace(new_token_ids=[5] * n) for n in tokens])


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

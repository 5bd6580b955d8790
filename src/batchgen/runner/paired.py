"""An attention data-parallel rank's forwards, paired with the other ranks' where the
runner launches them (engine/dp_attention.py; the rounds: distributed/lockstep.py).

The MoE layers' all-to-alls need every rank in every forward, and each rank runs its
own scheduler, so before each forward it launches (an eager one or a decode graph's
replay) a rank offers a mode, with FIXED its decode bucket (`decode_bucket`: the
captured batch size its step needs), and every rank runs its forward in the largest
mode offered:

    IDLE      0  no forward: offered at a tick's end only (the tick ends where every
                 rank offers it)
    FIXED     1  a decode step the fixed-capacity expert-parallel exchange takes: one
                 token a request, within a captured bucket; replayed from the decode
                 graphs where the runner has them, else (the CPU: no CUDA graphs) run
                 eagerly under `fixed_capacity()`
    VARIABLE  2  any other step (a prefill, a mixed step, a decode the graphs cannot
                 take): eager, under the variable exchange

In a VARIABLE round a rank whose decode could replay runs it eagerly, beside the others'
variable exchange; in a FIXED round every rank runs the fixed-capacity exchange of the
largest bucket offered, B: a rank replays B's graph, padding rows past its own batch,
an idle one padding rows alone (`idle_replay`: slot -1, no KV written); without graphs
each runs eagerly under `fixed_capacity(B)`. Bucket B's graph is captured with capacity
B, so every rank's all_to_all moves B x top_k rows to each rank, the largest batch's
bucket, not max_num_seqs; a rank that ran its own smaller bucket would break the
collectives' shapes. A GPU whose runner has no graphs (enforce_eager, a model its graphs
cannot capture) offers VARIABLE for every step.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import numpy as np
import torch

from batchgen.layers.batch_invariant import invariant_mode
from batchgen.runner.batch import SchedulerOutput, StepCopies
from batchgen.runner.cuda_graphs import bucket_for
from batchgen.runner.input_batch import StepRow

IDLE, FIXED, VARIABLE = 0, 1, 2


class Pairing(Protocol):
    """A rank's side of the rounds (distributed.lockstep.Lockstep)."""

    def forward(self, mode: int, bucket: int = 0) -> AbstractContextManager[tuple[int, int]]:
        """One forward offered in `mode` (with FIXED, its decode `bucket`): the agreed
        mode and bucket, inside (the forward runs there, under the fixed-capacity
        exchange of that bucket where FIXED)."""
        ...


def offered_mode(runner, sched: SchedulerOutput, copies: StepCopies) -> int:
    """What `runner` (a ModelRunner) offers for `sched`: FIXED for a decode step its
    graphs take (`_graph_ok`), or, without graphs on the CPU, a step of that shape (one
    token a request, no per-layer append); VARIABLE otherwise."""
    if runner.graphs is not None:
        return FIXED if runner._graph_ok(sched, copies) else VARIABLE
    one_token = sched.blind or all(len(r.new_token_ids) == 1 for r in sched.requests)
    decode = copies.on_kv_written is None and one_token
    return FIXED if decode and runner.device.type != "cuda" else VARIABLE


def decode_bucket(runner, sched: SchedulerOutput) -> int:
    """The captured batch size (cuda_graphs.BUCKETS) a decode step of `sched` replays on
    `runner`, a CPU runner's as its graphs would be."""
    return bucket_for(len(sched.requests), runner._max_num_seqs)


def paired_forward(
    runner,
    sched: SchedulerOutput,
    reqs: list[StepRow],
    copies: StepCopies,
    device_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The runner's forward of `sched` (ModelRunner._forward's result) in the mode the
    ranks agree on: a replay only where every rank runs the fixed-capacity exchange, of
    the bucket they agree on."""
    mode = offered_mode(runner, sched, copies)
    bucket = decode_bucket(runner, sched) if mode == FIXED else 0
    with runner.pairing.forward(mode, bucket) as (mode, bucket):
        if mode == FIXED and runner.graphs is not None:
            return runner._forward(sched, reqs, copies, device_ids, graph=True, bucket=bucket)
        return runner._forward(sched, reqs, copies, device_ids, graph=False)


def idle_replay(runner, bucket: int) -> None:
    """A FIXED round's forward on a rank with none of its own: the round's decode
    `bucket` replayed with padding rows alone (token 0, slot -1: no KV written, the
    state pool's spare slot), its output dropped. Captures the graphs first where none
    are (every rank does in the same round: their captures' collectives pair)."""
    empty = np.zeros(0, dtype=np.int64)
    states = None if runner.linear_states is None else empty
    table = np.zeros((0, 1), dtype=np.int64)
    with torch.inference_mode(), invariant_mode(runner.deterministic):
        runner.graphs.run(
            empty, empty, empty, table, runner.stage, state_slots=states, bucket=bucket
        )

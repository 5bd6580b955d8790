"""Tensor parallel steps: rank 0 schedules and samples, ranks 1..N-1 execute the same
steps on their share of the model. Each step goes to the workers as a `TPStep` message
(TPModelRunner sends it, `apply_step` runs it on a worker); the workers' lives and the
other messages are tp_peers.py (rank 0's side) and tp_worker.py (a worker's side), the
processes themselves distributed/workers.py.

    rank 0 (this process)                       rank r (spawned, tp_worker.worker_main)
    TPWorkers.start(): spawn, join the group    join the group, build its model share
    build its model share
    plan num_pages; on a GPU with no size  -->  PlanBegin: count its own peak
      given, by warm-up steps              -->  Profile: the same warm-up forward
      and the fewest pages of any rank     <--  PlanQuery: pages its GPU has left
    num_pages                              -->  Setup: num_pages, host_pages, eos ids
                                                -> its own pool (and host tier mirror)
    tier cost rule: Warmup.forward         -->  Profile: the same warm-up forward
    step: schedule; TPModelRunner.execute: ---> TPStep: issue its tier copies on its
          broadcast TPStep(SchedulerOutput,     shard (TierMirror), run the step's forward
          the tier copies submitted since       and lm_head waiting for them, sampling
          the last one), execute it             nothing (execute_unsampled)
    tier_worker_metrics()                  <->  TierMetricsQuery: its mirror's counters
    shutdown()                             -->  Shutdown: leave the group, exit

Every rank runs the same forward and compute_logits, so their collectives pair up. The
SchedulerOutput (plain data: a running request's new tokens and new pages, its fixed
data once) is broadcast as a pickled object each step over the group's gloo side
(`TPGroup.host_group`: no GPU staging, so no worker waits for its GPU to drain to read
the next step); rank 0's copy handles and hooks stay with it: the host tier's copies travel as
plain data (kv.tier_mirror.TierCopy), rank 0's tier deciding every one, each worker
replaying them on its own KV shard (same page ids, its heads) through its own CopyEngine,
ordered by the same contract (see tier_mirror.py for why a page is never reused before a
worker's copy touched it).
Copies rank 0 submits after a step's forward (write-through stores) go with the next
message, before any copy or forward that could reuse their pages. Decode is pipelined as
on one GPU (a worker samples nothing and never reads back, so it keeps up).

Decode CUDA graphs: each rank captures its own (its share of the model, its pool), at
the same step, bucket by bucket in the same order, with the all-reduces inside them
(NCCL collectives are captured like kernels); each step tells the workers whether rank 0
replays (TPStep.graph), so the ranks' collectives always pair: a replay's all-reduce is
over the bucket's padded rows, an eager step's over its own. Per-layer decode appends
(decode_append="layer"): the step carries rank 0's plan (TPStep.layer_stores), and each
worker copies every layer of those pages as its own forward writes it; its next forward
waits for those copies (TierMirror.issue), since rank 0 may reuse the pages by then.

A worker that dies makes rank 0 raise instead of hang: its next message fails (the gloo
connection closes), and a watcher thread aborts the NCCL group, ending the collectives
in flight (a graph's are not ones the NCCL watchdog would time out); the step they cut
short is never read (Workers.check, distributed/workers.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.distributed.messages import Message
from batchgen.distributed.workers import Workers
from batchgen.kv.tier_mirror import LayerStores, TierCopy, TierMirror
from batchgen.layers.tp_group import TPGroup
from batchgen.runner.batch import NO_COPIES, ModelRunnerOutput, SchedulerOutput, StepCopies
from batchgen.runner.model_runner import ModelRunner


@dataclass(frozen=True)
class TPStep(Message):
    """One step for the workers: the host tier's copies submitted since the last message
    (issued first, in order), then `sched` (None: only the copies), plain data: the
    worker's runner keeps its own record of the running requests, as rank 0's does. `pipelined`: a decode step queued after the previous one (rank 0's
    launch_decode), whose input tokens rank 0 broadcasts on the device (the previous
    step's samples, which no host has seen yet). `graph`: rank 0 replays a decode graph
    for it, so the worker replays its own of the same bucket (the collectives captured
    in the two pair up; an eager forward's would not). `layer_stores`
    (decode_append="layer"): the pages whose every layer the worker copies to host as
    its forward writes it, as rank 0 does (its hook's plan)."""

    sched: SchedulerOutput | None
    copies: list[TierCopy]
    pipelined: bool = False
    graph: bool = False
    layer_stores: LayerStores | None = None


class TPModelRunner(ModelRunner):
    """Rank 0's runner: each step is broadcast to the workers before it runs, with the
    host tier's copies submitted since the last step (`take_copies`), so every rank
    executes it. A pipelined decode step (launch_decode) is mirrored too: its input
    tokens, sampled here by the step still running, go to the workers by a device
    broadcast on the tensors' group, queued like any collective."""

    def __init__(
        self,
        *args,
        workers: Workers,
        take_copies: Callable[[], list[TierCopy]] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.workers = workers
        self.take_copies = take_copies or list

    def execute(self, sched: SchedulerOutput, copies: StepCopies = NO_COPIES) -> ModelRunnerOutput:
        self._send(sched, copies, pipelined=False)
        with self.workers.failures_named():
            out = super().execute(sched, copies)
        self.workers.check()  # a worker that ended mid-step left its collectives short
        return out

    def launch_decode(self, sched: SchedulerOutput, prev=None, copies: StepCopies = NO_COPIES):
        self._send(sched, copies, pipelined=prev is not None)
        with self.workers.failures_named():
            flight = super().launch_decode(sched, prev, copies)
        flight.check = self.workers.check  # once its tokens are read back
        return flight

    def launch_step(self, sched: SchedulerOutput, prev=None, copies: StepCopies = NO_COPIES):
        """A decode step that graphs can take is launched and mirrored (`launch_decode`);
        any other step would run on this rank alone, its collectives unpaired: the builder
        lets no overlap launch one on several ranks (executor.size > 1)."""
        if self._graph_ok(sched, copies) and (sched.blind or all(r.sample for r in sched.requests)):
            return self.launch_decode(sched, prev, copies)
        raise RuntimeError("a tensor-parallel rank 0 launches decode steps only")

    def _pipelined_ids(self, reqs, prev) -> torch.Tensor:
        ids = super()._pipelined_ids(reqs, prev).to(torch.int64)
        return self.workers.tp.broadcast(ids)

    def _send(self, sched: SchedulerOutput, copies: StepCopies, pipelined: bool) -> None:
        """The step goes as it is (plain data); this rank's copy handles stay here: the
        workers issue the tier's copies on their shards and wait on their own."""
        graph = self._graph_ok(sched, copies)  # what _forward decides for this step, next
        stores = getattr(copies.on_kv_written, "plan", None)  # a LayerStoreHook's
        self.workers.send(TPStep(sched, self.take_copies(), pipelined, graph, stores))


def apply_step(
    message: TPStep,
    runner: ModelRunner,
    mirror: TierMirror | None,
    device: torch.device,
    tp: TPGroup,
) -> None:
    """A worker's side of a step: its copies are issued before its forward, which waits
    for them (rule 3); the forward samples nothing. A readback mismatch under
    batchgen_debug raises here, ending the worker, so rank 0's next broadcast fails."""
    forward = message.sched is not None
    waits = mirror.issue(message.copies, forward) if mirror is not None else []
    if not forward:
        return
    hook = None
    if message.layer_stores is not None:  # decode_append="layer", as on rank 0
        plan = message.layer_stores
        hook = lambda layer: mirror.store_layer(plan, layer)  # noqa: E731
    device_ids = None
    if message.pipelined:  # rank 0's samples of the step before, on the device
        n = len(message.sched.requests)
        device_ids = torch.empty(n, dtype=torch.int64, device=device)
        tp.broadcast(device_ids)
    runner.execute_unsampled(
        message.sched,
        StepCopies(wait_for=waits, on_kv_written=hook),
        device_ids,
        graph=message.graph,
    )

"""Tensor parallel at engine level: rank 0 schedules and samples, ranks 1..N-1 execute
the same steps on their share of the model.

    rank 0 (this process)                       rank r (spawned, worker_main)
    start_workers(): spawn, join the group      join the group, build its model share
    build its model share
    plan num_pages; on a GPU with no size  -->  {"plan": "begin"}: count its own peak
      given, by warm-up steps              -->  {"profile": n}: the same warm-up forward
      and the fewest pages of any rank     <--  {"query": "plan"}: pages its GPU has left
    num_pages                              -->  setup: num_pages, host_pages, eos ids
                                                -> its own pool (and host tier mirror)
    tier cost rule: _profile_forward       -->  {"profile": n}: the same warm-up forward
    step: schedule; TPModelRunner.execute: ---> TPStep: issue its tier copies on its
          broadcast TPStep(SchedulerOutput,     shard (TierMirror), run the step's forward
          the tier copies submitted since       and lm_head waiting for them, sampling
          the last one), execute it             nothing (execute_unsampled)
    tier_worker_metrics()                  -->  pending copies, then its mirror's counters
    shutdown(): broadcast None             -->  leave the group, exit

Every rank runs the same forward and compute_logits, so their collectives pair up. The
SchedulerOutput is broadcast as a pickled object each step over the group's gloo side
(`TPGroup.host_group`: no GPU staging, so no worker waits for its GPU to drain to read
the next step), without its copy handles and hooks: the host tier's copies travel as
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
short is never read (TPWorkers.check).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from multiprocessing import connection as mp_connection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batchgen.config import EngineConfig
from batchgen.distributed import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    local_init_method,
)
from batchgen.engine.decode_graphs import build_decode_graphs, decode_split_plan
from batchgen.engine.limits import max_model_len
from batchgen.engine.memory import (
    begin_peak,
    build_state_pool,
    pages_left,
    remake_pool,
    warmup_forward,
)
from batchgen.kv.copy_engine import CopyEngine
from batchgen.kv.host_pool import HostPool
from batchgen.kv.layout import KVLayout
from batchgen.kv.page_pool import PagePool
from batchgen.kv.state_pool import HostStatePool
from batchgen.kv.tier_mirror import LayerStores, TierCopy, TierMirror
from batchgen.layers.tp_group import TPGroup
from batchgen.models.loader import ModelSource, build_model, gguf_read_once
from batchgen.models.registry import model_class
from batchgen.runner.batch import ModelRunnerOutput, SchedulerOutput
from batchgen.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def check_supported(config: EngineConfig, device: torch.device) -> None:
    """ValueError when GPUs are short: each rank needs its own (NCCL refuses two ranks on
    one device)."""
    size = config.tensor_parallel_size
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(
            f"tensor_parallel_size={size} needs {size} GPUs, one a rank; "
            f"{torch.cuda.device_count()} visible"
        )


def _check_shares(hf_config, size: int, max_positions: int) -> None:
    """The model's own ValueError (naming the number that does not divide: KV heads,
    heads, ...) when it cannot be split over `size` ranks. Rank 0's share is built on the
    meta device (no memory, no weights read, no collective), before any worker is
    spawned: otherwise each worker fails with its traceback before rank 0 says why."""
    with torch.device("meta"):
        model_class(hf_config)(hf_config, max_positions, tp=TPGroup(rank=0, size=size))


@dataclass
class TPStep:
    """One step for the workers: the host tier's copies submitted since the last message
    (issued first, in order), then `sched` (None: only the copies), without handles or
    hooks. `pipelined`: a decode step queued after the previous one (rank 0's
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


class TPWorkers:
    """Rank 0's handle on the other ranks: started with `start`, fed with `send`.

    A watcher thread waits on the workers' processes. One that ends before `shutdown` is
    recorded in `exited` (rank: exit code), and under NCCL the tensors' group is aborted:
    a collective captured in a decode graph is not one the NCCL watchdog times out, so
    rank 0 would otherwise wait forever on the step it was replaying. `check()` (after
    each of rank 0's waits for its GPU, and before each message) raises, so the tokens of
    a step the abort cut short are never used."""

    def __init__(self, processes: list, tp: TPGroup, nccl: bool = False) -> None:
        self.processes = processes
        self.tp = tp
        self.nccl = nccl
        self.exited: dict[int, int | None] = {}
        self._stopping = False
        self._watcher = threading.Thread(target=self._watch, name="batchgen-tp-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        waiting = {p.sentinel: (rank, p) for rank, p in enumerate(self.processes, 1)}
        while waiting:
            for sentinel in mp_connection.wait(list(waiting)):
                rank, process = waiting.pop(sentinel)
                if self._stopping:
                    continue
                self.exited[rank] = _exit_code(process)  # before the abort wakes rank 0
                logger.error(
                    "tensor-parallel worker rank %d exited with code %s", rank, self.exited[rank]
                )
                if self.nccl:  # the error to report is the exit, raised by check()
                    _abort_collectives(self.tp)

    @contextmanager
    def failures_named(self, grace_s: float = 2.0) -> Iterator[None]:
        """An error from a collective in the block (gloo: the peer's connection reset)
        becomes check()'s, naming the rank, where a worker has ended (waiting up to
        grace_s for the watcher to see it: a worker that raised may still be exiting);
        any other error passes unchanged, grace_s later."""
        try:
            yield
        except RuntimeError as e:
            deadline = time.monotonic() + grace_s
            while not self.exited and time.monotonic() < deadline:
                time.sleep(0.01)
            try:
                self.check()
            except RuntimeError as named:
                raise named from e
            raise

    def check(self) -> None:
        """RuntimeError naming the workers that ended before shutdown, if any."""
        if self.exited:
            codes = ", ".join(f"{r}: {c}" for r, c in sorted(self.exited.items()))
            raise RuntimeError(
                f"tensor-parallel worker rank(s) {sorted(self.exited)} stopped responding: "
                f"exited (rank: exit code) {codes}; its log says why"
            )

    @classmethod
    def start(cls, config: EngineConfig, source: ModelSource) -> TPWorkers:
        """Spawn ranks 1..N-1 and join the group as rank 0 (_check_shares first)."""
        size = config.tensor_parallel_size
        hf_config = source.load_config()
        _check_shares(hf_config, size, max_model_len(config, hf_config))
        init = local_init_method()
        ctx = mp.get_context("spawn")
        processes = [
            ctx.Process(target=worker_main, args=(rank, size, init, config, source), daemon=True)
            for rank in range(1, size)
        ]
        for p in processes:
            p.start()
        try:
            tp = init_tensor_parallel(0, size, _backend(config), init)
        except Exception:
            _kill(processes)
            raise
        return cls(processes, tp, nccl=_backend(config) == "nccl")

    def send(self, message) -> None:
        """Broadcast a picklable message (a SchedulerOutput, a setup dict, None to stop)
        from rank 0; RuntimeError naming dead workers when one has ended or the
        broadcast fails."""
        if message is not None:
            self.check()
        try:
            dist.broadcast_object_list([message], src=0, group=self.tp.host_group)
        except RuntimeError as e:
            dead = [r for r, p in enumerate(self.processes, 1) if not p.is_alive()]
            raise RuntimeError(
                f"tensor-parallel worker rank(s) {dead or '?'} stopped responding: {e}"
            ) from e

    def reconfigure(self, num_pages: int, copies: list[TierCopy]) -> list[str]:
        """Every worker's pool re-created with num_pages pages, after the tier copies
        rank 0 submitted since its last message; what failed, by rank (a worker whose
        allocation failed re-made a pool of its old size)."""
        self.send(TPStep(None, copies))
        self.send({"query": "reconfigure", "num_pages": num_pages})
        return [error for error in self.gather() if error]

    def plan_begin(self) -> None:
        """The memory plan (memory.PlanPeers): each worker starts counting its peak; the
        warm-up steps rank 0's profile sends follow."""
        self.send({"plan": "begin"})

    def plan_pages(self) -> list[int]:
        """The memory plan: the pages each worker's GPU has left after those steps, rank
        1 first."""
        self.send({"query": "plan"})
        return self.gather()

    def gather(self) -> list:
        """What each worker answered the last message with, rank 1 first."""
        replies = [None] * self.tp.size
        dist.gather_object(None, replies, dst=0, group=self.tp.host_group)
        return replies[1:]

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the workers (they leave the group) and leave it too."""
        self._stopping = True
        try:
            if not self.exited and all(p.is_alive() for p in self.processes):
                try:
                    self.send(None)
                except RuntimeError as e:  # whatever stopped them is the error to report
                    logger.warning("tensor-parallel shutdown: %s", e)
            for p in self.processes:
                p.join(timeout_s)
        finally:
            _kill(self.processes)
            destroy_tensor_parallel()


class TPModelRunner(ModelRunner):
    """Rank 0's runner: each step is broadcast to the workers before it runs, with the
    host tier's copies submitted since the last step (`take_copies`), so every rank
    executes it. A pipelined decode step (launch_decode) is mirrored too: its input
    tokens, sampled here by the step still running, go to the workers by a device
    broadcast on the tensors' group, queued like any collective."""

    def __init__(
        self,
        *args,
        workers: TPWorkers,
        take_copies: Callable[[], list[TierCopy]] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.workers = workers
        self.take_copies = take_copies or list

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._send(sched, pipelined=False)
        with self.workers.failures_named():
            out = super().execute(sched)
        self.workers.check()  # a worker that ended mid-step left its collectives short
        return out

    def launch_decode(self, sched: SchedulerOutput, prev=None):
        self._send(sched, pipelined=prev is not None)
        with self.workers.failures_named():
            flight = super().launch_decode(sched, prev)
        flight.check = self.workers.check  # once its tokens are read back
        return flight

    def _pipelined_ids(self, sched: SchedulerOutput, prev) -> torch.Tensor:
        ids = super()._pipelined_ids(sched, prev).to(torch.int64)
        dist.broadcast(ids, src=0, group=self.workers.tp.group)
        return ids

    def _send(self, sched: SchedulerOutput, pipelined: bool) -> None:
        bare = replace(sched, wait_for=[], on_kv_written=None)  # the workers wait on theirs
        graph = self._graph_ok(sched)  # what _forward decides for this step, next
        stores = getattr(sched.on_kv_written, "plan", None)  # a LayerStoreHook's
        self.workers.send(TPStep(bare, self.take_copies(), pipelined, graph, stores))


def worker_main(rank: int, size: int, init: str, config: EngineConfig, source) -> None:
    """A worker rank's life: join, build its share of the model, then serve rank 0's
    messages until None: the setup (its own page pool, and host tier mirror, of the
    pages rank 0 planned), warm-up forwards, steps, metric queries."""
    torch.set_num_threads(max(1, torch.get_num_threads() // size))
    tp = init_tensor_parallel(rank, size, _backend(config), init)
    try:
        with gguf_read_once():  # config and weights from one parse of a GGUF
            hf_config = source.load_config()
            device = _device(config, rank)
            dtype = config.torch_dtype(source.checkpoint_dtype(hf_config), device)
            model = build_model(
                source,
                hf_config,
                dtype,
                device,
                max_model_len(config, hf_config),
                config.load_format,
                config.seed,
                tp=tp,
            )
        worker = _Worker(config, model, hf_config, device, dtype, tp)
        while (message := _receive(tp)) is not None:
            reply = worker.handle(message)
            if isinstance(message, dict) and message.get("query"):
                dist.gather_object(reply, None, dst=0, group=tp.host_group)
    except BaseException:
        # rank 0 gone (its messages' connection reset) or this rank failed: a collective
        # it queued (a replayed graph's) may wait forever on rank 0, and leaving the
        # group would wait for it, holding this GPU; an abort ends it
        if _backend(config) == "nccl":
            _abort_collectives(tp)
        raise
    finally:
        destroy_tensor_parallel()


class _Worker:
    """A worker rank's state: its model share, and once set up its page pool, runner and
    host tier mirror."""

    def __init__(self, config: EngineConfig, model, hf_config, device, dtype, tp) -> None:
        self.config, self.model, self.hf_config = config, model, hf_config
        self.device, self.dtype, self.tp = device, dtype, tp
        # its KV share (model.kv_state: its KV heads; under MLA the whole latent,
        # replicated), the same pages as rank 0
        num_kv_layers = getattr(model, "num_kv_layers", hf_config.num_hidden_layers)
        self.layout = KVLayout.of(model.kv_state, num_kv_layers, config.page_size, dtype)
        self.backend = config.resolved_attention_backend(device)
        # its heads of the compressed state (models with linear-attention layers), the
        # same slots as rank 0's; built before the warm-up profile, as on rank 0
        self.state_pool = build_state_pool(model, config, dtype, device)
        self.runner: ModelRunner | None = None
        self.pool: PagePool | None = None
        self.mirror: TierMirror | None = None

    def _linear_states(self):
        return None if self.state_pool is None else self.state_pool.layer_states()

    def handle(self, message):
        """Act on one message from rank 0; what a query answers (None otherwise). A
        step's copies are issued before its forward, which waits for them (rule 3); a
        readback mismatch under batchgen_debug raises here, ending this rank, so rank
        0's next broadcast fails."""
        if isinstance(message, TPStep):
            forward = message.sched is not None
            waits = self.mirror.issue(message.copies, forward) if self.mirror is not None else []
            if forward:
                hook = None
                if message.layer_stores is not None:  # decode_append="layer", as on rank 0
                    plan, mirror = message.layer_stores, self.mirror
                    hook = lambda layer: mirror.store_layer(plan, layer)  # noqa: E731
                device_ids = None
                if message.pipelined:  # rank 0's samples of the step before, on the device
                    n = len(message.sched.requests)
                    device_ids = torch.empty(n, dtype=torch.int64, device=self.device)
                    dist.broadcast(device_ids, src=0, group=self.tp.group)
                self.runner.execute_unsampled(
                    replace(message.sched, wait_for=waits, on_kv_written=hook),
                    device_ids,
                    graph=message.graph,
                )
        elif "profile" in message:
            warmup_forward(
                self.model,
                self.layout,
                self.device,
                self.hf_config,
                message["eos_token_ids"],
                message["profile"],
                self.backend,
                linear_states=self._linear_states(),
                state_slot=self.config.max_num_seqs,  # the spare slot (build_state_pool)
                max_len=message["max_len"],
            )
        elif "plan" in message:
            begin_peak(self.device)
        elif message.get("query") == "plan":
            return pages_left(self.config, self.layout, self.device)
        elif message.get("query") == "reconfigure":
            return self.reconfigure(message["num_pages"])
        elif "query" in message:  # the mirror's counters, once its copies are done
            if self.mirror is None:
                return None
            self.mirror.drain()
            return vars(self.mirror.metrics).copy()
        else:
            self._setup(message)
        return None

    def reconfigure(self, num_pages: int) -> str | None:
        """Rank 0's reconfigure on this rank: once the copies it was sent are done, the
        pool is released and one of num_pages pages made (the same page ids as rank 0's,
        its heads). None, or what failed: then a pool of the old size is made again."""
        if self.mirror is not None:
            self.mirror.drain()
        old = self.pool.num_pages
        self._attach(None)
        pool, error = remake_pool(self.layout, num_pages, old, self.device)
        self._attach(pool)
        return None if error is None else f"rank {self.tp.rank}: {error}"

    def _attach(self, pool: PagePool | None) -> None:
        """Point the runner and the tier mirror at `pool` (None: at nothing, so the old
        pool's memory can go)."""
        self.pool = pool
        self.runner.set_kv_caches([] if pool is None else pool.layer_caches())
        if self.mirror is not None:
            self.mirror.device_pool = pool

    def _setup(self, setup: dict) -> None:
        """Its pool of rank 0's pages, its host tier mirror, and a runner that decodes as
        rank 0's does: the same attention backend, and CUDA graphs where rank 0 replays
        them (decode_graphs.py)."""
        config, device, model = self.config, self.device, self.model
        pool = self.pool = PagePool(self.layout, setup["num_pages"], device)
        max_len = max_model_len(config, self.hf_config)
        copies = None
        if setup["host_pages"]:
            pin = device.type == "cuda"
            host = HostPool(self.layout, setup["host_pages"], pin=pin)
            states = None
            if setup.get("host_state_slots"):
                host_states = HostStatePool(self.state_pool.layout, setup["host_state_slots"], pin)
                states = (self.state_pool, host_states)
            # one copy stream: copies run in rank 0's submission order (tier_mirror.py)
            copies = CopyEngine(device, num_streams=1, issue=config.tier_copy_issue)
            self.mirror = TierMirror(pool, host, copies, config.batchgen_debug, states)
        backend = setup["attention_backend"]
        plan = decode_split_plan(config, model, self.layout, self.dtype, device, backend, max_len)
        graphs = None
        if setup["graphs"]:
            graphs = build_decode_graphs(
                config,
                model,
                pool.layer_caches(),
                backend,
                plan,
                self.hf_config.hidden_size,
                device,
                self.dtype,
                max_len,
                copies=copies,  # the mirror's: paused while a graph is captured
                state_pool=self.state_pool,
            )
        self.runner = ModelRunner(
            model,
            pool.layer_caches(),
            config.page_size,
            device,
            self.hf_config.vocab_size,
            setup["eos_token_ids"],
            attention_backend=backend,
            graphs=graphs,
            split_plan=plan,
            max_num_seqs=config.max_num_seqs,
            max_pages=-(-max_len // config.page_size),
            seed=config.seed,
            linear_states=self._linear_states(),
        )
        self.runner.warm_logits(config.max_step_rows, self.hf_config.hidden_size, self.dtype)


def _receive(tp: TPGroup):
    box = [None]
    dist.broadcast_object_list(box, src=0, group=tp.host_group)
    return box[0]


def _backend(config: EngineConfig) -> str:
    return "nccl" if config.torch_device().type == "cuda" else "gloo"


def _device(config: EngineConfig, rank: int) -> torch.device:
    device = config.torch_device()
    return (
        torch.device("cuda", rank % torch.cuda.device_count()) if device.type == "cuda" else device
    )


def _abort_collectives(tp: TPGroup) -> None:
    """End every NCCL collective in flight on this rank's tensors' group (a replayed
    graph's too: NCCL's watchdog does not time those out). Logged if it fails."""
    try:
        tp.group.abort()
    except Exception:
        logger.exception("aborting the tensor-parallel NCCL group failed")


def _exit_code(process, timeout_s: float = 5.0) -> int | None:
    """The exit code of a process that has ended (its sentinel is ready). Another thread
    may be reaping it at the same moment (join), so it can read None for a while."""
    deadline = time.monotonic() + timeout_s
    while (code := process.exitcode) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return code


def _kill(processes: list) -> None:
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(10)

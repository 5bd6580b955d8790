"""Attention data parallel: D ranks in one engine, each running its own share of the
requests over its own KV pages, state slots and host tier, their forwards in lockstep
so that the MoE layers' collectives pair up (vLLM's data_parallel_size with
enable_expert_parallel; SGLang's --enable-dp-attention).

    rank 0 (the caller): DPEngine                 rank r (spawned): dp_rank.worker_main
      add_request: the rank holding the fewest      its own EngineCore, built as rank 0's
        tokens takes it (its seed fixed here)
      step(): DPStep(new?, aborts)           -->    its new requests added, aborts
        each worker's new requests, to it   -->     dropped, one step of its engine
        alone; rank 0's own tick (DPRank)           (none if idle);
        forwards paired by lockstep rounds  <-->    every forward paired: a dummy one
                                                    where it has none
        finished requests of every rank     <--     TickResult: finished, failed,
                                                    error, more to do?
      metrics(): every rank's summed        <->     DPQuery("metrics")

A request's data goes to its rank once (the tick after it arrived); a tick's message is
otherwise empty, whatever the ranks hold (metrics()["step_message_bytes"]). A request's
seed is fixed by rank 0 from its arrival index, as one engine would (runner/sampler.py:
noise is a hash of the seed and the position), so a sampled row draws the same tokens
on whatever rank it runs. Dense layers and attention weights are replicated on every
rank; the MoE layers are expert parallel over the ranks (layers/expert_parallel.py,
each rank its own tokens: builder_plan.expert_parallel).

Decode CUDA graphs: each rank's runner pairs every forward where it launches it, an
eager one or a graph's replay (runner/paired.py, distributed/lockstep.py). A round in
which every rank's step is a decode a captured bucket takes (or a rank is idle) runs the
fixed-capacity expert-parallel exchange of the largest bucket any rank's decode needs
(the ranks agree it in the round): each rank replays that bucket's graph, padding rows
past its own batch, the exchange captured inside, an idle rank the bucket's padding
alone; a round in which
any rank prefills (or runs a decode the graphs cannot take) runs every rank eagerly
under the variable exchange. On the CPU (no CUDA graphs) the same rounds run the
fixed-capacity exchange eagerly, which tests/distributed/test_dp_modes.py checks. The
capture itself needs a machine of several GPUs, and none has been lent: decode graphs
under attention data parallel have not yet run (tests/distributed/test_dp_gpu.py, two
GPUs, DP 2 with graphs against DP 2 eager, is skipped until one runs it). Its cost is
to be measured there: a rank's capacity is the round's bucket B, so each MoE layer of a
replay moves D x B x top_k rows a rank each way (the worst case, every pair to one
rank), where the variable exchange moves the pairs alone; on GPUs enforce_eager=True
keeps every step on the variable exchange.

Not done here: reconfigure(), and tensor parallel inside a data-parallel rank (refused:
it needs a tensors' group per rank beside the expert-parallel group over all of them,
each rank an executor of its own workers, and for MLA it would shrink no rank's latent
cache; D x T ranks run as data_parallel_size=D*T instead). The ranks run as processes
of this host, or as Ray actors over several hosts with distributed_executor_backend="ray"
(distributed/ray_ranks.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from batchgen.config import EngineConfig
from batchgen.distributed.lockstep import Lockstep
from batchgen.distributed.messages import DPQuery, DPRequest, DPStep
from batchgen.distributed.workers import Workers
from batchgen.engine.builder_load import load_engine, ranks_here
from batchgen.engine.builder_plan import has_moe_layers
from batchgen.engine.dp_rank import DPRank, TickResult, worker_main
from batchgen.engine.engine_core import EngineCore, EngineStats, RequestsFailed
from batchgen.engine.memory import check_host_budget
from batchgen.engine.request import Request, RequestStatus
from batchgen.models.default_model import default_model_path
from batchgen.models.loader import ModelSource
from batchgen.runner.sampler import request_seed
from batchgen.sampling_params import SamplingParams


@dataclass(frozen=True)
class RankRequest:
    """A request some rank holds, as rank 0 sees it: its id and status."""

    request_id: str
    status: RequestStatus


def wants_dp_attention(config: EngineConfig) -> bool:
    """Whether config asks for attention data parallel (data_parallel_size > 1 with
    enable_expert_parallel). ValueError for data_parallel_size > 1 without it: that is
    the Ray engines of `batchgen run --data-parallel`, not one LLM."""
    if config.data_parallel_size == 1:
        return False
    if not config.enable_expert_parallel:
        raise ValueError(
            f"data_parallel_size={config.data_parallel_size} without "
            "enable_expert_parallel=True: independent data-parallel engines run through "
            "`batchgen run --data-parallel N` (Ray); one LLM splits its requests over "
            "ranks only for a mixture-of-experts model with enable_expert_parallel=True"
        )
    if config.tensor_parallel_size != 1:
        dp, tp = config.data_parallel_size, config.tensor_parallel_size
        raise ValueError(
            f"data_parallel_size={dp} with tensor_parallel_size={tp}: attention data "
            "parallel runs one process a rank (tensor_parallel_size=1) for now; tensor "
            "parallel inside a rank would split its attention weights but not its MLA "
            "latent cache (one latent head, held whole by every tensor-parallel rank). "
            f"For {dp * tp} ranks use data_parallel_size={dp * tp} with "
            "enable_expert_parallel=True (SGLang's --enable-dp-attention "
            f"--tp {dp * tp} --dp {dp * tp}), or tensor_parallel_size={dp * tp} with "
            "enable_expert_parallel=True"
        )
    return True


class DPEngine:
    """Rank 0's engine over D data-parallel ranks, with EngineCore's interface as the
    API uses it: add_request, step, has_unfinished, abort, validate, metrics, shutdown.
    `local` is rank 0's own engine (its model is `model`); `held[r]` the tokens rank r's
    unfinished requests hold at most (prompt plus max_tokens), which admission balances;
    `lockstep` rank 0's side of the rounds, its runner's pairing (load_engine's)."""

    def __init__(self, local: EngineCore, lockstep: Lockstep, workers: Workers, size: int) -> None:
        self.local = local
        self.rank0 = DPRank(local, lockstep)
        self.workers = workers
        self.size = size
        # LLM keeps read_ahead requests in the engine: enough for every rank
        read_ahead = local.config.read_ahead * size
        self.config = replace(local.config, max_queued_requests=read_ahead)
        self.tokenizer, self.model = local.tokenizer, local.model
        self.eos_token_ids, self.max_model_len = local.eos_token_ids, local.max_model_len
        self._prompt_tokens = 0
        self._ticks = 0
        self.held = [0] * size
        self._where: dict[str, tuple[int, int]] = {}  # request id -> (rank, tokens)
        self._outbox: list[DPRequest] = []
        self._aborts: list[str] = []
        self._busy = [False] * size  # each worker's answer to the last tick
        self._tokens = [0] * size  # each rank's output tokens so far
        self._arrival = 0
        self._last: tuple[tuple[int, ...], int] | None = None  # the last prompt, its rank
        self._failed: dict[str, str] = {}
        self._early: list[Request] = []  # finished by a tick that raised RequestsFailed

    @classmethod
    def start(cls, config: EngineConfig) -> DPEngine:
        """Spawn ranks 1..D-1 (each builds its engine from config), join them as rank 0
        and build its own; a rank that fails to start fails this, naming it."""
        size = config.data_parallel_size
        _check_moe(config)
        check_host_budget(config.host_kv_size_gib, ranks_here(config, size))
        backend = "nccl" if config.torch_device().type == "cuda" else "gloo"
        if backend == "nccl":  # decode graphs not yet run on GPUs: the module's docstring
            local = config.distributed_executor_backend == "mp"  # Ray: the cluster's GPUs
            if local and torch.cuda.device_count() < size:
                raise ValueError(
                    f"data_parallel_size={size} needs {size} GPUs, one a rank; "
                    f"{torch.cuda.device_count()} visible"
                )
        workers = Workers.spawn(
            worker_main,
            (config,),
            size,
            backend,
            role="data-parallel",
            launcher=config.distributed_executor_backend,
        )
        try:
            lockstep = Lockstep(workers.tp.host_group, workers.check, workers.slice_s)
            with workers.failures_named():
                return cls(EngineCore(load_engine(config, lockstep)), lockstep, workers, size)
        except BaseException:
            workers.shutdown()
            raise

    def shutdown(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, what: str) -> None:
        self.local.validate(prompt_token_ids, params, what)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        validated: bool = False,
    ) -> None:
        """Queue one request on the rank holding the fewest tokens (the lowest such
        rank), or, where it has the prompt of the request added just before it (a
        prompt's n samples), on that one's rank, where its prefill is shared; it
        reaches a worker with the next step."""
        if not validated:
            self.validate(prompt_token_ids, params, f"request {request_id}")
        if request_id in self._where:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if params.seed is None:  # the seed one engine would give it (EngineCore.add_request)
            params = replace(params, seed=request_seed(self.local.config.seed, self._arrival))
        self._arrival += 1
        ids = tuple(prompt_token_ids)
        if self._last is not None and self._last[0] == ids:
            rank = self._last[1]  # a prompt's samples, added together: one prefill serves all
        else:
            rank = min(range(self.size), key=lambda r: (self.held[r], r))
        self._last = (ids, rank)
        tokens = len(prompt_token_ids) + (params.max_tokens or self.max_model_len)
        tokens = min(tokens, self.max_model_len)
        self.held[rank] += tokens
        self._where[request_id] = (rank, tokens)
        self._prompt_tokens += len(prompt_token_ids)
        if rank == 0:
            self.rank0.add([DPRequest(0, request_id, list(prompt_token_ids), params)])
        else:
            self._outbox.append(DPRequest(rank, request_id, list(prompt_token_ids), params))

    def abort(self, request_ids) -> None:
        """Drop unfinished requests: rank 0's now, the others' with the next step."""
        for rid in request_ids:
            where = self._where.pop(rid, None)
            if where is None:
                continue
            rank, tokens = where
            self.held[rank] -= tokens
            if rank == 0:
                self.local.abort([rid])
            else:
                self._outbox = [item for item in self._outbox if item.request_id != rid]
                self._aborts.append(rid)

    @property
    def stats(self) -> EngineStats:
        """Prompt tokens added, output tokens of every rank, ticks run."""
        return EngineStats(self._prompt_tokens, sum(self._tokens), self._ticks)

    @property
    def has_unfinished(self) -> bool:
        return (
            self.local.has_unfinished
            or bool(self._outbox)
            or any(self._busy[1:])
            or bool(self._aborts)
            or bool(self._early)
        )

    def step(self) -> list[Request]:
        """One tick on every rank: the new requests and aborts go out, every rank steps
        (forwards paired), and every rank's finished requests come back. Raises
        RequestsFailed, as EngineCore.step does, when a rank's step failed for some
        requests alone (dropped there); what the tick finished comes out of the next
        step(). A rank's error raises after every rank ended the tick."""
        new, self._outbox = self._outbox, []
        self.workers.send(DPStep(bool(new), tuple(self._aborts)))
        self._aborts = []
        with self.workers.failures_named():
            if new:  # each worker's own requests, to it alone
                own = [[item for item in new if item.rank == r] for r in range(1, self.size)]
                self.workers.scatter(own, DPStep)
            mine = self.rank0.tick()
            replies = self.workers.gather()
        self.workers.check()
        finished, self._early = self._early, []
        for rank, result in enumerate([mine, *replies]):
            self._take(rank, result, finished)
        self._ticks += 1
        if mine.error is not None:  # every rank finished the tick: it can go on
            raise mine.error
        for rank, result in enumerate(replies, 1):
            if result.error is not None:
                raise RuntimeError(
                    f"data-parallel rank {rank} failed in a step: "
                    f"{type(result.error).__name__}: {result.error}"
                ) from result.error
        if self._failed:
            failed, self._failed = self._failed, {}
            self._early = finished  # handed out by the next step()
            raise RequestsFailed({rid: RuntimeError(why) for rid, why in failed.items()})
        return finished

    def _take(self, rank: int, result: TickResult, finished: list[Request]) -> None:
        self._busy[rank] = result.unfinished
        self._tokens[rank] = result.output_tokens
        for req in result.finished:
            finished.append(req)
            self._forget(req.request_id)
        for rid, why in result.failed.items():
            self._failed[rid] = f"rank {rank}: {why}"
            self._forget(rid)

    def _forget(self, request_id: str) -> None:
        where = self._where.pop(request_id, None)
        if where is not None:
            self.held[where[0]] -= where[1]

    @property
    def requests(self) -> dict[str, RankRequest]:
        """The unfinished requests every rank holds, by id, with their status: a round
        trip to every worker (the batch job asks it once, when a signal stops admission,
        to drop the lines not started). Requests not yet sent to their rank are WAITING."""
        out = {rid: RankRequest(rid, req.status) for rid, req in self.local.requests.items()}
        for item in self._outbox:
            out[item.request_id] = RankRequest(item.request_id, RequestStatus.WAITING)
        for statuses in self.workers.ask(DPQuery("statuses")):
            out.update({rid: RankRequest(rid, status) for rid, status in statuses.items()})
        return out

    def rank_pages(self) -> list[dict[str, int]]:
        """Per rank (rank 0 first): request id -> the device pages it holds now."""
        return [self.rank0.pages(), *self.workers.ask(DPQuery("pages"))]

    def rank_slots(self) -> list[dict[str, int]]:
        """Per rank (rank 0 first): request id -> the state slot it holds now (each rank
        has its own slots; linear-attention models only)."""
        return [self.rank0.slots(), *self.workers.ask(DPQuery("slots"))]

    def rank_metrics(self) -> list[dict]:
        """Every rank's engine metrics, rank 0 first."""
        return [self.rank0.metrics(), *self.workers.ask(DPQuery("metrics"))]

    def metrics(self) -> dict:
        """Every rank's counters summed (integers, and the host tier's copy seconds; a
        rate or a cost: rank 0's; `dp_dummy_forwards`: forwards run only to pair another
        rank's), `steps` the
        ticks every rank stepped together, and what rank 0 sent the workers in them:
        `step_messages`, `step_message_bytes_total` and `step_message_bytes` (their
        mean size)."""
        ranks = self.rank_metrics()
        out = dict(ranks[0])
        for key, value in ranks[0].items():
            count = isinstance(value, int) and not isinstance(value, bool)
            if count or key.startswith("copy_seconds_"):
                out[key] = sum(m.get(key, 0) for m in ranks)
        out["steps"] = self._ticks
        out.update(self.workers.message_metrics(DPStep))
        return out


def _check_moe(config: EngineConfig) -> None:
    """ValueError, before any rank starts, for a model without experts: its ranks would
    be independent engines (Ray data parallel does that)."""
    model = config.model or default_model_path(config.cache_dir)
    hf_config = ModelSource.resolve(model, config.revision, config.cache_dir).load_config()
    if not has_moe_layers(hf_config):
        raise ValueError(
            f"enable_expert_parallel=True needs a mixture-of-experts model; "
            f"{type(hf_config).__name__} has no routed experts (for independent engines "
            "over a batch file use `batchgen run --data-parallel N`)"
        )


def start_engine(config: EngineConfig) -> EngineCore | DPEngine:
    """The engine config asks for: DPEngine for attention data parallel, else an
    EngineCore (tensor parallel or one process)."""
    if wants_dp_attention(config):
        return DPEngine.start(config)
    return EngineCore.from_config(config)

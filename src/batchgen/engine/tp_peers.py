"""Rank 0's handle on its tensor-parallel workers, with the engine's requests of them:
the N-rank `executor.Executor` (distributed.workers.Workers does the processes: spawn,
rendezvous, watcher, messages).
The workers' side is tp_worker.py (builder_load hands its worker_main to `start`: the
worker builds through the builder, which holds this handle); the steps they are sent,
tensor_parallel.py."""

from __future__ import annotations

import torch

from batchgen.config import EngineConfig
from batchgen.distributed.messages import PlanBegin, PlanQuery, Reconfigure, TierMetricsQuery
from batchgen.distributed.workers import Workers
from batchgen.engine.limits import max_model_len
from batchgen.engine.tensor_parallel import TPModelRunner, TPStep
from batchgen.kv.tiered import TieredKVManager
from batchgen.layers.expert_parallel import ExpertParallel
from batchgen.layers.tp_group import TPGroup
from batchgen.models.loader import ModelSource
from batchgen.models.registry import model_class


def check_supported(config: EngineConfig, device: torch.device) -> None:
    """ValueError when this host's GPUs are short: each rank needs its own (NCCL refuses
    two ranks on one device). Under Ray the cluster's GPUs count, its placement group's."""
    size = config.tensor_parallel_size
    local = config.distributed_executor_backend == "mp"
    if local and device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(
            f"tensor_parallel_size={size} needs {size} GPUs, one a rank; "
            f"{torch.cuda.device_count()} visible"
        )


def _check_shares(hf_config, size: int, max_positions: int, expert_parallel: bool) -> None:
    """The model's own ValueError (naming the number that does not divide: KV heads,
    heads, ...) when it cannot be split over `size` ranks. Rank 0's share is built on the
    meta device (no memory, no weights read, no collective), before any worker is
    spawned: otherwise each worker fails with its traceback before rank 0 says why."""
    tp = TPGroup(rank=0, size=size)
    ep = {"ep": ExpertParallel(tp)} if expert_parallel else {}
    with torch.device("meta"):
        model_class(hf_config)(hf_config, max_positions, tp=tp, **ep)


class TPWorkers(Workers):
    """Rank 0's handle on the other ranks (distributed.workers.Workers: spawn, watcher,
    messages), with the engine's requests of them: the executor of a tensor-parallel
    engine (executor.Executor; one rank's is executor.OneRank)."""

    runner_cls = TPModelRunner  # sends each step to the workers before it runs it

    @property
    def size(self) -> int:
        return self.tp.size

    def runner_args(self, tier: TieredKVManager | None) -> dict:
        """TPModelRunner's: these workers, and the tier's copies its steps hand them."""
        args = {"workers": self}
        if tier is not None:
            args["take_copies"] = tier.take_mirrored
        return args

    @classmethod
    def start(cls, config: EngineConfig, source: ModelSource, worker_main) -> TPWorkers:
        """Start ranks 1..N-1 (config.distributed_executor_backend: processes or Ray
        actors), each running worker_main(tp, config, source)
        (tp_worker.worker_main: it builds its share of the model, then serves rank 0's
        messages), and join the group as rank 0 (_check_shares first)."""
        size = config.tensor_parallel_size
        hf_config = source.load_config()
        max_len = max_model_len(config, hf_config)
        _check_shares(hf_config, size, max_len, config.enable_expert_parallel)
        return cls.spawn(
            worker_main,
            (config, source),
            size,
            backend(config),
            launcher=config.distributed_executor_backend,
        )

    def reconfigure(self, num_pages: int, tier: TieredKVManager | None) -> list[str]:
        """Every worker's pool re-created with num_pages pages, after the tier copies
        rank 0 submitted since its last message; what failed, by rank (a worker whose
        allocation failed re-made a pool of its old size)."""
        self.send(TPStep(None, _mirrored(tier)))
        return [error for error in self.ask(Reconfigure(num_pages)) if error]

    def tier_metrics(self, tier: TieredKVManager | None) -> list[dict | None]:
        """Each worker's host tier mirror counters (rank 1 first; None without the
        tier), once the tier's copies not sent yet and every copy before them reached
        and left it."""
        self.send(TPStep(None, _mirrored(tier)))
        return self.ask(TierMetricsQuery())

    def step_metrics(self) -> dict:
        """The step messages sent to the workers and their pickled bytes."""
        return self.message_metrics(TPStep)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the workers and leave the group; a second call does nothing (another
        engine's group may exist by then)."""
        if not self._stopping:
            super().shutdown(timeout_s)

    def plan_begin(self) -> None:
        """The memory plan (memory.PlanPeers): each worker starts counting its peak; the
        warm-up steps rank 0's profile sends follow."""
        self.send(PlanBegin())

    def plan_pages(self) -> list[int]:
        """The memory plan: the pages each worker's GPU has left after those steps, rank
        1 first."""
        return self.ask(PlanQuery())


def _mirrored(tier: TieredKVManager | None) -> list:
    """The tier's copies submitted since the last message (none without a tier)."""
    return [] if tier is None else tier.take_mirrored()


def backend(config: EngineConfig) -> str:
    """The tensors' backend: NCCL on GPUs, gloo on the CPU."""
    return "nccl" if config.torch_device().type == "cuda" else "gloo"

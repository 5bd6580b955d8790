"""Tensor parallel at engine level: rank 0 schedules and samples, ranks 1..N-1 execute
the same steps on their share of the model.

    rank 0 (this process)                       rank r (spawned, worker_main)
    start_workers(): spawn, join the group      join the group, build its model share
    build its model share, plan num_pages  -->  setup: num_pages, eos ids -> its own pool
    step: schedule; TPModelRunner.execute: ---> receive the SchedulerOutput; execute it
          broadcast the SchedulerOutput,        (its sample is dropped: rank 0's counts)
          execute it (collectives pair up)
    shutdown(): broadcast None             -->  leave the group, exit

Every rank runs the same forward and compute_logits, so their collectives pair up; the
SchedulerOutput is broadcast as a pickled object each step (a first version: no copy
handles or hooks, so no host tier, and no pipelined decode or CUDA graphs yet). A worker
that dies makes rank 0's next collective raise (gloo: the peer's connection closes; a
process group timeout otherwise) instead of hanging.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batchgen.config import EngineConfig
from batchgen.distributed import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    local_init_method,
)
from batchgen.engine.limits import max_model_len
from batchgen.kv.layout import KVLayout
from batchgen.kv.page_pool import PagePool
from batchgen.layers.tp_group import TPGroup
from batchgen.models.loader import ModelSource, build_model
from batchgen.runner.batch import ModelRunnerOutput, SchedulerOutput
from batchgen.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def check_supported(config: EngineConfig, device: torch.device) -> None:
    """ValueError naming what tensor_parallel_size > 1 cannot run with yet."""
    refused = []
    if config.host_kv_size_gib > 0:
        refused.append("the host KV tier (host_kv_size_gib > 0)")
    if device.type == "cuda" and not config.enforce_eager:
        refused.append("CUDA graphs (set enforce_eager=True)")
    if device.type == "cuda" and config.num_kv_pages is None and config.kv_cache_size_gib is None:
        refused.append("a pool sized by a profile forward (set num_kv_pages or kv_cache_size_gib)")
    if refused:
        raise ValueError(
            f"tensor_parallel_size={config.tensor_parallel_size} does not support "
            f"{' or '.join(refused)} yet"
        )


class TPWorkers:
    """Rank 0's handle on the other ranks: started with `start`, fed with `send`."""

    def __init__(self, processes: list, tp: TPGroup) -> None:
        self.processes = processes
        self.tp = tp

    @classmethod
    def start(cls, config: EngineConfig, source: ModelSource) -> TPWorkers:
        """Spawn ranks 1..N-1 and join the group as rank 0."""
        size = config.tensor_parallel_size
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
        return cls(processes, tp)

    def send(self, message) -> None:
        """Broadcast a picklable message (a SchedulerOutput, a setup dict, None to stop)
        from rank 0; RuntimeError naming dead workers when the broadcast fails."""
        try:
            dist.broadcast_object_list([message], src=0, group=self.tp.group)
        except RuntimeError as e:
            dead = [r for r, p in enumerate(self.processes, 1) if not p.is_alive()]
            raise RuntimeError(
                f"tensor-parallel worker rank(s) {dead or '?'} stopped responding: {e}"
            ) from e

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the workers (they leave the group) and leave it too."""
        try:
            if all(p.is_alive() for p in self.processes):
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
    """Rank 0's runner: each step is broadcast to the workers before it runs, so every
    rank executes it. Decode steps are not pipelined (launch_decode is not mirrored)."""

    def __init__(self, *args, workers: TPWorkers, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.workers = workers

    def can_launch_decode(self, sched: SchedulerOutput) -> bool:
        return False

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.workers.send(sched)
        return super().execute(sched)


def worker_main(rank: int, size: int, init: str, config: EngineConfig, source) -> None:
    """A worker rank's life: join, build its share of the model and its own page pool
    (the setup rank 0 broadcasts sizes it), execute every step it receives."""
    torch.set_num_threads(max(1, torch.get_num_threads() // size))
    tp = init_tensor_parallel(rank, size, _backend(config), init)
    try:
        hf_config = source.load_config()
        device = _device(config, rank)
        dtype = config.torch_dtype(source.checkpoint_dtype(hf_config), device)
        max_len = max_model_len(config, hf_config)
        model = build_model(
            source, hf_config, dtype, device, max_len, config.load_format, config.seed, tp=tp
        )
        setup = _receive(tp)
        if setup is None:  # rank 0 failed before its pool existed
            return
        # its own KV heads (model.kv_state), the same pages as rank 0
        layout = KVLayout.of(model.kv_state, hf_config.num_hidden_layers, config.page_size, dtype)
        pool = PagePool(layout, setup["num_pages"], device)
        runner = ModelRunner(
            model,
            pool.layer_caches(),
            config.page_size,
            device,
            hf_config.vocab_size,
            setup["eos_token_ids"],
            attention_backend=config.resolved_attention_backend(device),
            max_num_seqs=config.max_num_seqs,
            max_pages=-(-max_len // config.page_size),
            seed=config.seed,
        )
        while (sched := _receive(tp)) is not None:
            runner.execute(sched)
    finally:
        destroy_tensor_parallel()


def _receive(tp: TPGroup):
    box = [None]
    dist.broadcast_object_list(box, src=0, group=tp.group)
    return box[0]


def _backend(config: EngineConfig) -> str:
    return "nccl" if config.torch_device().type == "cuda" else "gloo"


def _device(config: EngineConfig, rank: int) -> torch.device:
    device = config.torch_device()
    return (
        torch.device("cuda", rank % torch.cuda.device_count()) if device.type == "cuda" else device
    )


def _kill(processes: list) -> None:
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(10)

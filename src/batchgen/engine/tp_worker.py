"""A tensor-parallel worker rank (1..N-1): its share of the model, then rank 0's
messages acted on until Shutdown (distributed.worker_rank.serve), each by the one handler
its type has in `_Worker.HANDLERS` (a message of any other type raises).

The worker builds what rank 0 builds, from the same config, of its own share, through
the builder's functions rank 0 runs: the model (its heads), the KV layout and the state
pool before the warm-up profile (builder_plan.Warmup, as rank 0's steps), then, on
Setup (rank 0's EnginePlan.setup()), the page pool of the pages rank 0 planned, the host
tier mirror, and its runner (builder.build_runner, as rank 0's).
"""

from __future__ import annotations

import torch

from batchgen.config import EngineConfig
from batchgen.distributed.messages import (
    Message,
    PlanBegin,
    PlanQuery,
    Profile,
    Reconfigure,
    Setup,
    TierMetricsQuery,
)
from batchgen.distributed.worker_rank import serve
from batchgen.engine.builder import build_runner
from batchgen.engine.builder_plan import Warmup, attention_backend, expert_parallel, kv_layout
from batchgen.engine.kernel_prep import kernels_prepared
from batchgen.engine.limits import max_model_len
from batchgen.engine.memory import (
    begin_peak,
    build_state_pool,
    pages_left,
    remake_pool,
    state_layout,
)
from batchgen.engine.tensor_parallel import TPStep, apply_step
from batchgen.kv.copy_engine import CopyEngine
from batchgen.kv.host_pool import HostPool
from batchgen.kv.page_pool import PagePool
from batchgen.kv.state_pool import HostStatePool
from batchgen.kv.tier_mirror import TierMirror
from batchgen.layers.tp_group import TPGroup
from batchgen.models.gguf_share import gguf_read_once
from batchgen.models.loader import ModelSource, build_model
from batchgen.runner.model_runner import ModelRunner


def worker_main(tp: TPGroup, config: EngineConfig, source: ModelSource) -> None:
    """A worker rank's life once it joined the group (distributed.workers spawns it):
    build its share of the model, then serve rank 0's messages until Shutdown."""
    with gguf_read_once():  # config and weights from one parse of a GGUF
        hf_config = source.load_config()
        device = _device(config, tp.rank)
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
            quantization=config.quantization,
            ep=expert_parallel(config, tp),
        )
    # this rank's kernels, as build_engine's on rank 0; its warm-ups come as messages, so
    # the preparation (autotuning kept on disk) lasts as long as the rank serves
    with kernels_prepared(device, state_layout(model, dtype) is not None, log_compiles=False):
        serve(tp, _Worker(config, model, hf_config, device, dtype, tp).handle)


class _Worker:
    """A worker rank's state: its model share, and once set up its page pool, runner and
    host tier mirror."""

    # one handler a message type (tests check every type has one)
    HANDLERS = {
        TPStep: "_step",
        Setup: "_setup",
        Profile: "_profile",
        PlanBegin: "_plan_begin",
        PlanQuery: "_plan_query",
        Reconfigure: "_reconfigure",
        TierMetricsQuery: "_tier_metrics",
    }

    def __init__(self, config: EngineConfig, model, hf_config, device, dtype, tp) -> None:
        self.config, self.model, self.hf_config = config, model, hf_config
        self.device, self.dtype, self.tp = device, dtype, tp
        # its KV share (its KV heads; under MLA the whole latent, replicated), the same
        # pages as rank 0
        self.layout = kv_layout(config, model, hf_config, dtype)
        self.backend = attention_backend(config, model, device)  # the warm-ups', as rank 0's
        self.max_len = max_model_len(config, hf_config)
        # its heads of the compressed state (models with linear-attention layers), the
        # same slots as rank 0's; built before the warm-up profile, as on rank 0
        self.state_pool = build_state_pool(model, config, dtype, device)
        self.runner: ModelRunner | None = None
        self.pool: PagePool | None = None
        self.mirror: TierMirror | None = None

    def handle(self, message: Message):
        """Act on one message from rank 0; what it replies (None for most). TypeError
        for a message of a type with no handler."""
        name = self.HANDLERS.get(type(message))
        if name is None:
            raise TypeError(
                f"tensor-parallel worker: no handler for a {type(message).__name__} "
                f"message ({message!r:.200})"
            )
        return getattr(self, name)(message)

    def _step(self, message: TPStep) -> None:
        apply_step(message, self.runner, self.mirror, self.device, self.tp)

    def _profile(self, message: Profile) -> None:
        """Rank 0's warm-up step, run alike here (no peers: only rank 0 sends)."""
        Warmup(
            self.config,
            self.model,
            self.hf_config,
            self.layout,
            self.state_pool,
            self.device,
            list(message.eos_token_ids),
            self.max_len,
            self.backend,
        ).forward(message.num_tokens, message.max_len)

    def _plan_begin(self, message: PlanBegin) -> None:
        begin_peak(self.device)

    def _plan_query(self, message: PlanQuery) -> int:
        return pages_left(self.config, self.layout, self.device)

    def _tier_metrics(self, message: TierMetricsQuery) -> dict | None:
        """The mirror's counters, once its copies are done."""
        if self.mirror is None:
            return None
        self.mirror.drain()
        return vars(self.mirror.metrics).copy()

    def _reconfigure(self, message: Reconfigure) -> str | None:
        """Rank 0's reconfigure on this rank: once the copies it was sent are done, the
        pool is released and one of num_pages pages made (the same page ids as rank 0's,
        its heads). None, or what failed: then a pool of the old size is made again."""
        if self.mirror is not None:
            self.mirror.drain()
        old = self.pool.num_pages
        self._attach(None)
        pool, error = remake_pool(self.layout, message.num_pages, old, self.device)
        self._attach(pool)
        return None if error is None else f"rank {self.tp.rank}: {error}"

    def _attach(self, pool: PagePool | None) -> None:
        """Point the runner and the tier mirror at `pool` (None: at nothing, so the old
        pool's memory can go)."""
        self.pool = pool
        self.runner.set_kv_caches([] if pool is None else pool.layer_caches())
        if self.mirror is not None:
            self.mirror.attach_device(pool)

    def _setup(self, setup: Setup) -> None:
        """Its pool of rank 0's pages, its host tier mirror, and its runner, built as rank
        0's is (builder.build_runner: the same attention backend, CUDA graphs where rank
        0 captures them, paused against the mirror's copies while captured)."""
        config, device = self.config, self.device
        pool = self.pool = PagePool(self.layout, setup.num_pages, device)
        copies = None
        if setup.host_pages:
            pin = device.type == "cuda"
            host = HostPool(self.layout, setup.host_pages, pin=pin)
            states = None
            if setup.host_state_slots:
                host_states = HostStatePool(self.state_pool.layout, setup.host_state_slots, pin)
                states = (self.state_pool, host_states)
            # one copy stream: copies run in rank 0's submission order (tier_mirror.py)
            copies = CopyEngine(device, num_streams=1, issue=config.tier_copy_issue)
            self.mirror = TierMirror(pool, host, copies, config.batchgen_debug, states)
        self.runner = build_runner(
            setup,
            config,
            self.model,
            self.hf_config,
            pool,
            self.state_pool,
            device,
            self.dtype,
            self.max_len,
            copies=copies,
        )


def _device(config: EngineConfig, rank: int) -> torch.device:
    device = config.torch_device()
    return (
        torch.device("cuda", rank % torch.cuda.device_count()) if device.type == "cuda" else device
    )

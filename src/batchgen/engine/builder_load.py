"""The engine's parts from a config alone: the model resolved and loaded (its host tier's
budget checked first), then builder.build_engine; tensor parallel starts the other ranks
and loads rank 0's share."""

from __future__ import annotations

import torch

from batchgen.config import EngineConfig
from batchgen.distributed import tp_group
from batchgen.engine.builder import EngineParts, build_engine
from batchgen.engine.builder_plan import expert_parallel, with_limits_for
from batchgen.engine.executor import OneRank
from batchgen.engine.limits import max_model_len
from batchgen.engine.memory import check_host_budget
from batchgen.engine.tp_peers import TPWorkers, check_supported
from batchgen.engine.tp_worker import worker_main
from batchgen.models.gguf_share import gguf_read_once
from batchgen.models.loader import ModelSource, build_model
from batchgen.models.registry import check_tensor_parallel
from batchgen.runner.paired import Pairing


def load_engine(config: EngineConfig, pairing: Pairing | None = None) -> EngineParts:
    """The parts for config.model (the default model when unset), its host tier's budget
    checked before the weights load. pairing: an attention data-parallel rank's rounds
    (OneRank's), its forwards paired with the other ranks'."""
    from batchgen.models.default_model import default_model_path

    model = config.model or default_model_path(config.cache_dir)
    source = ModelSource.resolve(model, config.revision, config.cache_dir)
    # before the weights: a host tier that cannot fit would fail after loading them
    check_host_budget(config.host_kv_size_gib, ranks_here(config, config.tensor_parallel_size))
    with gguf_read_once():  # config, tokenizer and weights from one parse of a GGUF
        return _from_source(config, source, pairing)


def ranks_here(config: EngineConfig, size: int) -> int:
    """How many of an engine's `size` ranks run on this host, each with a host tier of
    its own: every one under the "mp" launcher; under Ray, whose placement group packs
    one rank a GPU, at most this host's GPUs (on the CPU every one: a local test
    cluster's nodes share the host)."""
    device = config.torch_device()
    if config.distributed_executor_backend == "mp" or device.type != "cuda":
        return size
    return min(size, torch.cuda.device_count())


def _from_source(
    config: EngineConfig, source: ModelSource, pairing: Pairing | None = None
) -> EngineParts:
    hf_config = source.load_config()
    tokenizer = source.load_tokenizer()
    device = config.torch_device()
    # set here, before tensor-parallel workers take the config
    config = with_limits_for(config, device, hf_config)
    dtype = config.torch_dtype(source.checkpoint_dtype(hf_config), device)
    max_len = max_model_len(config, hf_config)
    if config.tensor_parallel_size == 1:
        model = build_model(
            source,
            hf_config,
            dtype,
            device,
            max_len,
            config.load_format,
            config.seed,
            quantization=config.quantization,
            # attention data parallel: the experts spread over the process's ranks
            ep=expert_parallel(config, tp_group()),
        )
        return build_engine(config, model, hf_config, tokenizer, device, dtype, OneRank(pairing))
    check_supported(config, device)
    check_tensor_parallel(hf_config, config.tensor_parallel_size)
    workers = TPWorkers.start(config, source, worker_main)
    try:
        model = build_model(
            source,
            hf_config,
            dtype,
            device,
            max_len,
            config.load_format,
            config.seed,
            tp=workers.tp,
            quantization=config.quantization,
            ep=expert_parallel(config, workers.tp),
        )
        return build_engine(config, model, hf_config, tokenizer, device, dtype, workers)
    except BaseException:
        workers.shutdown()
        raise

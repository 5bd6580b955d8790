"""batchgen inside a Ray Data pipeline: one engine per actor of an actor pool, fed batches
of rows by `Dataset.map_batches`, as Ray's own `ray.data.llm` runs vLLM.

    config = ProcessorConfig(model="Qwen/Qwen3-8B", engine_kwargs={"max_model_len": 4096},
                             concurrency=2, batch_size=64)
    processor = build_processor(config, preprocess=lambda row: {
        "messages": [{"role": "user", "content": row["question"]}],
        "sampling_params": {"temperature": 0.6, "max_tokens": 256, "seed": row["id"]},
    })
    ds = processor(ray.data.read_parquet("questions.parquet"))

A row carries `prompt` (a string), `prompt_token_ids` or `messages` (an OpenAI-style
conversation, rendered by the tokenizer's chat template as LLM.chat renders it), and
optionally `sampling_params` (a dict of SamplingParams fields; absent or null fields take
ProcessorConfig.sampling_params, then SamplingParams' defaults). It comes back with every
column it had and `generated_text`, `generated_tokens`, `num_input_tokens`,
`num_generated_tokens` and `finish_reason` ("stop" or "length"): what LLM.generate (or
LLM.chat) returns for it alone, since each row's sampling depends on its own seed only.

Ray is an optional extra (`pip install 'batchgen[ray]'`); this module imports it only in
`Processor.__call__`. A row that is not a request (no prompt, several, n > 1) fails its
batch with a ValueError naming the row's place in the batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchgen.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PROMPT_COLUMNS = ("prompt", "prompt_token_ids", "messages")
OUTPUT_COLUMNS = (
    "generated_text",
    "generated_tokens",
    "num_input_tokens",
    "num_generated_tokens",
    "finish_reason",
)


@dataclass(frozen=True)
class ProcessorConfig:
    """`concurrency` engines (Ray actors), each `LLM(model, **engine_kwargs)`, handed
    `batch_size` rows a call. num_gpus an actor: None gives the engine's GPUs
    (`engine_gpus`: a tensor-parallel / expert-parallel group) where the cluster has
    GPUs, none where it has not; num_cpus: the actor's CPUs (leave the cluster at least
    one more for reading rows)."""

    model: str | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    concurrency: int = 1
    batch_size: int = 64
    num_cpus: float = 1
    num_gpus: float | None = None
    sampling_params: dict[str, Any] = field(default_factory=dict)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.batch_size < 1:
            raise ValueError(
                f"concurrency and batch_size must be at least 1, got {self.concurrency} "
                f"and {self.batch_size}"
            )


class EngineStage:
    """The callable class `map_batches` builds once per actor: its engine, loaded at
    construction, answers each batch (a pyarrow Table) in one LLM.generate call."""

    def __init__(
        self,
        model: str | None,
        engine_kwargs: dict[str, Any],
        sampling_params: dict[str, Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        from batchgen.api.llm import LLM

        self.llm = LLM(model=model, **engine_kwargs)
        self.defaults = dict(sampling_params or {})
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def __call__(self, batch):
        import pyarrow as pa

        rows = batch.to_pylist()
        prompts = [self._prompt(row, i) for i, row in enumerate(rows)]
        params = [self._params(row, i) for i, row in enumerate(rows)]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        for row, out in zip(rows, outputs):
            sample = out.outputs[0]
            row.update(
                generated_text=sample.text,
                generated_tokens=list(sample.token_ids),
                num_input_tokens=len(out.prompt_token_ids),
                num_generated_tokens=len(sample.token_ids),
                finish_reason=sample.finish_reason,
            )
        return pa.Table.from_pylist(rows)

    def _prompt(self, row: dict[str, Any], index: int):
        given = [c for c in PROMPT_COLUMNS if row.get(c) is not None]
        if len(given) != 1:
            raise ValueError(
                f"row {index} of the batch needs exactly one of {', '.join(PROMPT_COLUMNS)}; "
                f"it has {given or 'none'}"
            )
        if given[0] == "prompt":
            return row["prompt"]
        if given[0] == "prompt_token_ids":
            return {"prompt_token_ids": list(row["prompt_token_ids"])}
        # rendered and encoded as LLM.chat does: the template carries the special tokens
        text = self.llm.apply_chat_template(row["messages"], **self.chat_template_kwargs)
        return {"prompt_token_ids": self.llm.tokenizer.encode(text, add_special_tokens=False)}

    def _params(self, row: dict[str, Any], index: int) -> SamplingParams:
        own = {k: v for k, v in (row.get("sampling_params") or {}).items() if v is not None}
        params = SamplingParams(**{**self.defaults, **own})
        if params.n != 1 or (params.best_of or 1) != 1:
            raise ValueError(
                f"row {index} of the batch asks n={params.n}, best_of={params.best_of}: "
                "a row gets one completion (repeat the row, each with its own seed)"
            )
        return params


class Processor:
    """`processor(ds) -> ds`: preprocess (a row -> a request row, Dataset.map), the
    engines (Dataset.map_batches over an actor pool of EngineStage), postprocess."""

    def __init__(
        self,
        config: ProcessorConfig,
        preprocess: Callable[[dict], dict] | None = None,
        postprocess: Callable[[dict], dict] | None = None,
    ) -> None:
        self.config = config
        self.preprocess = preprocess
        self.postprocess = postprocess

    def __call__(self, ds):
        import ray

        config = self.config
        resources = ray.cluster_resources()
        num_gpus = config.num_gpus
        if num_gpus is None:
            num_gpus = engine_gpus(config.engine_kwargs) if resources.get("GPU", 0) > 0 else 0
        engines_cpus = config.concurrency * config.num_cpus
        if resources.get("CPU", 0) < engines_cpus + 1:
            logger.warning(
                "the Ray cluster has %g CPUs; %d engines of %g CPUs each leave none for "
                "reading and mapping rows, and the pipeline may wait for ever: lower "
                "num_cpus or concurrency",
                resources.get("CPU", 0),
                config.concurrency,
                config.num_cpus,
            )
        if self.preprocess is not None:
            ds = ds.map(self.preprocess)
        ds = ds.map_batches(
            EngineStage,
            fn_constructor_kwargs=dict(
                model=config.model,
                engine_kwargs=config.engine_kwargs,
                sampling_params=config.sampling_params,
                chat_template_kwargs=config.chat_template_kwargs,
            ),
            batch_size=config.batch_size,
            batch_format="pyarrow",
            concurrency=config.concurrency,
            num_cpus=config.num_cpus,
            num_gpus=num_gpus,
        )
        if self.postprocess is not None:
            ds = ds.map(self.postprocess)
        return ds


def engine_gpus(engine_kwargs: dict[str, Any]) -> int:
    """The GPUs one engine of these keywords runs on: its tensor-parallel ranks, times
    its data-parallel ranks where they are one engine (enable_expert_parallel)."""
    tp = engine_kwargs.get("tensor_parallel_size", 1)
    dp = engine_kwargs.get("data_parallel_size", 1)
    return tp * (dp if engine_kwargs.get("enable_expert_parallel") else 1)


def build_processor(
    config: ProcessorConfig,
    preprocess: Callable[[dict], dict] | None = None,
    postprocess: Callable[[dict], dict] | None = None,
) -> Processor:
    """The processor of `config` (ray.data.llm.build_processor's shape)."""
    return Processor(config, preprocess, postprocess)

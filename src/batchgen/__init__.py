"""batchgen: offline, high-throughput batch generation with a tiered, paged KV cache.

`LLM` is imported on first use (`from batchgen import LLM` or `batchgen.LLM`): it brings
torch and transformers, which the `batchgen` command's --help, --version and `show`
never need (importing them takes seconds)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchgen.outputs import CompletionOutput, Logprob, RequestOutput
from batchgen.sampling_params import (
    GuidedDecodingParams,
    SamplingParams,
    StructuredOutputsParams,
)

if TYPE_CHECKING:
    from batchgen.api.llm import LLM

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from batchgen.api.llm import LLM

        globals()["LLM"] = LLM  # later lookups find it without this call
        return LLM
    raise AttributeError(f"module 'batchgen' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

"""batchgen: offline, high-throughput batch generation with a tiered, paged KV cache."""

from batchgen.api.llm import LLM
from batchgen.outputs import CompletionOutput, Logprob, RequestOutput
from batchgen.sampling_params import (
    GuidedDecodingParams,
    SamplingParams,
    StructuredOutputsParams,
)

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

"""Limits the engine reads from the config, the model config and the tokenizer."""

from __future__ import annotations

from batchgen.config import EngineConfig


def max_model_len(config: EngineConfig, hf_config) -> int:
    """The configured context limit, capped by the model's max_position_embeddings."""
    limit = getattr(hf_config, "max_position_embeddings", None) or 4096
    return min(config.max_model_len or limit, limit)


def eos_token_ids(hf_config, tokenizer) -> list[int]:
    """End-of-sequence ids from the generation config, the model config and the tokenizer."""
    ids: list[int] = []
    for source in (
        getattr(hf_config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if isinstance(source, int):
            ids.append(source)
        elif isinstance(source, (list, tuple)):
            ids += [int(t) for t in source]
    return sorted(set(ids))

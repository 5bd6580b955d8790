"""Limits the engine reads from the config, the model config and the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from batchgen.config import EngineConfig
from batchgen.sampling_params import SamplingParams

# the context limit of a model whose config states none, where max_model_len is unset
DEFAULT_MAX_MODEL_LEN = 4096


def max_model_len(config: EngineConfig, hf_config) -> int:
    """The context limit: config.max_model_len, else the model's context length
    (max_position_embeddings; DEFAULT_MAX_MODEL_LEN where its config states none).
    A max_model_len above a stated context length raises ValueError naming both, as in
    vLLM, rather than being cut to it; the engine resolves it from the model's config
    before any weight is read."""
    context = getattr(hf_config, "max_position_embeddings", None)
    asked = config.max_model_len
    if asked is None:
        return context or DEFAULT_MAX_MODEL_LEN
    if context and asked > context:
        raise ValueError(
            f"max_model_len={asked} is more than the model's context length "
            f"({context}, max_position_embeddings in its config); use a max_model_len "
            f"of at most {context} or leave it unset"
        )
    return asked


def generation_eos(model) -> int | list[int] | None:
    """`eos_token_id` of an HF directory's generation_config.json (an id or a list), or
    None: no such file, or `model` is not an HF directory (a GGUF file keeps its EOS in
    its metadata, which the model config and the tokenizer carry)."""
    if model is None:
        return None
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        return None
    try:
        generation = json.loads((path / "generation_config.json").read_text())
    except FileNotFoundError:
        return None
    return generation.get("eos_token_id") if isinstance(generation, dict) else None


def eos_token_ids(hf_config, tokenizer, generation=None) -> list[int]:
    """End-of-sequence ids from the generation config (`generation`: its eos_token_id,
    see `generation_eos`), the model config and the tokenizer; each gives an id or a
    list of ids."""
    ids: list[int] = []
    for source in (
        generation,
        getattr(hf_config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if isinstance(source, int):
            ids.append(source)
        elif isinstance(source, (list, tuple)):
            ids += [int(t) for t in source]
    return sorted(set(ids))


def check_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    max_model_len: int,
    vocab: int,
    what: str,
) -> None:
    """Raise ValueError (TypeError for a wrong type) naming `what` for a prompt and
    sampling parameters the engine cannot run (EngineCore.validate, which compiles a
    structured-output grammar too)."""
    if not prompt_token_ids:
        raise ValueError(f"{what}: the prompt is empty")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"{what}: the prompt has {len(prompt_token_ids)} tokens; "
            f"max_model_len is {max_model_len} (room is needed for output)"
        )
    # one pass over the ids for both checks: a W3-sized batch has millions of them
    bad = next((t for t in prompt_token_ids if type(t) is not int or not 0 <= t < vocab), None)
    if bad is not None:
        if type(bad) is not int:
            raise TypeError(f"{what}: token ids must be ints, got {bad!r}")
        raise ValueError(f"{what}: token id {bad} is outside the vocabulary [0, {vocab})")
    if not isinstance(params, SamplingParams):
        raise TypeError(f"{what}: sampling params must be a SamplingParams, got {type(params)}")
    if params.n != 1 or params.best_of not in (None, 1):
        raise ValueError(
            f"{what}: the engine runs one sample per request (n={params.n}, "
            f"best_of={params.best_of}); LLM.generate and LLM.chat fan n > 1 out"
        )

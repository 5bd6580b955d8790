"""LLM(...)'s keyword arguments -> an EngineConfig, vLLM's names included.

Keywords name EngineConfig fields. The vLLM names a user types first are read too:
- `block_size` is `page_size` and `swap_space` (GiB of host memory for KV) is
  `host_kv_size_gib`; `download_dir` is `cache_dir`, where models are downloaded: the
  hub cache of a model named by its Hugging Face id, and batchgen's default model;
- `revision` (a Hugging Face id's branch, tag or commit) is an EngineConfig field of
  the same name;
- `kv_cache_dtype` ("auto", "fp8", "fp8_e4m3") is an EngineConfig field of the same
  name;
- `tokenizer` equal to the model (or None) is what batchgen does anyway and is
  accepted; another value raises ValueError saying what batchgen does instead.
An unknown name raises TypeError naming the nearest option.
"""

from __future__ import annotations

import difflib
import os
from typing import Any

from batchgen.config import EngineConfig

# vLLM's name -> the EngineConfig field it sets
ALIASES = {"block_size": "page_size", "swap_space": "host_kv_size_gib", "download_dir": "cache_dir"}
# vLLM's names for what batchgen does in one way only: accepted at that one value
_FIXED = ("tokenizer",)


def engine_config(model: str | None, kwargs: dict[str, Any]) -> EngineConfig:
    """The EngineConfig of LLM(model, **kwargs); raises TypeError for an unknown name
    and ValueError for a vLLM name at a value batchgen cannot take."""
    kwargs = dict(kwargs)
    known = EngineConfig.field_names()
    unknown = sorted(set(kwargs) - known - set(ALIASES) - set(_FIXED))
    if unknown:
        raise TypeError(f"LLM() got unknown argument(s): {', '.join(map(_nearest, unknown))}")
    _check_fixed(model, kwargs.pop("tokenizer", None))
    renamed = {}
    for vllm_name, field in ALIASES.items():
        if vllm_name not in kwargs:
            continue
        renamed[field] = vllm_name
        value = kwargs.pop(vllm_name)
        if field in kwargs and kwargs[field] != value:
            raise ValueError(
                f"{vllm_name}={value!r} and {field}={kwargs[field]!r} name one option "
                f"(vLLM's name and batchgen's); give one of them"
            )
        kwargs[field] = value
    try:
        return EngineConfig(model=model, **kwargs)
    except ValueError as e:
        given = [f"{field} is {name}" for field, name in renamed.items() if field in str(e)]
        if given:
            raise ValueError(f"{e} ({'; '.join(given)})") from None
        raise


def _check_fixed(model: str | None, tokenizer: Any) -> None:
    if tokenizer is not None and not _same_model(str(tokenizer), model):
        raise ValueError(
            f"tokenizer={tokenizer!r} is not supported: batchgen loads the tokenizer from "
            f"the model's own files (model={model!r}); leave tokenizer unset or give the model"
        )


def _same_model(tokenizer: str, model: str | None) -> bool:
    if model is None:
        return False
    if tokenizer == str(model):
        return True
    return (
        os.path.exists(tokenizer) and os.path.exists(model) and os.path.samefile(tokenizer, model)
    )


def _nearest(name: str) -> str:
    options = sorted(EngineConfig.field_names() | set(ALIASES) | set(_FIXED))
    close = difflib.get_close_matches(name, options, n=1)
    return f"{name} (did you mean {close[0]!r}?)" if close else name

"""Model registry: transformers `architectures` names -> batchgen model classes (lazy)."""

from __future__ import annotations

import importlib

_MODELS: dict[str, tuple[str, str]] = {
    "DeepseekV3ForCausalLM": ("batchgen.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "KimiLinearForCausalLM": ("batchgen.models.kimi_linear", "KimiLinearForCausalLM"),
    "LlamaForCausalLM": ("batchgen.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("batchgen.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("batchgen.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("batchgen.models.llama", "Qwen3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(config) -> type:
    """The class for a transformers config; ValueError naming the architecture if unknown."""
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(
        f"unknown model architecture {archs or '(none given in config.json)'}; "
        f"batchgen supports {', '.join(supported_architectures())}"
    )


def check_tensor_parallel(config, size: int) -> None:
    """ValueError naming the architecture unless its model class runs split across
    `size` > 1 ranks (a class says so with `tensor_parallel = True` and takes `tp=`)."""
    if size == 1:
        return
    cls = model_class(config)
    if not getattr(cls, "tensor_parallel", False):
        able = [
            arch
            for arch, (module, name) in sorted(_MODELS.items())
            if getattr(getattr(importlib.import_module(module), name), "tensor_parallel", False)
        ]
        raise ValueError(
            f"{cls.__name__} does not support tensor_parallel_size={size} yet "
            f"(tensor parallel runs {', '.join(able)}); use tensor_parallel_size=1"
        )

"""Model registry: transformers `architectures` names -> batchgen model classes (lazy)."""

from __future__ import annotations

import importlib

_MODELS: dict[str, tuple[str, str]] = {
    "DeepseekV3ForCausalLM": ("batchgen.models.deepseek_v3", "DeepseekV3ForCausalLM"),
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

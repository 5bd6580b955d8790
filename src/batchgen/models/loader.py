"""Loading a model: transformers config and tokenizer, weights from safetensors or GGUF."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from batchgen.console import library_progress_bars, progress_enabled
from batchgen.models import fp8, pack_quantized
from batchgen.models.dummy_weights import init_dummy_weights
from batchgen.models.hub import looks_like_repo_id, snapshot_path
from batchgen.models.quantization import QuantPlan, plan_quantization
from batchgen.models.registry import check_tensor_parallel, model_class

logger = logging.getLogger(__name__)


@dataclass
class ModelSource:
    """Where a model lives: an HF directory, or a GGUF file (config and tokenizer inside)."""

    path: Path
    gguf_file: str | None = None

    @classmethod
    def resolve(
        cls, model: str | Path, revision: str | None = None, cache_dir: str | None = None
    ) -> ModelSource:
        """`model`: an HF directory, a .gguf file, a directory holding one .gguf file, or
        a Hugging Face id that is no local path, taken at `revision` from the hub cache
        `cache_dir` (hub.snapshot_path; both apply to an id only)."""
        path = Path(model).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            return cls(path.parent, path.name)
        if path.is_dir():
            if (path / "config.json").is_file():
                return cls(path)
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return cls(path, ggufs[0].name)
            raise FileNotFoundError(f"model directory {path} has no config.json")
        if not path.exists() and looks_like_repo_id(str(model)):
            return cls.resolve(snapshot_path(str(model), revision, cache_dir))
        raise FileNotFoundError(f"model path {path} does not exist (a directory or a .gguf file)")

    def _kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}

    def load_config(self):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(self.path), **self._kwargs())
        if not getattr(config, "architectures", None) and self.gguf_file:
            config.architectures = [_GGUF_ARCHS.get(config.model_type, config.model_type)]
        return config

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        if not self.gguf_file and not _has_tokenizer_files(self.path):
            raise FileNotFoundError(
                f"the model's tokenizer files are missing: {self.path} has none of "
                f"{', '.join(TOKENIZER_FILES)} (copy them from where the model came from)"
            )
        return AutoTokenizer.from_pretrained(str(self.path), **self._kwargs())

    def checkpoint_dtype(self, config) -> torch.dtype | None:
        # `dtype` only: transformers maps a config.json's "torch_dtype" onto it, and its
        # `torch_dtype` attribute is a deprecated alias that warns on every read.
        # vars() covers a config object without `dtype` without reading that alias.
        dtype = getattr(config, "dtype", None) or vars(config).get("torch_dtype")
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        return dtype if isinstance(dtype, torch.dtype) else None

    def weights(
        self, config, keep=frozenset(), skip: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(transformers name, tensor) pairs, read lazily where the format allows; FP8
        block-scaled and INT4 pack-quantized weights dequantized as read, except those
        named in `keep` (and their companions), which pass as stored. skip: names not
        read at all from safetensors files (another rank's experts; a weight's
        companions, `*_scale_inv` or `*_packed` / `*_scale` / `*_shape`, go with the
        weight); GGUF files are read whole."""
        if self.gguf_file:
            yield from _gguf_weights(self.path / self.gguf_file, config)
            return
        weights = _safetensors_weights(self.path, skip)
        scheme = pack_quantized.int4_scheme(config)
        if scheme is not None:
            yield from pack_quantized.int4_weights(weights, scheme.group_size, keep)
            return
        block = fp8.block_size(config)
        yield from weights if block is None else fp8.dequantized_weights(weights, block, keep)

    def fp8_weight_names(self) -> set[str]:
        """The names of the weights stored with a `*_scale_inv` beside them, from the
        safetensors headers alone (no tensor read)."""
        suffix = fp8.SCALE_SUFFIX
        return {k[: -len(suffix)] for k in self.tensor_names() if k.endswith(suffix)}

    def tensor_names(self) -> set[str]:
        """Every tensor name of the safetensors files, from their headers alone."""
        from safetensors import safe_open

        names = set()
        for file in _safetensors_files(self.path):
            with safe_open(str(file), framework="pt") as f:
                names.update(f.keys())
        return names


# The files a tokenizer is read from (fast, SentencePiece, BPE, WordPiece, tiktoken and
# Mistral's tekken formats); a directory with none of them cannot give one.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "tiktoken.model",
    "*.tiktoken",
    "tekken.json",
)


def _has_tokenizer_files(path: Path) -> bool:
    return any(next(path.glob(pattern), None) is not None for pattern in TOKENIZER_FILES)


_GGUF_ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def _safetensors_files(path: Path) -> list[Path]:
    """The weight files (an index's, else every *.safetensors); FileNotFoundError for
    none, or one the index lists that is missing."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"the model's weights are missing: no *.safetensors weight files in {path} "
            "(load_format='dummy' builds the model with random weights from config.json alone)"
        )
    for name in files:
        if not (path / name).is_file():
            raise FileNotFoundError(f"weight file {path / name} listed in the index is missing")
    return [path / name for name in files]


COMPANIONS = (fp8.SCALE_SUFFIX, *pack_quantized.COMPANIONS)  # "x.weight" + suffix


def _weight_name(key: str) -> str:
    """The weight a checkpoint tensor goes with: itself, or the one it is a companion of."""
    for suffix in COMPANIONS:
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return key


def _safetensors_weights(
    path: Path, skip: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for file in _safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if skip is None or not skip(_weight_name(key)):
                        yield key, f.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"weight file {file} is truncated or corrupt: {e}") from e


def _gguf_weights(file: Path, config) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized GGUF tensors under transformers' names (its own GGUF name map)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        names_only = AutoModelForCausalLM.from_config(config)
    try:
        with library_progress_bars(progress_enabled()):  # its bar: a terminal only
            parsed = load_gguf_checkpoint(str(file), return_tensors=True, model_to_load=names_only)
    except (ValueError, OSError, IndexError) as e:
        raise ValueError(f"GGUF file {file} is truncated or corrupt: {e}") from e
    yield from parsed["tensors"].items()


def build_model(
    source: ModelSource,
    config,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    load_format: str = "auto",
    seed: int = 0,
    tp=None,
    quantization: str | None = None,
    ep=None,
) -> torch.nn.Module:
    """Build on the meta device, allocate on `device`, fill every weight from the
    checkpoint (load_format "auto") or with random values (load_format "dummy": no
    checkpoint read, see init_dummy_weights). With `tp` (a layers.tp_group.TPGroup) the
    model is this rank's tensor-parallel share, its weights cut from the full checkpoint
    tensors (dummy weights are drawn per rank: they do not match a TP=1 run's, but a
    replicated weight, DeepSeek-V3's router or latent projection, comes out the same on
    every rank, each rank's parameters having the same shapes in the same order);
    ValueError for an architecture that does not run under tensor parallel.

    Quantized weights (models/quantization.py): a checkpoint's block-scaled FP8 weights
    stay FP8 in the layers that can hold them; `quantization` "fp8" quantizes a float
    checkpoint's linear layers as they load; either way decided on meta, so only the
    quantized parameters are allocated.

    With `ep` (a layers.expert_parallel.ExpertParallel) its MoE layers are expert
    parallel, each rank reading only its own experts' per-expert tensors (ValueError
    for an architecture without expert parallel)."""
    cls = model_class(config)
    if tp is not None:
        check_tensor_parallel(config, tp.size)
    split = {"tp": tp} if tp is not None and getattr(cls, "tensor_parallel", False) else {}
    if ep is not None:
        if not getattr(cls, "expert_parallel", False):
            raise ValueError(f"{cls.__name__} does not run expert parallel (no MoE layers)")
        split["ep"] = ep
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(config, max_positions, **split)
    finally:
        torch.set_default_dtype(old)
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    from_checkpoint = load_format == "auto" and not (source is None or source.gguf_file)
    names = source.tensor_names if from_checkpoint else None
    plan = plan_quantization(model, config, quantization, names, dtype)
    model.to_empty(device=device)
    if load_format == "dummy":
        init_dummy_weights(model, seed, dtype)
    else:
        _load_checkpoint(model, source, config, plan)
    for module in model.modules():  # a layer's forms of its weights derived from them
        after_load = getattr(module, "after_load", None)
        if after_load is not None:
            after_load()
    if getattr(model, "rotary", None) is not None:  # None: a model without rope (NoPE)
        model.rotary.materialize(device)
    return model.eval()


def _load_checkpoint(
    model: torch.nn.Module, source: ModelSource, config, plan: QuantPlan | None = None
) -> None:
    """Copy every checkpoint tensor into its parameter; ValueError naming what is missing.
    A kept quantized weight's companion ("x.weight_scale_inv") goes to the weight's layer
    as the parameter of the weight's name plus the suffix."""
    cls = type(model)
    expected = {n for n, _ in model.named_parameters()}
    loaded: set[str] = set()
    names = {id(p): n for n, p in model.named_parameters()}
    plan = plan or QuantPlan()
    skip = functools.partial(_held_elsewhere, model)
    for ckpt_name, tensor in source.weights(config, plan.kept, skip):
        companion = plan.companion(ckpt_name)
        try:
            target = model.checkpoint_target(companion[0] if companion else ckpt_name)
        except KeyError:
            logger.warning("checkpoint weight %s is not used by %s", ckpt_name, cls.__name__)
            continue
        if target is None:
            continue
        module, param, shard = target
        if companion:
            param += companion[1]
        try:
            if hasattr(module, "load"):
                module.load(param, tensor, shard)
            else:
                with torch.no_grad():
                    getattr(module, param).copy_(tensor)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"checkpoint weight {ckpt_name}: {e}") from e
        filled_by = getattr(module, "filled_by", None)
        for filled in filled_by(param, tensor) if filled_by else (param,):
            loaded.add(names[id(getattr(module, filled))] + (f"[{shard}]" if shard else ""))
    missing = sorted(_unfilled(model, expected, loaded))
    if missing:
        raise ValueError(
            f"checkpoint is missing weights: {', '.join(missing[:10])}"
            + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        )


def _held_elsewhere(model: torch.nn.Module, name: str) -> bool:
    """Whether checkpoint tensor `name` fills a shard this rank does not hold (a module's
    `holds(shard)`: another rank's routed expert), so need not be read."""
    try:
        target = model.checkpoint_target(name)
    except KeyError:
        return False
    if target is None or target[2] is None:
        return False
    holds = getattr(target[0], "holds", None)
    return holds is not None and not holds(target[2])


def _unfilled(model: torch.nn.Module, expected: set[str], loaded: set[str]) -> list[str]:
    """Parameters no checkpoint tensor filled: whole, or every shard of a stacked one."""
    missing = []
    for name in expected:
        if name in loaded:
            continue
        module_name, _, param = name.rpartition(".")
        shards = _shard_names(model.get_submodule(module_name) if module_name else model, param)
        if shards:
            missing += [f"{name}[{s}]" for s in shards if f"{name}[{s}]" not in loaded]
        else:
            missing.append(name)
    return missing


def _shard_names(module: torch.nn.Module, param: str) -> list[str]:
    """The shards a stacked parameter is filled by: a module's `shard_names(param)`
    (stacked experts, Linear: its shards for each parameter a checkpoint fills), else
    none."""
    if hasattr(module, "shard_names"):
        return module.shard_names(param)
    return []

"""What `batchgen plan` knows of a model, from its config.json alone: the tensors one GPU
holds under a parallel layout, as the engine's layers shape them.

    Parallel(tp, dp, expert_parallel)        gpus = tp x dp
      attention, dense MLPs, vocabulary      split by tp (whole heads, whole experts);
                                             the dp ranks each hold a copy
      routed experts                         a block of E / (tp x dp) per GPU with
                                             expert parallel, else E / tp
      shared experts                         split by tp, replicated under expert parallel
      norms, MLA's latent projections,       every GPU holds them whole
      the router, KDA's f_a / g_a

`Weight` is one kind of checkpoint tensor as one GPU holds it (`count` of them);
`model_weights(shape, parallel)` lists them for the Llama family (Llama, Mistral, Qwen2,
Qwen3), DeepSeek-V3 (Kimi-K2) and Kimi Linear. Their sum in bfloat16 is what the engine's
model of that rank allocates (tests/api/test_plan.py builds the models and compares).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# architectures the plan lays out, by the engine's model file they run on
LLAMA = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
DEEPSEEK, KIMI_LINEAR = "DeepseekV3ForCausalLM", "KimiLinearForCausalLM"
# model types transformers does not ship whose config.json is DeepSeek-V3's
DEEPSEEK_ALIASES = {"kimi_k2": "deepseek_v3"}


@dataclass(frozen=True)
class Parallel:
    """How a model is spread over tp x dp GPUs (vLLM's names: tensor_parallel_size,
    data_parallel_size, enable_expert_parallel)."""

    tp: int = 1
    dp: int = 1
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if min(self.tp, self.dp) < 1:
            raise ValueError(f"tp and dp must be at least 1, got {self}")

    @property
    def gpus(self) -> int:
        return self.tp * self.dp

    @property
    def ep(self) -> int:
        """The GPUs a layer's routed experts are spread over."""
        return self.gpus if self.expert_parallel else self.tp

    def describe(self) -> str:
        dp = f" x DP {self.dp}" if self.dp > 1 else ""
        return f"TP {self.tp}{dp}, EP {self.ep}"


@dataclass(frozen=True)
class Weight:
    """`count` tensors of rows x cols (a vector: cols 1) on one GPU. `module` is a
    checkpoint name standing for them (what a quantization config's ignore list is
    matched against); `linear`: a projection a quantized checkpoint may store quantized;
    `fp32`: kept in float32 whatever the model's dtype. `stack`: the engine's layer that
    holds this tensor stacked with its neighbours of the same stack, in order (Llama's
    qkv_proj, a gate_up_proj, KDA's in_proj): quantized all together or not at all."""

    module: str
    part: str  # embedding, attention, dense, shared, experts, router, norm
    rows: int
    cols: int = 1
    count: int = 1
    linear: bool = False
    fp32: bool = False
    stack: str = ""

    @property
    def numel(self) -> int:
        return self.rows * self.cols * self.count


def read_config(model: str | Path, revision: str | None = None, cache_dir=None):
    """The transformers config of MODEL's config.json: a directory holding one, the file
    itself, or a Hugging Face id (its config.json from the local Hugging Face cache;
    fetched alone, never the weights, only where the cache lacks it)."""
    from transformers import CONFIG_MAPPING

    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    elif not path.is_file():
        path = _hub_config(str(model), revision, cache_dir)
    data = json.loads(path.read_text())
    model_type = DEEPSEEK_ALIASES.get(data.get("model_type"), data.get("model_type"))
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{path}: model_type {data.get('model_type')!r} is not known")
    config = CONFIG_MAPPING[model_type].from_dict(data)
    config.name_or_path = str(model)
    return config


def _hub_config(repo_id: str, revision: str | None, cache_dir) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from batchgen.models.hub import looks_like_repo_id

    if not looks_like_repo_id(repo_id):
        raise FileNotFoundError(f"{repo_id} is neither a config.json, a directory nor a hub id")
    where = dict(revision=revision, cache_dir=cache_dir)
    try:
        return Path(hf_hub_download(repo_id, "config.json", local_files_only=True, **where))
    except LocalEntryNotFoundError:
        pass
    try:
        return Path(hf_hub_download(repo_id, "config.json", **where))
    except Exception as e:  # offline, unknown repo, gated: one message
        raise FileNotFoundError(
            f"{repo_id}: no config.json in the Hugging Face cache and none could be fetched: {e}"
        ) from e


def architecture(config) -> str:
    """The engine model the config runs on (LLAMA's, DEEPSEEK or KIMI_LINEAR)."""
    for arch in getattr(config, "architectures", None) or ():
        if arch in (*LLAMA, DEEPSEEK, KIMI_LINEAR):
            return arch
    raise ValueError(
        f"batchgen plan lays out {', '.join((*LLAMA, DEEPSEEK, KIMI_LINEAR))}; "
        f"config.json names {getattr(config, 'architectures', None)}"
    )


def model_weights(config, parallel: Parallel) -> list[Weight]:
    """The tensors one GPU holds (the first rank's: every rank's but the vocabulary's
    last, padded share are the same size). ValueError where the layout does not split
    the model into whole heads or experts."""
    arch = architecture(config)
    tp = parallel.tp
    h, vocab = config.hidden_size, -(-config.vocab_size // tp)
    out = [Weight("model.embed_tokens", "embedding", vocab, h)]
    if arch == KIMI_LINEAR:
        layers = _kimi_linear_layers(config, parallel)
    elif arch == DEEPSEEK:
        layers = _deepseek_layers(config, parallel)
    else:
        layers = _llama_layers(config, parallel, arch)
    out += layers
    out.append(Weight("model.norm", "norm", h))
    if not getattr(config, "tie_word_embeddings", False):
        out.append(Weight("lm_head", "embedding", vocab, h))
    return [w for w in out if w.numel]


def _split(total: int, size: int, what: str) -> int:
    if total % size:
        raise ValueError(f"{what}={total} does not split over {size} GPUs")
    return total // size


def _norms(prefix: str, hidden: int, count: int) -> list[Weight]:
    return [
        Weight(f"{prefix}.input_layernorm", "norm", hidden, count=count),
        Weight(f"{prefix}.post_attention_layernorm", "norm", hidden, count=count),
    ]


def _mlp(prefix: str, hidden: int, inter: int, count: int, bias: bool = False) -> list[Weight]:
    """A SwiGLU MLP of `inter` features on this GPU: gate, up, down (and their biases)."""
    stack = f"{prefix}.gate_up_proj"
    out = [
        Weight(f"{prefix}.gate_proj", "dense", inter, hidden, count, True, stack=stack),
        Weight(f"{prefix}.up_proj", "dense", inter, hidden, count, True, stack=stack),
        Weight(f"{prefix}.down_proj", "dense", hidden, inter, count, linear=True),
    ]
    if bias:
        out += [Weight(f"{prefix}.gate_up_proj.bias", "dense", 2 * inter, count=count)]
        out += [Weight(f"{prefix}.down_proj.bias", "dense", hidden, count=count)]
    return out


def _llama_layers(config, parallel: Parallel, arch: str) -> list[Weight]:
    tp, n, h = parallel.tp, config.num_hidden_layers, config.hidden_size
    heads = _split(config.num_attention_heads, tp, "num_attention_heads")
    kv = _split(
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        tp,
        "num_key_value_heads",
    )
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    p = "model.layers.0.self_attn"
    out = _norms("model.layers.0", h, n)
    for name, rows in (("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d)):
        out.append(Weight(f"{p}.{name}", "attention", rows, h, n, True, stack=f"{p}.qkv_proj"))
    attention_bias = bool(getattr(config, "attention_bias", False))
    if arch == "Qwen2ForCausalLM" or attention_bias:
        out.append(Weight(f"{p}.qkv_proj.bias", "attention", (heads + 2 * kv) * d, count=n))
    out.append(Weight(f"{p}.o_proj", "attention", h, heads * d, n, linear=True))
    if attention_bias:
        out.append(Weight(f"{p}.o_proj.bias", "attention", h, count=n))
    if arch == "Qwen3ForCausalLM":
        out.append(Weight(f"{p}.q_norm", "norm", d, count=n))
        out.append(Weight(f"{p}.k_norm", "norm", d, count=n))
    inter = _split(config.intermediate_size, tp, "intermediate_size")
    out += _mlp("model.layers.0.mlp", h, inter, n, bool(getattr(config, "mlp_bias", False)))
    return out


def _mla(config, parallel: Parallel, prefix: str, count: int) -> list[Weight]:
    """MLA (layers/mla.py): the latent projections whole on every GPU, the heads' split."""
    h = config.hidden_size
    heads = _split(config.num_attention_heads, parallel.tp, "num_attention_heads")
    nope, rope, v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    latent, q_lora = config.kv_lora_rank, getattr(config, "q_lora_rank", None)
    out = []
    if q_lora is None:
        out.append(Weight(f"{prefix}.q_proj", "attention", heads * (nope + rope), h, count, True))
    else:
        out.append(Weight(f"{prefix}.q_a_proj", "attention", q_lora, h, count, True))
        out.append(Weight(f"{prefix}.q_a_layernorm", "norm", q_lora, count=count))
        out.append(Weight(f"{prefix}.q_b_proj", "attention", heads * (nope + rope), q_lora, count, True))  # fmt: skip
    out.append(Weight(f"{prefix}.kv_a_proj_with_mqa", "attention", latent + rope, h, count, True))
    out.append(Weight(f"{prefix}.kv_a_layernorm", "norm", latent, count=count))
    # read as a matrix by the layer itself (absorbed into q and o): never quantized
    out.append(Weight(f"{prefix}.kv_b_proj", "attention", heads * (nope + v), latent, count))
    out.append(Weight(f"{prefix}.o_proj", "attention", h, heads * v, count, True))
    if getattr(config, "attention_bias", False):
        # q_a_proj's (with a q LoRA), kv_a_proj_with_mqa's and o_proj's
        out.append(Weight(f"{prefix}.bias", "attention", (q_lora or 0) + latent + rope + h, count=count))  # fmt: skip
    return out


def _moe(
    parallel: Parallel, prefix: str, hidden: int, inter: int, experts: int, shared: int, count: int
) -> list[Weight]:
    """DeepseekV3MoE (layers/moe.py): the float32 router and its bfloat16 copy whole on
    every GPU, a block of the routed experts, the shared experts' features."""
    local = _split(experts, parallel.ep, "the routed experts")
    shared_tp = 1 if parallel.expert_parallel else parallel.tp
    out = [
        Weight(f"{prefix}.gate", "router", experts, hidden, count, fp32=True),
        Weight(f"{prefix}.gate.e_score_correction_bias", "router", experts, count=count, fp32=True),
        # MoEGate.after_load keeps the router in the activations' dtype too
        Weight(f"{prefix}.gate.weight_narrow", "router", experts, hidden, count),
    ]
    e = f"{prefix}.experts.0"
    out += [
        Weight(f"{e}.gate_proj", "experts", inter, hidden, count * local, linear=True),
        Weight(f"{e}.up_proj", "experts", inter, hidden, count * local, linear=True),
        Weight(f"{e}.down_proj", "experts", hidden, inter, count * local, linear=True),
    ]
    if shared:
        s = _split(inter * shared, shared_tp, "the shared experts' features")
        for w in _mlp(f"{prefix}.shared_experts", hidden, s, count):
            out.append(Weight(w.module, "shared", w.rows, w.cols, w.count, w.linear))
    return out


def _deepseek_layers(config, parallel: Parallel) -> list[Weight]:
    """DeepSeek-V3 (models/deepseek_v3.py); multi-token-prediction layers are not loaded."""
    n, h = config.num_hidden_layers, config.hidden_size
    dense = min(getattr(config, "first_k_dense_replace", None) or 0, n)
    if not getattr(config, "n_routed_experts", None):
        dense = n
    out = _norms("model.layers.0", h, n) + _mla(config, parallel, "model.layers.0.self_attn", n)
    inter = _split(config.intermediate_size, parallel.tp, "intermediate_size")
    out += _mlp("model.layers.0.mlp", h, inter, dense)
    if n > dense:
        shared = getattr(config, "n_shared_experts", None) or 0
        prefix = f"model.layers.{dense}.mlp"
        experts = config.n_routed_experts
        out += _moe(parallel, prefix, h, config.moe_intermediate_size, experts, shared, n - dense)
    return out


def _kimi_linear_layers(config, parallel: Parallel) -> list[Weight]:
    """Kimi Linear (models/kimi_linear.py): KDA and MLA layers by `layer_types`, dense
    and MoE MLPs by `mlp_layer_types`."""
    n, h, tp = config.num_hidden_layers, config.hidden_size, parallel.tp
    kinds = list(config.layer_types)
    kda, mla = kinds.count("linear_attention"), kinds.count("full_attention")
    mlps = list(config.mlp_layer_types)
    sparse = mlps.count("sparse")
    heads = _split(config.linear_num_heads, tp, "linear_num_heads")
    d, k = config.linear_head_dim, config.linear_conv_kernel_dim
    w = heads * d
    first = lambda kind, seq: seq.index(kind) if kind in seq else 0  # noqa: E731
    p = f"model.layers.{first('linear_attention', kinds)}.self_attn"
    out = _norms("model.layers.0", h, n)
    ins = f"{p}.in_proj"  # q k v b f_a g_a stacked
    out += [
        Weight(f"{p}.q_proj", "attention", w, h, kda, True, stack=ins),
        Weight(f"{p}.k_proj", "attention", w, h, kda, True, stack=ins),
        Weight(f"{p}.v_proj", "attention", w, h, kda, True, stack=ins),
        Weight(f"{p}.b_proj", "attention", heads, h, kda, True, stack=ins),
        Weight(f"{p}.f_a_proj", "attention", d, h, kda, True, stack=ins),
        Weight(f"{p}.g_a_proj", "attention", d, h, kda, True, stack=ins),
        # depthwise conv taps [channels, K], q k v stacked: read as a matrix by the
        # engine's short convolution, never quantized (layers/kda.py ConvWeight)
        Weight(f"{p}.q_conv1d", "attention", w, k, kda, stack=f"{p}.conv1d"),
        Weight(f"{p}.k_conv1d", "attention", w, k, kda, stack=f"{p}.conv1d"),
        Weight(f"{p}.v_conv1d", "attention", w, k, kda, stack=f"{p}.conv1d"),
        Weight(f"{p}.f_b_proj", "attention", w, d, kda, True),
        Weight(f"{p}.g_b_proj", "attention", w, d, kda, True),
        Weight(f"{p}.A_log", "attention", heads, count=kda, fp32=True),
        Weight(f"{p}.dt_bias", "attention", w, count=kda, fp32=True),
        Weight(f"{p}.o_norm", "norm", d, count=kda),
        Weight(f"{p}.o_proj", "attention", h, w, kda, True),
    ]
    out += _mla(config, parallel, f"model.layers.{first('full_attention', kinds)}.self_attn", mla)
    inter = _split(config.intermediate_size, tp, "intermediate_size")
    out += _mlp(f"model.layers.{first('dense', mlps)}.mlp", h, inter, n - sparse)
    if sparse:
        prefix = f"model.layers.{first('sparse', mlps)}.mlp"
        experts, shared = config.num_local_experts, config.n_shared_experts or 0
        out += _moe(parallel, prefix, h, config.moe_intermediate_size, experts, shared, sparse)
    return out

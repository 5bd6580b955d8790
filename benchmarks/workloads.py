"""Benchmark workloads and the random-weight models they run on (BENCHMARKS.md)."""

from __future__ import annotations

import random
from pathlib import Path

QWEN3_0_6B = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
)

# a CPU-sized model of the same architecture, for --small runs
SMALL_MODEL = dict(
    QWEN3_0_6B,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
)


# the default model's architecture (SmolLM2-135M), shrunk: the host's work depends on
# the rows, the tokens and the vocabulary, not on the width of the layers
TINY_SMOLLM2 = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=49152,
    max_position_embeddings=2048,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


# Llama-3.1-8B's architecture (W2-8B, W3-8B), random weights: load_format="dummy"
LLAMA_3_1_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    tie_word_embeddings=False,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    bos_token_id=128000,
    eos_token_id=128001,
)

# a CPU-sized model of the same architecture (llama3 rope scaling, untied embeddings)
SMALL_LLAMA = dict(
    LLAMA_3_1_8B,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    bos_token_id=1,
    eos_token_id=2,
)

# W4: a scaled Moonlight-16B-A3B-like DeepSeek-V3 config (MLA + MoE), random weights
MOONLIGHT_W4 = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    hidden_size=2048,
    intermediate_size=11264,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.446,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    vocab_size=163840,
    tie_word_embeddings=False,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    bos_token_id=163584,
    eos_token_id=163585,
)

# a CPU-sized model of the same architecture (MoE, dense first layer, MLA)
SMALL_MOONLIGHT = dict(
    MOONLIGHT_W4,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    vocab_size=512,
    bos_token_id=1,
    eos_token_id=2,
)


def _kimi_layers(n: int) -> dict:
    """A Kimi-Linear-shaped model's n layers: every 4th an MLA (full-attention) layer,
    the rest KDA; the first MLP dense, the others MoE."""
    return dict(
        num_hidden_layers=n,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)],
        mlp_layer_types=["dense"] + ["sparse"] * (n - 1),
    )


# W6 `hybrid` (BENCHMARKS.md): a scaled Kimi-Linear-48B-A3B-like config; the dense first
# MLP's width (not given there) is Kimi Linear's default, 9216
KIMI_W6 = dict(
    architectures=["KimiLinearForCausalLM"],
    model_type="kimi_linear",
    hidden_size=2048,
    intermediate_size=9216,
    moe_intermediate_size=1024,
    num_attention_heads=16,
    num_key_value_heads=16,
    **_kimi_layers(24),
    linear_num_heads=16,
    linear_head_dim=128,
    linear_conv_kernel_dim=4,
    num_local_experts=64,
    num_experts_per_tok=6,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.446,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    vocab_size=163840,
    tie_word_embeddings=False,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    bos_token_id=163584,
    eos_token_id=163586,
    pad_token_id=163839,
)

# a CPU-sized model of the same architecture (KDA 3 : MLA 1, MoE, dense first layer)
SMALL_KIMI = dict(
    KIMI_W6,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    **_kimi_layers(4),
    linear_num_heads=2,
    linear_head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    vocab_size=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# The 8-GPU contract's model: W6 scaled to fill 8 GPUs. Twice its layers (12 MLA + 36
# KDA), four times its routed experts (256, top-8), hidden 4096 with 32 heads in both
# attention kinds: about 157B parameters, 39 GB a GPU in bf16 at tensor parallel 8 with
# expert parallel 8. Every head, expert and vocabulary count divides by 8.
KIMI_W6_X8 = dict(
    KIMI_W6,
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=32,
    **_kimi_layers(48),
    linear_num_heads=32,
    num_local_experts=256,
    num_experts_per_tok=8,
)

# its CPU-sized version: the heads and experts still divide by 8, for 8 gloo ranks
SMALL_KIMI_X8 = dict(
    SMALL_KIMI,
    num_attention_heads=8,
    num_key_value_heads=8,
    linear_num_heads=8,
    num_local_experts=16,
)

# --model names: (config, its CPU-sized version for --small)
# Kimi-K2-Thinking's quantization_config (compressed-tensors pack-quantized): its routed
# experts INT4 in groups of 32, everything else in the model's dtype. A config with it
# and load_format="dummy" gives the experts random packed weights (W4-INT4, W6-INT4).
INT4_EXPERTS = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "actorder": None,
                "dynamic": False,
            },
        }
    },
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    ],
    "quantization_status": "compressed",
}


def with_int4_experts(config: dict) -> dict:
    """`config` with Kimi-K2-Thinking's INT4 quantization_config (INT4_EXPERTS)."""
    return dict(config, quantization_config=INT4_EXPERTS)


MODELS = {
    "qwen3-0.6b": (QWEN3_0_6B, SMALL_MODEL),
    "llama-3.1-8b": (LLAMA_3_1_8B, SMALL_LLAMA),
    "moonlight-w4": (MOONLIGHT_W4, SMALL_MOONLIGHT),
    "kimi-w6": (KIMI_W6, SMALL_KIMI),
    "kimi-w6-x8": (KIMI_W6_X8, SMALL_KIMI_X8),
}


def w1_requests() -> tuple[list[list[int]], list[int]]:
    """W1 `nano`: 256 prompts of 100-1024 random tokens, outputs of 100-1024 tokens."""
    random.seed(0)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)
    ]
    out_lens = [random.randint(100, 1024) for _ in range(256)]
    return prompts, out_lens


def w2_requests(
    n: int = 1024,
    prompt_lens: tuple[int, int] = (512, 2048),
    out_lens: tuple[int, int] = (128, 512),
    max_token: int = 10000,
) -> tuple[list[list[int]], list[int]]:
    """W2 `pressure`: 1024 prompts of 512-2048 random tokens, outputs of 128-512 tokens.

    Drawn like W1, in this order with Python's `random` after `random.seed(0)`:
    `prompts = [[randint(0, 10000) for _ in range(randint(512, 2048))] for _ in range(1024)]`,
    then `out_lens = [randint(128, 512) for _ in range(1024)]`. The arguments scale it
    down for `--small` runs (same order of draws).
    """
    random.seed(0)
    prompts = [
        [random.randint(0, max_token) for _ in range(random.randint(*prompt_lens))]
        for _ in range(n)
    ]
    return prompts, [random.randint(*out_lens) for _ in range(n)]


def w3_requests(
    num_prefixes: int = 64,
    num_questions: int = 32,
    prefix_len: int = 3000,
    question_len: int = 100,
    out_len: int = 16,
    max_token: int = 10000,
) -> tuple[list[list[int]], list[int]]:
    """W3 `shared-prefix`: 64 prefixes of 3,000 random tokens x 32 questions of 100, 16
    output tokens each; request k is question k // 64 after prefix k % 64.

    Drawn in this order with Python's `random` after `random.seed(0)`:
    `prefixes = [[randint(0, 10000) for _ in range(3000)] for _ in range(64)]`, then
    `questions = [[[randint(0, 10000) for _ in range(100)] for _ in range(32)] for _ in
    range(64)]` (questions[p][q]: question q of prefix p). The requests then go round-robin
    over the prefixes, `[prefixes[p] + questions[p][q] for q in range(32) for p in
    range(64)]`, so each prefix comes back only after all 63 others: far more than a
    device pool of a few prefixes can keep, so a prefix is evicted from the device before
    its next use (grouped by prefix, a prefix would never be needed after its eviction and
    the host tier could not matter). The arguments scale it down for `--small` runs.
    """
    random.seed(0)
    prefixes = [
        [random.randint(0, max_token) for _ in range(prefix_len)] for _ in range(num_prefixes)
    ]
    questions = [
        [[random.randint(0, max_token) for _ in range(question_len)] for _ in range(num_questions)]
        for _ in range(num_prefixes)
    ]
    prompts = [
        prefixes[p] + questions[p][q] for q in range(num_questions) for p in range(num_prefixes)
    ]
    return prompts, [out_len] * len(prompts)


def w4_requests(
    n: int = 512, prompt_len: int = 1024, out_len: int = 128, max_token: int = 100000
) -> tuple[list[list[int]], list[int]]:
    """W4 `mla`: 512 prompts of 1024 random tokens, 128 output tokens each."""
    rng = random.Random(4)
    prompts = [[rng.randint(3, max_token) for _ in range(prompt_len)] for _ in range(n)]
    return prompts, [out_len] * n


def small_requests(n: int = 8) -> tuple[list[list[int]], list[int]]:
    """A CPU-sized version of W1 for CI (`--small`)."""
    rng = random.Random(0)
    prompts = [[rng.randint(3, 500) for _ in range(rng.randint(8, 40))] for _ in range(n)]
    return prompts, [rng.randint(4, 16) for _ in range(n)]


def random_checkpoint(
    path: Path, config: dict, dtype: str = "bfloat16", seed: int = 0, std: float = 0.02
) -> Path:
    """Write a random-weight transformers checkpoint (with a placeholder tokenizer). A
    directory that holds one of this config (every field, dtype included, as config_dir
    checks) is used as it is; one of another config is an error."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(**config, dtype=dtype)
    if _holds(path, cfg):
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    model.save_pretrained(path)
    _placeholder_tokenizer(path, cfg.vocab_size)
    return path


def config_dir(path: Path, config: dict, dtype: str = "bfloat16") -> Path:
    """A model directory holding only config.json and a placeholder tokenizer, for
    load_format="dummy" (weights drawn on the device, nothing of the model's size on
    disk). A directory whose config.json is this config (every field, as transformers
    reads it back: the MoE widths, quantization_config and dtype included) is used as it
    is; one with any other config.json is an error (it is never overwritten)."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**config, dtype=dtype)
    if _holds(path, cfg):
        return path
    path.mkdir(parents=True, exist_ok=True)
    _placeholder_tokenizer(path, cfg.vocab_size)
    cfg.save_pretrained(path)  # last: a directory with config.json is complete
    return path


def _holds(path: Path, cfg) -> bool:
    """Whether `path` holds a config.json, which must be `cfg` (ValueError naming the
    fields that differ otherwise)."""
    import transformers

    if not (path / "config.json").is_file():
        return False
    differ = _fields_that_differ(transformers.AutoConfig.from_pretrained(path), cfg)
    if differ:
        raise ValueError(
            f"{path} holds another model's config.json ({', '.join(differ)} differ): "
            "give this model another directory"
        )
    return True


def _fields_that_differ(have, want) -> list[str]:
    """The fields of two transformers configs that differ, but for where each was read
    from and the transformers version that wrote it."""
    a, b = have.to_dict(), want.to_dict()
    fields = (a.keys() | b.keys()) - {"transformers_version"}
    return sorted(k for k in fields if not k.startswith("_") and a.get(k) != b.get(k))


def _placeholder_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="t1", unk_token="t0", pad_token="t0"
    ).save_pretrained(path)

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


def w1_requests() -> tuple[list[list[int]], list[int]]:
    """W1 `nano`: 256 prompts of 100-1024 random tokens, outputs of 100-1024 tokens."""
    random.seed(0)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)
    ]
    out_lens = [random.randint(100, 1024) for _ in range(256)]
    return prompts, out_lens


def small_requests(n: int = 8) -> tuple[list[list[int]], list[int]]:
    """A CPU-sized version of W1 for CI (`--small`)."""
    rng = random.Random(0)
    prompts = [[rng.randint(3, 500) for _ in range(rng.randint(8, 40))] for _ in range(n)]
    return prompts, [rng.randint(4, 16) for _ in range(n)]


def random_checkpoint(
    path: Path, config: dict, dtype: str = "bfloat16", seed: int = 0, std: float = 0.02
) -> Path:
    """Write a random-weight transformers checkpoint (with a placeholder tokenizer)."""
    import torch
    import transformers

    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = transformers.AutoConfig.for_model(**config)
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


def _placeholder_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="t1", unk_token="t0", pad_token="t0"
    ).save_pretrained(path)

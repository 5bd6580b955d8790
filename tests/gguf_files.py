"""A tiny GGUF file laid out as the default model's (llama, a GPT-2 byte-level BPE
vocabulary with merges, tied embeddings, F32 and Q8_0 tensors), random weights:
transformers reads its config, tokenizer and tensors the way it reads the default
model's, in a fraction of the time."""

from __future__ import annotations

from pathlib import Path

import numpy as np

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r"]


def write_tiny_gguf(path: Path, layers: int = 2, seed: int = 0) -> Path:
    """A llama GGUF at `path`: 64 wide, 4 heads of 16 (2 KV heads), MLPs of 128."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_tokens = sorted(bytes_to_unicode().values())
    merged = ["".join(m.split()) for m in MERGES]
    tokens = SPECIAL + byte_tokens + merged
    hidden, ffn, heads, kv_heads, head_dim = 64, 128, 4, 2, 16
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny test llama")
    writer.add_block_count(layers)
    writer.add_context_length(1024)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    rng = np.random.default_rng(seed)

    def add(name: str, *shape: int, quantized: bool = False) -> None:
        data = rng.standard_normal(shape).astype(np.float32) * 0.05
        if quantized:  # Q8_0 blocks of 32 along the rows, as most of the default model's
            raw = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, data)

    add("token_embd.weight", len(tokens), hidden, quantized=True)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.attn_q.weight", heads * head_dim, hidden, quantized=True)
        add(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden, quantized=True)
        add(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        add(f"blk.{i}.ffn_norm.weight", hidden)
        add(f"blk.{i}.ffn_gate.weight", ffn, hidden, quantized=True)
        add(f"blk.{i}.ffn_up.weight", ffn, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, ffn)
    add("output_norm.weight", hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

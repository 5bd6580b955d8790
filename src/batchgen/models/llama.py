"""Llama-family decoders: Llama 2/3/3.1, SmolLM2, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm)."""

from __future__ import annotations

import torch
from torch import nn

from batchgen.kv_state import KVState
from batchgen.layers import batch_invariant
from batchgen.layers.activation import silu_and_mul
from batchgen.layers.attention import Attention
from batchgen.layers.kv_scales import split_name
from batchgen.layers.linear import Linear, merged_shards
from batchgen.layers.norm import RMSNorm
from batchgen.layers.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    local_kv_heads,
)
from batchgen.layers.rotary import RotaryEmbedding
from batchgen.layers.tp_group import TPGroup


class LlamaAttention(nn.Module):
    """With `tp`, this rank's share of the heads: num_heads and num_kv_heads are local."""

    def __init__(
        self,
        config,
        layer_id: int,
        rotary: RotaryEmbedding,
        qkv_bias: bool,
        qk_norm: bool,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_args = (config.hidden_size, q_size + 2 * kv_size, qkv_bias or attention_bias)
        qkv_shards = merged_shards({"q": q_size, "k": kv_size, "v": kv_size})
        if tp is None:
            self.qkv_proj = Linear(*qkv_args, shards=qkv_shards)
            self.o_proj = Linear(q_size, config.hidden_size, bias=attention_bias)
        else:  # whole heads per rank, checked before the projections split their rows
            total_kv_heads = self.num_kv_heads
            self.num_kv_heads = local_kv_heads(self.num_kv_heads, tp.size)
            self.num_heads = tp.split(self.num_heads, "num_attention_heads")
            self.qkv_proj = ColumnParallelLinear(*qkv_args, shards=qkv_shards, tp=tp)
            self.o_proj = RowParallelLinear(q_size, config.hidden_size, attention_bias, tp=tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        window = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True) is False:
            window = None
        first = 0 if tp is None else tp.rank * self.num_kv_heads  # this rank's KV heads
        self.attn = Attention(
            layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
            window, first, self.num_kv_heads if tp is None else total_kv_heads,
        )  # fmt: skip

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.attn.takes_qkv(qkv):  # rope kernel (and the K/V store with it on Triton)
            out = self.attn.forward_qkv(qkv, positions, self.rotary, self.q_norm, self.k_norm)
            return self.o_proj(out.reshape(t, -1))
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v).reshape(t, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config, tp: TPGroup | None = None) -> None:
        super().__init__()
        inter = config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        shards = merged_shards({"gate": inter, "up": inter})
        if tp is None:
            self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias=bias, shards=shards)
            self.down_proj = Linear(inter, config.hidden_size, bias=bias)
        else:
            self.gate_up_proj = ColumnParallelLinear(
                config.hidden_size, 2 * inter, bias, shards=shards, tp=tp
            )
            self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer_id: int,
        rotary: RotaryEmbedding,
        qkv_bias: bool,
        qk_norm: bool,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, rotary, qkv_bias, qk_norm, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.forward_residual(x, residual)
        h = self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm.forward_residual(h, residual)
        return self.mlp(h), residual


class DecoderStack(nn.Module):
    """What every decoder-only model here shares: `embed_tokens`, `layers` (each
    `layer(positions, x, residual) -> (x, residual)`), a final `norm`, and `lm_head`
    (None: tied to the embeddings)."""

    def build_embedding(self, config, tp: TPGroup | None) -> None:
        """`embed_tokens`: plain on one process, the vocabulary split across ranks with
        `tp`. Built before the layers and build_lm_head after them, so that parameters
        keep their order (dummy weights are drawn in it)."""
        if tp is None:  # an empty weight: nn.Embedding's own init draws one, on meta
            # through torch._refs, which imports torch._dynamo (~1 s of every start)
            shape = (config.vocab_size, config.hidden_size)
            self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        else:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)

    def build_lm_head(self, config, tp: TPGroup | None) -> None:
        """`tie_word_embeddings` and `lm_head` (None when tied), split as the embedding."""
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        elif tp is None:
            # compute_logits reads its matrix: never quantized
            self.lm_head = Linear(config.hidden_size, config.vocab_size, quantizable=False)
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Packed tokens [T] at positions [T] -> final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm.forward_residual(x, residual)
        return x

    def decoder_name(self, name: str) -> str | None:
        """A transformers weight name without its "model." prefix; None for the lm_head
        weight of a model whose lm_head is tied to the embeddings (nothing to load)."""
        if name.startswith("model."):
            name = name[len("model.") :]
        if name == "lm_head.weight" and self.lm_head is None:
            return None
        return name

    def module_target(self, name: str) -> tuple[nn.Module, str, str | None]:
        """(module, parameter, shard) by walking the dotted name, the module before the
        parameter renamed through the model's `stacked` map ({name: (stacked module,
        shard)}); KeyError for a name that leads nowhere. A KV-cache scale
        (layers/kv_scales.py: "self_attn.k_scale", ...) goes to the layer's attention
        (its `attn` where it has one) as parameter "k", "v" or "kv"."""
        scale = split_name(name)
        if scale is not None:
            attn = self._walk(scale[0].split("."), name)
            return getattr(attn, "attn", attn), scale[1], None
        *path, param = name.split(".")
        shard = None
        if len(path) >= 2 and path[-1] in self.stacked:
            path[-1], shard = self.stacked[path[-1]]
        return self._walk(path, name), param, shard

    def _walk(self, path: list[str], name: str) -> nn.Module:
        """The submodule at dotted `path` (indices into module lists); KeyError(name)."""
        module = self
        for part in path:
            if part.isdigit():
                module = module[int(part)] if int(part) < len(module) else None
            else:
                module = getattr(module, part, None)
            if module is None:
                raise KeyError(name)
        return module

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> logits [T, vocab]; under tensor parallel every rank's
        vocabulary range, gathered."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if isinstance(head, VocabParallelEmbedding):
            return head.logits(hidden)
        return batch_invariant.linear(hidden, head.weight)

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary columns of compute_logits (all of them on one process),
        with no collective: the same GEMM, for warming it on one rank alone."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return batch_invariant.linear(hidden, head.weight)


class LlamaForCausalLM(DecoderStack):
    """Weight names follow transformers' checkpoints; q/k/v and gate/up are stacked.

    With `tp` (layers/tp_group.py) this rank's tensor-parallel share: heads, KV heads,
    the MLP's intermediate features and the vocabulary split across ranks, one
    all-reduce after o_proj and one after down_proj, logits gathered. None: one
    process, the plain layers. `num_local_kv_heads`: the KV heads this rank's pool holds.
    """

    qkv_bias = False
    qk_norm = False
    stacked = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }
    tensor_parallel = True

    def __init__(self, config, max_positions: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.rotary = RotaryEmbedding(config, head_dim, max_positions)
        self.build_embedding(config, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary, self.qkv_bias, self.qk_norm, tp)
            for i in range(config.num_hidden_layers)
        )
        self.num_local_kv_heads = self.layers[0].self_attn.num_kv_heads
        # per token per layer: K and V of this rank's KV heads
        self.kv_state = KVState.mha(self.num_local_kv_heads, head_dim)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.build_lm_head(config, tp)

    def checkpoint_target(self, name: str) -> tuple[nn.Module, str, str | None] | None:
        """(module, 'weight'|'bias', shard) for a transformers weight name; None to skip."""
        name = self.decoder_name(name)
        if name is None:
            return None
        if "rotary_emb" in name:
            return None
        return self.module_target(name)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

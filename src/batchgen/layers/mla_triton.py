"""Triton MLA attention over the latent paged cache: the semantics of mla_torch, on kernels.

- store: `kernels.store_kv.store_latent` (negative slots, a graph batch's padding rows,
  write nothing).
- decode rows: `kernels.mla_decode.mla_decode`, absorbed, one launch (two with a split);
  the split count comes from the runner (`meta.decode_num_splits`, the DecodeSplitPlan's
  for the batch's bucket) so a graph replay and an eager step reduce alike. Nothing is
  read back to the host: capturable.
- prefill chunks: the latent pages of the step's prefilling sequences are gathered and
  decompressed through kv_b_proj into per-head K [nope | rope] and V, laid out as pages
  of their own, then `kernels.prefill_attention` runs causally over them with the chunk's
  cached prefix (keys 192 wide, values 128 in DeepSeek-V3: the kernel takes both).

    gathered pages:  | seq 0's pages (ceil(seq_len / page_size)) | seq 1's pages | ...
    page table row i: arange(first page of seq i, its last), padded with page 0

In batch-invariant mode (deterministic=True) decode rows and prefill rows alike attend
absorbed through `kernels.invariant_attention` (the latent one head shared by all H,
key its C + R values, value its first C): a token's bits whatever its batch, and the same
decoded as prefilled (`paged_prefill_absorbed`, mla_torch's twin).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from batchgen.forward_context import AttentionMetadata, derived, parts_to_device
from batchgen.kernels.invariant_attention import invariant_attention, invariant_decode
from batchgen.kernels.mla_decode import mla_decode
from batchgen.kernels.prefill_attention import prefill_attention
from batchgen.kernels.store_kv import store_latent  # noqa: F401  (the backend's latent write)
from batchgen.layers import batch_invariant
from batchgen.layers.attention_triton import padded_prefills


def paged_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Absorbed decode, one query per decode row: q_nope [B, H, C] with W_UK folded in,
    q_pe [B, H, R] -> [B, H, C] in q_nope's dtype, W_UV not yet applied."""
    if batch_invariant.active():
        k, k_rope = _latent_parts(cache, q_nope.shape[-1])
        return invariant_decode(
            q_nope,
            k,
            k,
            meta.decode_page_table,
            meta.decode_seq_lens,
            scale,
            q_rope=q_pe.to(q_nope.dtype).contiguous(),
            k_rope=k_rope,
        )
    return mla_decode(
        q_nope,
        q_pe.to(q_nope.dtype),
        cache,
        meta.decode_page_table,
        meta.decode_seq_lens,
        scale,
        max_seq_len=meta.decode_max_seq_len or None,
        num_splits=meta.decode_num_splits,
    )


def paged_prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    scale: float,
    out: torch.Tensor,
) -> None:
    """Decompressed prefill into out's prefill rows: q_nope [T, H, nope], q_pe [T, H,
    rope]; out [T, H, Dv]. Every prefill chunk's own latents are already in the cache.
    The kernel takes queries and keys in their two parts (k_pe one head for all): no
    joined copy of either."""
    pages, index, max_q_len = derived(
        meta, "mla_prefill", lambda: _prefill_index(meta, q_nope.device)
    )
    n, page_size = pages.numel(), cache.shape[1]
    latent = cache[pages].reshape(n * page_size, cache.shape[-1]).to(q_nope.dtype)  # FP8 upcast
    k_nope, k_pe, v = expand(latent)
    prefill_attention(
        q_nope,
        k_nope.view(n, page_size, *k_nope.shape[1:]),
        v.view(n, page_size, *v.shape[1:]),
        *index,
        max_q_len,
        scale,
        out=out,
        q_rope=q_pe,
        k_rope=k_pe.view(n, page_size, 1, k_pe.shape[-1]),
    )


def paged_prefill_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Prefill rows attended as decode rows are, for batch-invariant mode: q_nope [T, H,
    C] with W_UK folded in, q_pe [T, H, R]; writes each prefill chunk's rows of out [T,
    H, C] (W_UV not yet applied; q_nope's dtype, as paged_decode returns) through the
    same kernel and launch as paged_decode, so a token decoded and the same token
    prefilled (a one-token chunk, a recomputed request) have the same bits."""
    q_start, q_len, seq_lens, table, max_q_len = derived(
        meta, "padded_prefills", lambda: padded_prefills(meta, q_nope.device)
    )
    k, k_rope = _latent_parts(cache, q_nope.shape[-1])
    invariant_attention(
        q_nope,
        k,
        k,
        q_start,
        q_len,
        seq_lens,
        table,
        max_q_len,
        scale,
        out=out,
        q_rope=q_pe.to(q_nope.dtype).contiguous(),
        k_rope=k_rope,
    )


def _latent_parts(cache: torch.Tensor, lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent pages [P, S, 1, C + R] as the two parts of one key head: [..., :C] (key
    and value) and [..., C:] (rope)."""
    return cache[..., :lora_rank], cache[..., lora_rank:]


def _prefill_index(meta: AttentionMetadata, device: torch.device):
    """What paged_prefill needs of the step's prefill requests, the same for every layer:
    their pages in one list, their q_start, q_len and seq_len, and a page table over that
    list (request i's pages are a run of it), all on the device in one copy."""
    seqs = meta.prefills
    counts = [s.pages.numel() for s in seqs]  # ceil(seq_len / page_size) each
    pages = torch.cat([s.pages for s in seqs])
    num, width = len(seqs), max(counts)
    table = np.zeros((num, width), dtype=np.int64)
    first = 0
    for i, n in enumerate(counts):
        table[i, :n] = np.arange(first, first + n)
        first += n
    parts = [[s.q_start for s in seqs], [s.q_len for s in seqs], [s.seq_len for s in seqs], table]
    q_start, q_len, seq_len, flat = parts_to_device(parts, device)
    index = (q_start, q_len, seq_len, flat.view(num, width))
    return pages, index, max(s.q_len for s in seqs)

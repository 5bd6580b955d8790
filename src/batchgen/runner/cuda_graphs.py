"""CUDA graphs of the decode forward, captured for bucketed batch sizes.

A pure-decode step (every scheduled request computes one token) copies its inputs into
static buffers and replays the graph of the smallest bucket that holds it; padding rows
have slot -1 (store_kv writes nothing) and a one-token context, and their outputs are
ignored. The graphs bake in the KV pool's addresses: re-capture after the pool changes.
Only graph-safe backends (no host syncs, shapes fixed by the static buffers) capture.

    static buffers (max_bs rows):  input_ids | positions | slot_mapping | seq_lens
                                   page_table [max_bs, max_pages]
                                   state_slots (models with linear-attention layers)
    bucket bs replays on rows [0, bs); rows [n, bs) are padding

A model with linear-attention (KDA) layers also reads and writes each request's state
slot: the graphs bind the state pool's tensors and a static slot per row; padding rows
use the pool's spare slot (all of them at once: what they leave there is never read).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch

from batchgen.forward_context import (
    AttentionMetadata,
    ForwardContext,
    LinearAttentionMetadata,
    bind_forward_context,
)
from batchgen.layers.expert_parallel import fixed_capacity

logger = logging.getLogger(__name__)

BUCKETS = (
    *(1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256),
    *(320, 384, 448, 512, 640, 768, 896, 1024),  # above 256: padding at most a quarter
)


def bucket_for(n: int, max_bs: int) -> int:
    """The captured batch size that a decode step of n <= max_bs requests replays."""
    return next((b for b in BUCKETS if n <= b < max_bs), max_bs)


class DecodeSplitPlan:
    """The decode kernel's split count for a step of n decodes, a function of n's bucket
    and the longest allowed context only, so an eager step and a graph replay of the
    same batch run the same reduction order and give identical results."""

    def __init__(self, max_bs: int, num_kv_heads: int, max_len: int, device: torch.device):
        from batchgen.kernels.decode_attention import choose_num_splits

        self._choose = choose_num_splits
        self.max_bs, self.num_kv_heads = max_bs, num_kv_heads
        self.max_len, self.device = max_len, device
        self._cache: dict[int, int] = {}

    def __call__(self, n: int) -> int:
        bs = bucket_for(min(n, self.max_bs), self.max_bs)
        if bs not in self._cache:
            self._cache[bs] = self._choose(bs, self.num_kv_heads, self.max_len, self.device)
        return self._cache[bs]


class DecodeGraphs:
    def __init__(
        self,
        model,
        kv_caches,
        backend: str,
        max_bs: int,
        max_pages: int,
        hidden_size: int,
        device: torch.device,
        dtype: torch.dtype,
        split_plan: DecodeSplitPlan,
        capture_guard: Callable[[], AbstractContextManager] | None = None,
        linear_states: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        spare_slot: int | None = None,
    ) -> None:
        if linear_states is not None and spare_slot is None:
            raise ValueError("linear_states needs the state pool's spare_slot for padding rows")
        self.split_plan = split_plan
        # held around every capture: a global-mode capture fails if another thread
        # issues CUDA work meanwhile (the host tier's copy worker pauses under it)
        self.capture_guard = capture_guard or nullcontext
        # every capture runs on one side stream, made at the first: a capture again
        # (after a pool change) adds no stream with work to the process, and on an H200
        # work on a further stream slows every later graph replay (~0.4 us a kernel)
        self.capture_stream: torch.cuda.Stream | None = None
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.max_pages = max_pages
        self.buckets = [b for b in BUCKETS if b < max_bs] + [max_bs]
        self.max_bs = max_bs
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_bs, **i64)
        self.positions = torch.zeros(max_bs, **i64)
        self.slots = torch.full((max_bs,), -1, **i64)
        self.seq_lens = torch.ones(max_bs, **i64)
        self.rows = torch.arange(max_bs, **i64)
        self.table = torch.zeros(max_bs, max_pages, **i64)
        self.hidden = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # forward + a tail (`run(..., tail=)`): graphs per (tail key, bucket), the words
        # the tails read, their [max_bs] output, and the pool they were captured over
        self.tail_graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.tail_words: torch.Tensor | None = None
        self.tail_out = torch.zeros(max_bs, **i64)
        self._tail_kv = self._pool = None
        self.dtype = dtype
        # graph-pool bytes the widest tail captured so far holds (a new one reuses them),
        # the tail variants refused for want of memory (they sample eagerly) and whether
        # that was said once (graph_sampling.graph_tail)
        self.tail_bytes = 0
        self.refused_tails: set = set()
        self.warned_tails = False
        self.linear_states, self.spare_slot = linear_states, spare_slot
        if linear_states is not None:  # one token a request: rows are the sequences
            self.state_slots = torch.full((max_bs,), spare_slot, **i64)
            self.cu_seqlens = torch.arange(max_bs + 1, **i64)
            self.no_fresh = torch.empty(0, **i64)  # decodes continue from their slots

    def _ctx(self, bs: int) -> ForwardContext:
        meta = AttentionMetadata(
            num_tokens=bs,
            slot_mapping=self.slots[:bs],
            decode_rows=self.rows[:bs],
            decode_page_table=self.table[:bs],
            decode_seq_lens=self.seq_lens[:bs],
            decode_max_seq_len=0,
            decode_num_splits=self.split_plan(bs),
        )
        ctx = ForwardContext(meta, self.kv_caches, self.backend)
        if self.linear_states is not None:
            ctx.linear_states = self.linear_states
            ctx.linear_metadata = LinearAttentionMetadata(
                seqs=[],  # no host ints: the kernels' decode path reads the tensors only
                cu_seqlens=self.cu_seqlens[: bs + 1],
                state_slots=self.state_slots[:bs],
                fresh_slots=self.no_fresh,
                max_q_len=1,
            )
        return ctx

    def _forward(self, bs: int) -> None:
        # expert-parallel layers dispatch through fixed-capacity buffers (no host read),
        # local tokens' sized by the bucket (attention data parallel: runner/paired.py)
        with bind_forward_context(self._ctx(bs)), fixed_capacity(bs):
            self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool. The static
        inputs are reset first: the warm-up forwards must write no KV (slot -1), whatever
        an earlier replay left there (graphs are re-captured after a pool change).
        Runs under `capture_guard()`."""
        with self.capture_guard():
            self._capture()

    def _capture(self) -> None:
        self._reset_inputs()
        pool = None
        if self.capture_stream is None:
            self.capture_stream = torch.cuda.Stream()
        stream = self.capture_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.buckets):
                self._forward(bs)  # warm-up: compiles kernels, settles allocations
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._forward(bs)
                pool = graph.pool()
                self.graphs[bs] = graph
        torch.cuda.current_stream().wait_stream(stream)
        self._pool = pool
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def _reset_inputs(self) -> None:
        self.input_ids.zero_()
        self.positions.zero_()
        self.slots.fill_(-1)
        self.seq_lens.fill_(1)
        self.table.zero_()
        if self.linear_states is not None:
            self.state_slots.fill_(self.spare_slot)

    def has_tail(self, key) -> bool:
        """Whether the tail graphs of `key` are captured over the current pool."""
        return self._tail_kv is self.kv_caches and (key, self.max_bs) in self.tail_graphs

    def tail_room(self, pool_bytes: int, other_bytes: int = 0) -> bool:
        """Whether a tail whose graphs hold `pool_bytes` in the graph pool (at max_bs),
        and `other_bytes` more allocated beside it, fits on the device now: what the
        tails captured so far hold is reused, the rest must be free once the allocator's
        cached blocks are given back (a capture can only allocate, never free them)."""
        extra = max(0, pool_bytes - self.tail_bytes) + other_bytes
        if extra == 0:
            return True
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.input_ids.device)
        return extra <= free

    @torch.inference_mode()
    def capture_tail(self, tail) -> bool:
        """Capture the forward followed by ``tail.compute(hidden [bs, H], words) ->
        [bs]`` for every bucket (words: the bucket's `tail.words_per_bucket(bs)` static
        int64 words, padding rows' while capturing), over the forward graphs' pool and
        stream (captured first if they are not), under `capture_guard()`. Graphs of older
        tail keys beyond the last four are dropped. Every bucket runs once eagerly first
        (compiles, allocates); False, nothing captured, where that runs out of memory.
        The cache those runs leave is given back before the captures allocate the pool."""
        if not self.graphs:
            self.capture()
        if self._tail_kv is not self.kv_caches:  # a new pool: the old graphs baked it in
            self.tail_graphs.clear()
            self._tail_kv = self.kv_caches
        size = tail.words_per_bucket(self.max_bs)
        if self.tail_words is None or self.tail_words.numel() < size:
            self.tail_graphs.clear()  # they read the old words
            self.tail_words = torch.zeros(size, dtype=torch.int64, device=self.input_ids.device)
        keys = list(dict.fromkeys(key for key, _ in self.tail_graphs))
        for old in keys[:-3]:
            for bs in self.buckets:
                self.tail_graphs.pop((old, bs), None)
        with self.capture_guard():
            self._reset_inputs()
            stream = self.capture_stream
            stream.wait_stream(torch.cuda.current_stream())
            try:
                with torch.cuda.stream(stream):
                    for bs in reversed(self.buckets):
                        self._forward_tail(tail, bs, self._padding_words(tail, bs))
            except torch.OutOfMemoryError:
                logger.warning("no memory to warm decode graphs with sampling %s", tail.key[0])
                return False
            finally:
                torch.cuda.current_stream().wait_stream(stream)
                torch.cuda.empty_cache()
            try:
                with torch.cuda.stream(stream):
                    for bs in reversed(self.buckets):
                        words = self._padding_words(tail, bs)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                            self._forward_tail(tail, bs, words)
                        self._pool = graph.pool()
                        self.tail_graphs[tail.key, bs] = graph
            except BaseException:  # no key left with some buckets only (has_tail reads one)
                for bs in self.buckets:
                    self.tail_graphs.pop((tail.key, bs), None)
                raise
            finally:
                torch.cuda.current_stream().wait_stream(stream)
        self.tail_bytes = max(self.tail_bytes, tail.pool_bytes(self.max_bs, self.dtype))
        logger.info("captured decode CUDA graphs with sampling %s", tail.key[0])
        return True

    def _padding_words(self, tail, bs: int) -> torch.Tensor:
        """Bucket bs's static words, set to padding rows' (what a capture runs on)."""
        words = self.tail_words[: tail.words_per_bucket(bs)]
        words.copy_(torch.from_numpy(tail.words(bs, rows=False)))
        return words

    def _forward_tail(self, tail, bs: int, words: torch.Tensor) -> None:
        self._forward(bs)
        self.tail_out[:bs] = tail.compute(self.hidden[:bs], words)

    def clear(self) -> None:
        """Drop every captured graph (the KV pool was re-created): the next replay
        captures again, with a new pool, and a refused tail variant may fit now. The
        old pool's layer caches are let go too (the tails' record of the pool they were
        captured over): reconfigure() frees the old pool before it allocates the new."""
        self.graphs.clear()
        self.tail_graphs.clear()
        self._tail_kv = None
        self.tail_bytes = 0
        self.refused_tails.clear()

    def bucket(self, n: int) -> int:
        return bucket_for(n, self.max_bs)

    def run(
        self,
        ids,
        positions,
        slots,
        table,
        stage,
        device_ids=None,
        state_slots=None,
        tail=None,
        bucket: int | None = None,
    ) -> torch.Tensor:
        """Replay the decode graph for len(ids) requests; returns hidden [n, hidden].

        ids, positions, slots [n] and table [n, width] are int64 numpy arrays (table
        entries past a row's own pages are ignored); stage(array) puts an int64 array on
        the device; device_ids [n], when given, replaces ids (tokens still on the device);
        state_slots [n]: each request's state slot (models with linear-attention layers).
        Padding rows get token 0, slot -1, a one-token context and the spare state slot.
        tail (`capture_tail`): the graph that also runs it replays, its words for the
        step staged with the inputs; ``tail.tokens`` is then its output [n] (a copy).
        bucket: the captured size to replay, >= n (the one the attention data-parallel
        ranks agreed: runner/paired.py), else the smallest holding n."""
        if not self.graphs:
            self.capture()
        n = len(ids)
        bs = self.bucket(n) if bucket is None else bucket
        if bucket is not None and (bs not in self.graphs or n > bs):
            raise ValueError(f"{n} rows cannot replay bucket {bs} (captured: {self.buckets})")
        if tail is not None and (
            self._tail_kv is not self.kv_caches or (tail.key, bs) not in self.tail_graphs
        ):
            if not self.capture_tail(tail):
                raise torch.OutOfMemoryError("no memory to capture the decode graphs' tail")
        width = table.shape[1]
        linear = self.linear_states is not None
        if linear and (state_slots is None or len(state_slots) != n):
            raise ValueError("a model with linear-attention layers replays with state_slots [n]")
        end = 4 * bs + bs * width
        words = 0 if tail is None else tail.words_per_bucket(bs)
        buf = np.zeros(end + (bs if linear else 0) + words, dtype=np.int64)
        buf[:n] = ids
        buf[bs : bs + n] = positions
        buf[2 * bs : 3 * bs] = -1
        buf[2 * bs : 2 * bs + n] = slots
        buf[3 * bs : 4 * bs] = 1
        buf[3 * bs : 3 * bs + n] = positions + 1
        buf[4 * bs : end] = 0
        buf[4 * bs : 4 * bs + n * width] = table.ravel()
        if linear:
            buf[end : end + bs] = self.spare_slot
            buf[end : end + n] = state_slots
        if words:
            buf[buf.size - words :] = tail.words(bs)
        dev = stage(buf)
        self.input_ids[:bs].copy_(dev[:bs])
        if device_ids is not None:
            self.input_ids[:n].copy_(device_ids)
        self.positions[:bs].copy_(dev[bs : 2 * bs])
        self.slots[:bs].copy_(dev[2 * bs : 3 * bs])
        self.seq_lens[:bs].copy_(dev[3 * bs : 4 * bs])
        self.table[:bs, :width].copy_(dev[4 * bs : end].view(bs, width))
        if linear:
            self.state_slots[:bs].copy_(dev[end : end + bs])
        if words:
            self.tail_words[:words].copy_(dev[buf.size - words :])
            self.tail_graphs[tail.key, bs].replay()
            tail.tokens = self.tail_out[:n].clone()  # the next replay writes tail_out
            return self.hidden[:n]
        self.graphs[bs].replay()
        return self.hidden[:n]

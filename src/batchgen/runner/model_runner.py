"""The model runner: turns a SchedulerOutput into one packed forward and a sample."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch
from torch.profiler import record_function

from batchgen.forward_context import (
    AttentionMetadata,
    ForwardContext,
    PrefillSeq,
    bind_forward_context,
    pack_aligned,
    unpack_aligned,
)
from batchgen.runner.batch import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from batchgen.runner.cuda_graphs import DecodeGraphs, DecodeSplitPlan
from batchgen.runner.linear_state import linear_metadata
from batchgen.runner.mask_staging import MaskStaging
from batchgen.runner.page_rows import PageRows
from batchgen.runner.penalty_counts import PenaltyCounts
from batchgen.runner.prompt_logprobs import prompt_logprobs, wants_prompt_logprobs
from batchgen.runner.sampler import (
    SAMPLING_EPS,
    Sampler,
    SamplingMetadata,
    apply_token_bitmask,
)
from batchgen.runner.staging import HostStaging


class ModelRunner:
    """Owns no policy: it computes exactly the tokens it is given and samples where told.

    The KV tensors belong to the page pool; the runner binds the per-layer views into
    the ForwardContext for each forward. `linear_states` (models with linear-attention
    layers: per such layer (states, windows) of the state pool) is bound the same way,
    with each step's `LinearAttentionMetadata` built from the requests' state slots.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, ...]],
        page_size: int,
        device: torch.device,
        vocab_size: int,
        eos_token_ids: list[int],
        debug: bool = False,
        attention_backend: str = "torch",
        graphs: DecodeGraphs | None = None,
        split_plan: DecodeSplitPlan | None = None,
        max_num_seqs: int = 256,
        max_pages: int = 256,
        seed: int = 0,
        linear_states: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.linear_states = linear_states
        self.page_size = page_size
        self.device = device
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.debug = debug
        self.attention_backend = attention_backend
        self.graphs = graphs
        self.split_plan = split_plan
        # rows without a seed get one drawn from this generator (the engine seeds every
        # request); the noise itself is a hash of (seed, step, token) on the device
        self.sampler = Sampler(torch.Generator().manual_seed(seed))
        # penalised requests' token counts, kept on the device from step to step
        self.penalties = PenaltyCounts(vocab_size, device)
        self.page_rows = PageRows(max_num_seqs, max_pages)
        self.stage = HostStaging(device)
        # structured outputs: the engine's StructuredOutputs once a request uses one
        self.grammar = None
        self._masks: MaskStaging | None = None  # their bitmask rows, built with it
        self._max_num_seqs = max_num_seqs

    def _release(self, request_ids) -> None:
        self.page_rows.release(request_ids)
        self.penalties.release(request_ids)

    def _width(self, pages: int) -> int:
        """Page-table width for a step: a multiple of 16 (so the kernels' row stride keeps
        one Triton specialisation), at most the table's."""
        return min(-(-max(pages, 1) // 16) * 16, self.page_rows.max_pages)

    def prepare(
        self, sched: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Packed input ids, positions, attention metadata and the rows to sample from.

        Everything is computed with numpy from the persistent page rows and crosses to
        the device in one copy; each part starts 16-byte aligned (Triton specialises
        pointers on it)."""
        reqs = sched.requests
        ps = self.page_size
        rows = np.asarray(self.page_rows.rows(reqs), dtype=np.int64)
        num = len(reqs)
        lens = np.fromiter((len(r.new_token_ids) for r in reqs), np.int64, num)
        starts = np.fromiter((r.start for r in reqs), np.int64, num)
        ends = np.cumsum(lens)
        q_start = ends - lens
        total = int(ends[-1])
        owner = np.repeat(np.arange(num), lens)
        positions = np.arange(total, dtype=np.int64) - q_start[owner] + starts[owner]
        table = self.page_rows.table
        slots = table[rows[owner], positions // ps] * ps + positions % ps
        ids = np.fromiter(itertools.chain.from_iterable(r.new_token_ids for r in reqs), np.int64)
        seq_lens = starts + lens
        sample = np.fromiter((r.sample for r in reqs), bool, num)
        parts = [ids, positions, slots, ends[sample] - 1]
        decode, prefill = np.flatnonzero(lens == 1), np.flatnonzero(lens > 1)
        dec_width = pre_width = 0
        if decode.size:
            dec_width = self._width(-(-int(seq_lens[decode].max()) // ps))
            parts += [q_start[decode], seq_lens[decode], table[rows[decode], :dec_width]]
        if prefill.size:
            pre_width = self._width(-(-int(seq_lens[prefill].max()) // ps))
            pre_table = table[rows[prefill], :pre_width]
            parts += [q_start[prefill], lens[prefill], seq_lens[prefill], pre_table]
        sizes = [p.size for p in parts]
        dev = self.stage(pack_aligned(parts))
        views = iter(unpack_aligned(dev, sizes))
        input_ids, pos_dev, slots_dev, sample_rows = (next(views) for _ in range(4))
        meta = AttentionMetadata(num_tokens=total, slot_mapping=slots_dev)
        if decode.size:
            meta.decode_rows = next(views)
            meta.decode_seq_lens = next(views)
            meta.decode_page_table = next(views).view(decode.size, dec_width)
            meta.decode_max_seq_len = int(seq_lens[decode].max())
            if self.split_plan is not None:
                meta.decode_num_splits = self.split_plan(int(decode.size))
        if prefill.size:
            meta.prefill_q_start = next(views)
            meta.prefill_q_len = next(views)
            meta.prefill_seq_lens = next(views)
            meta.prefill_page_table = next(views).view(prefill.size, pre_width)
            meta.prefill_max_q_len = int(lens[prefill].max())
            meta.prefills = [  # the reference backend's per-request view of the same table
                PrefillSeq(qs, ql, sl, meta.prefill_page_table[i, : -(-sl // ps)])
                for i, (qs, ql, sl) in enumerate(
                    zip(
                        q_start[prefill].tolist(),
                        lens[prefill].tolist(),
                        seq_lens[prefill].tolist(),
                    )
                )
            ]
        return input_ids, pos_dev, meta, sample_rows

    def set_kv_caches(self, kv_caches: list[tuple[torch.Tensor, ...]]) -> None:
        """Point at a re-created pool; captured graphs baked the old one in."""
        self.kv_caches = kv_caches
        self.page_rows.reset()
        if self.graphs is not None:
            self.graphs.kv_caches = kv_caches
            self.graphs.graphs.clear()

    def _graph_ok(self, sched: SchedulerOutput) -> bool:
        return (
            self.graphs is not None
            and sched.on_kv_written is None
            and len(sched.requests) <= self.graphs.max_bs
            and all(len(r.new_token_ids) == 1 for r in sched.requests)
        )

    def _replay(
        self, sched: SchedulerOutput, device_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        reqs = sched.requests
        ps = self.page_size
        n = len(reqs)
        rows = np.asarray(self.page_rows.rows(reqs), dtype=np.int64)
        starts = np.fromiter((r.start for r in reqs), np.int64, n)
        if device_ids is None:
            ids = np.fromiter((r.new_token_ids[0] for r in reqs), np.int64, n)
        else:
            ids = np.zeros(n, dtype=np.int64)
        table = self.page_rows.table
        slots = table[rows, starts // ps] * ps + starts % ps
        width = self._width(int(starts.max()) // ps + 1)
        state_slots = None
        if self.linear_states is not None:
            state_slots = np.fromiter((r.state_slot for r in reqs), np.int64, n)
        hidden = self.graphs.run(
            ids,
            starts,
            slots,
            table[rows, :width],
            self.stage,
            device_ids=device_ids,
            state_slots=state_slots,
        )
        if all(r.sample for r in reqs):
            return hidden, None
        keep = np.fromiter((i for i, r in enumerate(reqs) if r.sample), np.int64)
        return hidden, self.stage(keep)  # pinned staging: a blocking upload would sync

    @torch.inference_mode()
    def warm_logits(self, rows: int, hidden_size: int, dtype: torch.dtype) -> None:
        """On a GPU, the logits GEMM and greedy pick once for every row count 1..rows a
        step may sample. cuBLAS chooses its kernel by the row count, and under CUDA's
        lazy module loading the first launch of a kernel not loaded yet waits for the
        GPU to drain: in W6's decode tail that blocked six pipelined launches for
        15-29 ms each. Build time pays the loads instead. The model's local_logits
        runs the GEMM without the tensor-parallel gather, so each rank warms alone."""
        if self.device.type != "cuda":
            return
        hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=self.device)
        for m in range(1, rows + 1):
            self.model.local_logits(hidden[:m]).argmax(dim=-1)

    def can_launch_decode(self, sched: SchedulerOutput) -> bool:
        """Whether `launch_decode` takes this step: a decode step (graph-replayed when
        graphs are on) whose every request samples (greedy or not, seeded or not,
        min_tokens, penalties and logprobs allowed: penalty counts are kept on the
        device, logprobs copied to the host with the tokens)."""
        reqs = sched.requests
        return (
            not self.debug
            and sched.on_kv_written is None
            and (self.graphs is None or len(reqs) <= self.graphs.max_bs)
            and all(len(r.new_token_ids) == 1 and r.sample for r in reqs)
        )

    @torch.inference_mode()
    def launch_decode(
        self, sched: SchedulerOutput, prev: InFlightDecode | None = None
    ) -> InFlightDecode:
        """Queue a decode step (replay, logits, sampling, token copy to the host) and
        return without waiting. With `prev`, a request's input token is the one `prev`
        samples for it, read on the device: the step can be queued before `prev`
        finishes, and each request has that one token more than its output list shows
        (seeded noise and min_tokens count it).

        A step after `prev` with structured-output rows queues its forward only: their
        masks need `prev`'s tokens in the matchers, so its sampling is queued by
        `InFlightDecode.launch_sample()` once the engine has handed them over (the GPU
        runs the forward meanwhile)."""
        self._release(sched.released_ids)
        device_ids = None if prev is None else self._pipelined_ids(sched, prev)
        hidden, _ = self._forward(sched, device_ids)  # every row samples (can_launch_decode)
        logits = self.model.compute_logits(hidden)
        reqs = sched.requests
        flight = InFlightDecode(sched)
        steps = _sample_steps(reqs)
        flight.pending = lambda: self._launch_sample(flight, logits, steps)
        flight.deferred = prev is not None and self._constrained(reqs)
        if not flight.deferred:
            flight.launch_sample()
        return flight

    @torch.inference_mode()
    def launch_step(
        self, sched: SchedulerOutput, prev: InFlightDecode | None = None
    ) -> InFlightDecode:
        """Queue any step (async scheduling): its forward, the sampling of its rows that
        sample, and their tokens' copy to the host, without waiting. The engine sends
        only steps with no debug check, per-layer append, structured output or prompt
        logprobs (EngineCore._needs_sync and its configuration checks). A row whose last
        input token is -1 reads it from what `prev` samples for its request, on the
        device. A decode step that graphs can take goes through `launch_decode`."""
        reqs = sched.requests
        if self._graph_ok(sched) and all(r.sample for r in reqs):
            return self.launch_decode(sched, prev)
        self._release(sched.released_ids)
        device_ids = None if prev is None else self._pipelined_ids(sched, prev)
        hidden, sample_rows = self._forward(sched, device_ids)
        sampled = [r for r in reqs if r.sample]
        flight = InFlightDecode(sched, sampled)
        if not sampled:
            flight.tokens = torch.empty(0, dtype=torch.int64, device=self.device)
            self._copy_tokens(flight, flight.tokens)
            return flight
        if sample_rows is not None and sample_rows.numel() != hidden.shape[0]:
            hidden = hidden[sample_rows]
        logits = self.model.compute_logits(hidden)
        steps = _sample_steps(sampled)
        flight.pending = lambda: self._launch_sample(flight, logits, steps)
        flight.launch_sample()
        return flight

    def _pipelined_ids(self, sched: SchedulerOutput, prev: InFlightDecode) -> torch.Tensor:
        """The input tokens of a step queued after `prev` (its ids packed as prepare()
        packs them): a placeholder -1, a request's last input token, is the token `prev`
        samples for it, read on the device; the other tokens are as given."""
        reqs = sched.requests
        at = {r.request_id: i for i, r in enumerate(prev.sampled)}
        if all(len(r.new_token_ids) == 1 and r.new_token_ids[0] == -1 for r in reqs):
            index = self.stage(np.fromiter((at[r.request_id] for r in reqs), np.int64))
            return prev.tokens.index_select(0, index)  # a decode step after a decode step
        ids = np.fromiter(itertools.chain.from_iterable(r.new_token_ids for r in reqs), np.int64)
        ends = np.cumsum([len(r.new_token_ids) for r in reqs])
        holes = [i for i, r in enumerate(reqs) if r.new_token_ids[-1] == -1]
        src = np.fromiter((at[reqs[i].request_id] for i in holes), np.int64, len(holes))
        dev = self.stage(np.concatenate((ids, ends[holes] - 1, src)))
        total, n = ids.size, len(holes)
        out = dev[:total]
        if n:
            out[dev[total : total + n]] = prev.tokens.index_select(0, dev[total + n :])
        return out

    @torch.inference_mode()
    def _launch_sample(self, flight: InFlightDecode, logits: torch.Tensor, steps) -> None:
        reqs = flight.sampled
        logits = self._constrain(logits, reqs)
        reported = None
        if all(_plain_greedy(r.params) for r in reqs):
            tokens = logits.argmax(dim=-1)
        else:
            meta = self._sampling(reqs, steps)
            out = self.sampler(logits, meta)
            tokens = out.sampled_token_ids
            meta.record(tokens)
            if meta.need_logprobs:
                top = () if out.topk_token_ids is None else (out.topk_token_ids, out.topk_logprobs)
                reported = (out.sampled_logprobs, out.sampled_ranks, *top)
        flight.tokens = tokens
        self._copy_tokens(flight, tokens, reported)

    def _copy_tokens(
        self, flight: InFlightDecode, tokens: torch.Tensor, reported: tuple = ()
    ) -> None:
        """The sampled tokens' copy to the host, and the logprobs' where a row reports
        them (sampled logprobs, ranks, top ids and logprobs), queued; `flight.result()`
        waits for them."""
        reported = reported or ()
        if self.device.type != "cuda":
            flight._host, flight._reported = tokens, reported
            return
        host = []
        for t in (tokens, *reported):
            host.append(torch.empty(t.shape, dtype=t.dtype, pin_memory=True))
            host[-1].copy_(t, non_blocking=True)
        flight._host, flight._reported = host[0], tuple(host[1:])
        flight._done = torch.cuda.Event()
        flight._done.record()

    def _constrained(self, reqs) -> bool:
        grammar = self.grammar
        return grammar is not None and grammar.constrains([r.request_id for r in reqs])

    def _constrain(self, logits: torch.Tensor, reqs) -> torch.Tensor:
        """The logits with each structured-output row's forbidden tokens at -inf. The
        masks are filled into the reused pinned rows of `MaskStaging` and copied once."""
        grammar = self.grammar
        if grammar is None:
            return logits
        if self._masks is None:
            self._masks = MaskStaging(self.device, grammar.words, self._max_num_seqs)
        n = len(reqs)
        if grammar.bitmask([r.request_id for r in reqs], self._masks.rows(n)) is None:
            return logits
        return apply_token_bitmask(logits, self._masks.upload(n))

    def _forward(
        self,
        sched: SchedulerOutput,
        device_ids: torch.Tensor | None = None,
        graph: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's forward: a graph replay for a pure decode step, else prepare() and
        an eager forward. The step's copies (sched.wait_for) are awaited on the compute
        stream (rule 3): before a graph replay, all of them; in an eager forward, layer by
        layer, so layer i computes while layer i+1's pages load. device_ids [T] replaces
        the input ids (a pipelined step's tokens, still on the device). `graph`: replay or
        not as told (a tensor-parallel worker follows rank 0), None: as `_graph_ok` says.
        Returns the hidden states and the rows to sample from (None: all of them)."""
        if graph is None:
            graph = self._graph_ok(sched)
        elif graph and self.graphs is None:
            raise RuntimeError(
                "told to replay a decode CUDA graph, but this runner has no graphs "
                "(every tensor-parallel rank must build them alike)"
            )
        if graph:
            for copy in sched.wait_for:
                copy.wait_gates()
            with record_function("batchgen.replay"):
                return self._replay(sched, device_ids)
        with record_function("batchgen.prepare"):
            input_ids, positions, meta, sample_rows = self.prepare(sched)
        waits = sched.wait_for
        ctx = ForwardContext(
            meta,
            self.kv_caches,
            self.attention_backend,
            sched.on_kv_written,
            (lambda layer: [c.wait_layer(layer) for c in waits]) if waits else None,
        )
        if self.linear_states is not None:
            ctx.linear_states = self.linear_states
            ctx.linear_metadata = linear_metadata(sched.requests, self.device)
        with record_function("batchgen.forward"), bind_forward_context(ctx):
            hidden = self.model(input_ids if device_ids is None else device_ids, positions)
        return hidden, sample_rows

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._release(sched.released_ids)
        hidden, sample_rows = self._forward(sched)
        prompt = {}
        if wants_prompt_logprobs(sched.requests):
            prompt = prompt_logprobs(self.model, hidden, sched.requests)
        sampled = [r for r in sched.requests if r.sample]
        if not sampled:
            return ModelRunnerOutput([], [], [], prompt)
        if sample_rows is not None and sample_rows.numel() != hidden.shape[0]:
            hidden = hidden[sample_rows]
        logits = self.model.compute_logits(hidden)
        if self.debug:
            self._check_finite(logits, sampled)
        logits = self._constrain(logits, sampled)
        with record_function("batchgen.sample"):
            out = self._sample(logits, sampled)
        out.prompt_logprobs = prompt
        return out

    @torch.inference_mode()
    def execute_unsampled(
        self,
        sched: SchedulerOutput,
        device_ids: torch.Tensor | None = None,
        graph: bool | None = None,
    ) -> None:
        """A tensor-parallel worker's share of `execute` or `launch_decode`: the same
        forward and lm_head calls, so their collectives pair with rank 0's, and nothing
        sampled or read back (rank 0 samples): the worker never waits for its GPU, and is
        ready for rank 0's next step while this one runs. device_ids: a pipelined step's
        input tokens (rank 0's, broadcast); graph: whether rank 0 replays a decode graph
        for this step (None: decide here)."""
        self._release(sched.released_ids)
        hidden, sample_rows = self._forward(sched, device_ids, graph)
        if wants_prompt_logprobs(sched.requests):
            prompt_logprobs(self.model, hidden, sched.requests)
        if not any(r.sample for r in sched.requests):
            return
        if sample_rows is not None and sample_rows.numel() != hidden.shape[0]:
            hidden = hidden[sample_rows]
        self.model.compute_logits(hidden)

    def _sampling(self, reqs, steps: list[int] | None = None) -> SamplingMetadata:
        return SamplingMetadata.build(
            [r.params for r in reqs],
            [r.prompt_token_ids for r in reqs],
            [r.output_token_ids for r in reqs],
            self.vocab_size,
            self.device,
            self.eos_token_ids,
            steps=steps,
            seeds=[r.seed for r in reqs],
            generator=self.sampler.generator,
            penalty_counts=self.penalties,
            request_ids=[r.request_id for r in reqs],
        )

    def _sample(self, logits: torch.Tensor, sampled) -> ModelRunnerOutput:
        if all(_plain_greedy(r.params) for r in sampled):  # argmax is all there is to do
            token_ids = logits.argmax(dim=-1).tolist()
            return ModelRunnerOutput(
                [r.request_id for r in sampled], token_ids, [None] * len(sampled)
            )
        meta = self._sampling(sampled)
        out = self.sampler(logits, meta)
        meta.record(out.sampled_token_ids)
        token_ids = out.sampled_token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(sampled)
        if meta.need_logprobs:
            top = () if out.topk_token_ids is None else (out.topk_token_ids, out.topk_logprobs)
            logprobs = _token_logprobs(sampled, (out.sampled_logprobs, out.sampled_ranks, *top))
        return ModelRunnerOutput([r.request_id for r in sampled], token_ids, logprobs)

    @staticmethod
    def _check_finite(logits: torch.Tensor, sampled) -> None:
        bad = (~torch.isfinite(logits)).any(dim=-1)
        if bool(bad.any()):
            rows = bad.nonzero().flatten().tolist()
            raise FloatingPointError(
                "non-finite logits for request(s) " + ", ".join(sampled[i].request_id for i in rows)
            )


class InFlightDecode:
    """A queued decode step: its batch, sampled tokens on the device and, once `done`
    has passed, on the host. `pending`, until `launch_sample()` runs it, queues the
    step's sampling; `deferred`: it was not queued with the forward (structured-output
    masks waiting for the previous step's tokens)."""

    def __init__(self, sched, sampled=None) -> None:
        self.sched = sched
        # the rows that sample, in the order of `tokens` (a decode step: all of them)
        self.sampled = sched.requests if sampled is None else sampled
        self.tokens = self._host = self._done = None
        self._reported: tuple = ()  # the logprobs' host copies, where a row reports them
        self.pending = None
        self.deferred = False
        # run once the tokens are on the host, before they are used (tensor parallel:
        # raises if a worker ended while the step ran)
        self.check: Callable[[], None] | None = None

    def launch_sample(self) -> None:
        """Queue the step's sampling if it is not queued yet."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending()

    def result(self) -> ModelRunnerOutput:
        """Wait for the step's tokens (not for anything queued after it)."""
        self.launch_sample()
        if self._done is not None:
            self._done.synchronize()
        if self.check is not None:
            self.check()
        reqs = self.sampled
        logprobs = [None] * len(reqs)
        if self._reported:
            logprobs = _token_logprobs(reqs, self._reported)
        return ModelRunnerOutput([r.request_id for r in reqs], self._host.tolist(), logprobs)


def _token_logprobs(reqs, reported: tuple) -> list[TokenLogprobs | None]:
    """Each row's TokenLogprobs (None where it asks for none) from the sampler's
    (sampled logprobs [B], ranks [B], and top ids, top logprobs [B, k] if any asks)."""
    lp, ranks = reported[0].tolist(), reported[1].tolist()
    top_ids = top_lps = None
    if len(reported) > 2:
        top_ids, top_lps = reported[2].tolist(), reported[3].tolist()
    out: list[TokenLogprobs | None] = [None] * len(reqs)
    for i, r in enumerate(reqs):
        k = r.params.logprobs
        if k is None:
            continue
        top = list(zip(top_ids[i][:k], top_lps[i][:k])) if k and top_ids else []
        out[i] = TokenLogprobs(lp[i], ranks[i], top)
    return out


def _sample_steps(reqs) -> list[int]:
    """Each sampling row's output index: its output tokens so far, plus the one in
    flight when its input is a placeholder (seeded noise and min_tokens count it)."""
    return [len(r.output_token_ids) + (r.new_token_ids[-1] == -1) for r in reqs]


def _plain_greedy(params) -> bool:
    """Greedy with nothing that changes or reports the distribution: the sample is the
    argmax of the raw logits (exactly what the full sampler picks for such a row)."""
    return (
        params.temperature < SAMPLING_EPS
        and params.logprobs is None
        and params.min_tokens == 0
        and not params.has_penalties
    )

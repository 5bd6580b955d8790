"""The model runner: turns a SchedulerOutput into one packed forward and a sample."""

from __future__ import annotations

import numpy as np
import torch

from batchgen.forward_context import AttentionMetadata, ForwardContext, bind_forward_context
from batchgen.runner.batch import (
    NO_COPIES,
    ModelRunnerOutput,
    SchedulerOutput,
    StepCopies,
    TokenLogprobs,
)
from batchgen.runner.cuda_graphs import DecodeGraphs, DecodeSplitPlan
from batchgen.runner.graph_sampling import graph_tail
from batchgen.runner.in_flight import InFlightDecode, sample_steps, token_logprobs
from batchgen.runner.input_batch import InputBatch, StepRow, decode_columns, entries_of, request_ids
from batchgen.runner.inputs import pack_step, pipelined_ids, table_width
from batchgen.runner.linear_state import linear_metadata
from batchgen.runner.mask_staging import MaskStaging
from batchgen.runner.paired import Pairing, paired_forward
from batchgen.runner.penalty_counts import PenaltyCounts
from batchgen.runner.prompt_logprobs import prompt_logprobs, wants_prompt_logprobs
from batchgen.runner.sampler import (
    Sampler,
    SamplingMetadata,
    SamplingState,
    apply_token_bitmask,
    check_finite,
    warm_kernels,
)
from batchgen.runner.staging import HostStaging
from batchgen.runner.step_columns import plain_greedy
from batchgen.runner.step_mode import profiled, step_mode


class ModelRunner:
    """Owns no policy: it computes exactly the tokens it is given and samples where told.

    It keeps its own record of the running requests (`batch`, an `InputBatch`: each
    one's page row and fixed data), updated from each step's diffs (`ScheduledRequest.
    new`, `new_pages`, `SchedulerOutput.released_ids`). The KV tensors belong to the page pool; the runner binds the per-layer views into
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
        grammar=None,
        deterministic: bool = False,
        pairing: Pairing | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.linear_states = linear_states
        self.page_size = page_size
        self.device = device
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.debug = debug
        self.deterministic = deterministic  # batch-invariant layers (step_mode)
        self.pairing = pairing  # an attention data-parallel rank's rounds (paired.py)
        self.attention_backend = attention_backend
        self.graphs = graphs
        self.split_plan = split_plan
        # rows without a seed get one drawn from this generator (the engine seeds every
        # request); the noise itself is a hash of (seed, step, token) on the device
        self.sampler = Sampler(torch.Generator().manual_seed(seed))
        # penalised requests' token counts, kept on the device from step to step
        self.penalties = PenaltyCounts(vocab_size, device)
        # each running request's sampling parameters and seed, read once and kept by id
        self.sampling = SamplingState(
            vocab_size, device, eos_token_ids, self.sampler.generator, self.penalties
        )
        self.batch = InputBatch(max_num_seqs, max_pages)
        self.stage = HostStaging(device)
        # structured outputs: the engine's StructuredOutputs (engine/structured.py), if any
        self.grammar = grammar
        self._masks: MaskStaging | None = None  # their bitmask rows, built with it
        self._max_num_seqs = max_num_seqs

    def apply(self, sched: SchedulerOutput) -> list[StepRow]:
        """Take the step's diffs into the runner's own record (every entry point does,
        once a step); its requests, resolved."""
        self.penalties.release(sched.released_ids)
        self.sampling.release(sched.released_ids)
        return self.batch.apply(sched)

    def prepare(
        self, rows: list[StepRow]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The step's packed input ids, positions, attention metadata and the rows to
        sample from (inputs.pack_step)."""
        table = self.batch.page_rows.table
        return pack_step(rows, table, self.page_size, self.stage, self.split_plan)

    def set_kv_caches(self, kv_caches: list[tuple[torch.Tensor, ...]]) -> None:
        """Point at a re-created pool; captured graphs baked the old one in."""
        self.kv_caches = kv_caches
        self.batch.reset()
        if self.graphs is not None:
            self.graphs.kv_caches = kv_caches
            self.graphs.clear()

    def _graph_ok(self, sched: SchedulerOutput, copies: StepCopies = NO_COPIES) -> bool:
        return (
            self.graphs is not None
            and copies.on_kv_written is None
            and len(sched.requests) <= self.graphs.max_bs
            and (sched.blind or all(len(r.new_token_ids) == 1 for r in sched.requests))
        )

    def _replay(
        self, reqs: list[StepRow], device_ids: torch.Tensor | None, tail, bucket: int | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ps = self.page_size
        n = len(reqs)
        rows, starts, samples = decode_columns(reqs)  # a StepRows' columns
        reqs = entries_of(reqs)  # no StepRow a row
        if device_ids is None:
            ids = np.fromiter((r.new_token_ids[0] for r in reqs), np.int64, n)
        else:
            ids = np.zeros(n, dtype=np.int64)
        table = self.batch.page_rows.table
        slots = table[rows, starts // ps] * ps + starts % ps
        width = table_width(int(starts.max()) // ps + 1, table.shape[1])
        state_slots = None
        if self.linear_states is not None:
            state_slots = np.fromiter((r.state_slot for r in reqs), np.int64, n)
        inputs = (ids, starts, slots, table[rows, :width], self.stage, device_ids, state_slots)
        hidden = self.graphs.run(*inputs, tail, bucket)
        if samples.all():
            return hidden, None
        keep = np.flatnonzero(samples)
        return hidden, self.stage(keep)  # pinned staging: a blocking upload would sync

    @torch.inference_mode()
    def warm_logits(self, rows: int, hidden_size: int, dtype: torch.dtype) -> None:
        """On a GPU, the logits GEMM and greedy pick once for every row count 1..rows a
        step may sample. cuBLAS chooses its kernel by the row count, and under CUDA's
        lazy module loading the first launch of a kernel not loaded yet waits for the
        GPU to drain: in W6's decode tail that blocked six pipelined launches for
        15-29 ms each. Build time pays the loads instead, and the sampler's Triton compiles
        (`sampler.warm_kernels`). local_logits has no tensor-parallel gather: ranks warm alone."""
        if self.device.type != "cuda":
            return
        hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=self.device)
        for m in range(1, rows + 1):
            self.model.local_logits(hidden[:m]).argmax(dim=-1)
        warm_kernels(self.sampler, self.vocab_size, dtype, self.device)

    def can_launch_decode(self, sched: SchedulerOutput, copies: StepCopies = NO_COPIES) -> bool:
        """Whether `launch_decode` takes this step: a decode step (graph-replayed when
        graphs are on) whose every request samples (greedy or not, seeded or not,
        min_tokens, penalties and logprobs allowed: penalty counts are kept on the
        device, logprobs copied to the host with the tokens)."""
        reqs = sched.requests
        return (
            not self.debug
            and copies.on_kv_written is None
            and (self.graphs is None or len(reqs) <= self.graphs.max_bs)
            and (sched.blind or all(len(r.new_token_ids) == 1 and r.sample for r in reqs))
        )

    @step_mode
    def launch_decode(
        self,
        sched: SchedulerOutput,
        prev: InFlightDecode | None = None,
        copies: StepCopies = NO_COPIES,
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
        reqs = self.apply(sched)
        device_ids = None if prev is None else self._pipelined_ids(reqs, prev)
        steps = sample_steps(reqs)  # every row samples (can_launch_decode)
        flight = InFlightDecode(sched, reqs)
        # sampled inside the decode graph where the step allows it (graph_sampling)
        tail = graph_tail(self, flight, steps) if self._graph_ok(sched, copies) else None
        hidden, _ = self._forward(sched, reqs, copies, device_ids, tail=tail)
        if tail is not None:
            tail.finish(flight)
            return flight
        logits = self.model.compute_logits(hidden)
        flight.pending = lambda: self._launch_sample(flight, logits, steps)
        flight.deferred = prev is not None and self._constrained(reqs)
        if not flight.deferred:
            flight.launch_sample()
        return flight

    @step_mode
    def launch_step(
        self,
        sched: SchedulerOutput,
        prev: InFlightDecode | None = None,
        copies: StepCopies = NO_COPIES,
    ) -> InFlightDecode:
        """Queue any step (async scheduling): its forward, the sampling of its rows that
        sample, and their tokens' copy to the host, without waiting. The engine sends
        only steps with no debug check, per-layer append, structured output or prompt
        logprobs (engine.step_loop.needs_sync and its configuration checks). A row whose last
        input token is -1 reads it from what `prev` samples for its request, on the
        device. A decode step that graphs can take goes through `launch_decode`."""
        if self._graph_ok(sched, copies) and (sched.blind or all(r.sample for r in sched.requests)):
            return self.launch_decode(sched, prev, copies)
        reqs = self.apply(sched)
        device_ids = None if prev is None else self._pipelined_ids(reqs, prev)
        hidden, sample_rows = self._forward(sched, reqs, copies, device_ids)
        sampled = reqs.sampled()  # a StepRows: its columns, no StepRow a row
        flight = InFlightDecode(sched, sampled)
        if not sampled:
            flight.tokens = torch.empty(0, dtype=torch.int64, device=self.device)
            flight.copy_tokens(flight.tokens)
            return flight
        if sample_rows is not None and sample_rows.numel() != hidden.shape[0]:
            hidden = hidden[sample_rows]
        logits = self.model.compute_logits(hidden)
        steps = sample_steps(sampled)
        flight.pending = lambda: self._launch_sample(flight, logits, steps)
        flight.launch_sample()
        return flight

    def _pipelined_ids(self, reqs: list[StepRow], prev: InFlightDecode) -> torch.Tensor:
        return pipelined_ids(reqs, prev, self.stage)

    @step_mode
    def _launch_sample(self, flight: InFlightDecode, logits: torch.Tensor, steps) -> None:
        reqs = flight.sampled
        logits = self._constrain(logits, reqs)
        reported = None
        if flight.plain_greedy():
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
        flight.copy_tokens(tokens, reported)

    def _constrained(self, reqs) -> bool:
        grammar = self.grammar
        return grammar is not None and grammar.constrains(request_ids(reqs))

    def _constrain(self, logits: torch.Tensor, reqs) -> torch.Tensor:
        """The logits with each structured-output row's forbidden tokens at -inf. The
        masks are filled into the reused pinned rows of `MaskStaging` and copied once."""
        grammar = self.grammar
        if grammar is None or not grammar.following:  # no request constrained now
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
        reqs: list[StepRow],
        copies: StepCopies,
        device_ids: torch.Tensor | None = None,
        graph: bool | None = None,
        tail=None,
        bucket: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's forward: a graph replay for a pure decode step, else the packed
        inputs and an eager forward. The step's copies (copies.wait_for) are awaited on
        the compute stream (rule 3): before a graph replay, all of them; in an eager
        forward, layer by layer, so layer i computes while layer i+1's pages load.
        device_ids [T] replaces the input ids (a pipelined step's tokens, still on the
        device). `graph`: replay or not as told (a tensor-parallel worker follows rank
        0), None: as `_graph_ok` says (with `pairing`, as the ranks agree: paired.py);
        `tail`: a replay's `graph_sampling.GraphTail`; `bucket`: the graph size it replays
        (the ranks' agreed one), None: its batch's. Returns the hidden states and the rows
        to sample from (None: all of them)."""
        if graph is None and self.pairing is not None:
            return paired_forward(self, sched, reqs, copies, device_ids)
        if graph is None:
            graph = self._graph_ok(sched, copies)
        elif graph and self.graphs is None:
            raise RuntimeError(
                "told to replay a decode CUDA graph, but this runner has no graphs "
                "(every tensor-parallel rank must build them alike)"
            )
        waits = copies.wait_for
        if graph:
            for copy in waits:
                copy.wait_gates()
            with profiled("batchgen.replay"):
                return self._replay(reqs, device_ids, tail, bucket)
        with profiled("batchgen.prepare"):
            input_ids, positions, meta, sample_rows = self.prepare(reqs)
        ctx = ForwardContext(
            meta,
            self.kv_caches,
            self.attention_backend,
            copies.on_kv_written,
            (lambda layer: [c.wait_layer(layer) for c in waits]) if waits else None,
        )
        if self.linear_states is not None:
            ctx.linear_states = self.linear_states
            ctx.linear_metadata = linear_metadata(reqs, self.device)
        with profiled("batchgen.forward"), bind_forward_context(ctx):
            hidden = self.model(input_ids if device_ids is None else device_ids, positions)
        return hidden, sample_rows

    @step_mode
    def execute(self, sched: SchedulerOutput, copies: StepCopies = NO_COPIES) -> ModelRunnerOutput:
        reqs = self.apply(sched)
        hidden, sample_rows = self._forward(sched, reqs, copies)
        prompt = {}
        if wants_prompt_logprobs(reqs):
            prompt = prompt_logprobs(self.model, hidden, reqs)
        sampled = [r for r in reqs if r.sample]
        if not sampled:
            return ModelRunnerOutput([], [], [], prompt)
        if sample_rows is not None and sample_rows.numel() != hidden.shape[0]:
            hidden = hidden[sample_rows]
        logits = self.model.compute_logits(hidden)
        if self.debug:
            check_finite(logits, sampled)
        logits = self._constrain(logits, sampled)
        with profiled("batchgen.sample"):
            out = self._sample(logits, sampled)
        out.prompt_logprobs = prompt
        return out

    @step_mode
    def execute_unsampled(
        self,
        sched: SchedulerOutput,
        copies: StepCopies = NO_COPIES,
        device_ids: torch.Tensor | None = None,
        graph: bool | None = None,
    ) -> None:
        """A tensor-parallel worker's share of `execute` or `launch_decode`: the same
        forward and lm_head calls, so their collectives pair with rank 0's, and nothing
        sampled or read back (rank 0 samples): the worker never waits for its GPU, and is
        ready for rank 0's next step while this one runs. copies: this rank's copies for
        the step; device_ids: a pipelined step's input tokens (rank 0's, broadcast);
        graph: whether rank 0 replays a decode graph for this step (None: decide here)."""
        reqs = self.apply(sched)
        hidden, sample_rows = self._forward(sched, reqs, copies, device_ids, graph)
        if wants_prompt_logprobs(reqs):
            prompt_logprobs(self.model, hidden, reqs)
        if not any(r.sample for r in reqs):
            return
        if sample_rows is not None and sample_rows.numel() != hidden.shape[0]:
            hidden = hidden[sample_rows]
        self.model.compute_logits(hidden)

    def _sampling(self, reqs: list[StepRow], steps: list[int]) -> SamplingMetadata:
        return self.sampling.build_for(reqs, steps)

    def _sample(self, logits: torch.Tensor, sampled: list[StepRow]) -> ModelRunnerOutput:
        if all(plain_greedy(r.params) for r in sampled):  # argmax is all there is to do
            token_ids = logits.argmax(dim=-1).tolist()
            return ModelRunnerOutput(
                [r.request_id for r in sampled], token_ids, [None] * len(sampled)
            )
        meta = self._sampling(sampled, [r.num_output_tokens for r in sampled])
        out = self.sampler(logits, meta)
        meta.record(out.sampled_token_ids)
        token_ids = out.sampled_token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(sampled)
        if meta.need_logprobs:
            top = () if out.topk_token_ids is None else (out.topk_token_ids, out.topk_logprobs)
            logprobs = token_logprobs(sampled, (out.sampled_logprobs, out.sampled_ranks, *top))
        return ModelRunnerOutput([r.request_id for r in sampled], token_ids, logprobs)

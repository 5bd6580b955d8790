"""The model runner: turns a SchedulerOutput into one packed forward and a sample."""

from __future__ import annotations

import torch
from torch.profiler import record_function

from batchgen.forward_context import (
    AttentionMetadata,
    ForwardContext,
    PrefillSeq,
    bind_forward_context,
)
from batchgen.runner.batch import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from batchgen.runner.cuda_graphs import DecodeGraphs, DecodeSplitPlan
from batchgen.runner.sampler import Sampler, SamplingMetadata


class ModelRunner:
    """Owns no policy: it computes exactly the tokens it is given and samples where told.

    The KV tensors belong to the page pool; the runner binds the per-layer views into
    the ForwardContext for each forward.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        page_size: int,
        device: torch.device,
        vocab_size: int,
        eos_token_ids: list[int],
        debug: bool = False,
        attention_backend: str = "torch",
        graphs: DecodeGraphs | None = None,
        split_plan: DecodeSplitPlan | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.page_size = page_size
        self.device = device
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.debug = debug
        self.attention_backend = attention_backend
        self.graphs = graphs
        self.split_plan = split_plan
        self.sampler = Sampler()

    def _to_device(self, values: list[int]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.int64)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def prepare(
        self, sched: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Packed input ids, positions, attention metadata and the rows to sample from."""
        ps = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefill_specs: list[tuple[int, int, int, list[int]]] = []
        sample_rows: list[int] = []
        row = 0
        for r in sched.requests:
            n = len(r.new_token_ids)
            seq_len = r.start + n
            ids += r.new_token_ids
            positions += range(r.start, seq_len)
            table = r.page_table
            slots += [table[p // ps] * ps + p % ps for p in range(r.start, seq_len)]
            pages = table[: -(-seq_len // ps)]
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(pages)
                decode_lens.append(seq_len)
            else:
                prefill_specs.append((row, n, seq_len, pages))
            if r.sample:
                sample_rows.append(row + n - 1)
            row += n
        meta = AttentionMetadata(num_tokens=row, slot_mapping=self._to_device(slots))
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            flat = [p for t in decode_tables for p in t + [0] * (width - len(t))]
            meta.decode_rows = self._to_device(decode_rows)
            meta.decode_page_table = self._to_device(flat).view(len(decode_rows), width)
            meta.decode_seq_lens = self._to_device(decode_lens)
            meta.decode_max_seq_len = max(decode_lens)
            if self.split_plan is not None:
                meta.decode_num_splits = self.split_plan(len(decode_rows))
        if prefill_specs:
            width = max(len(spec[3]) for spec in prefill_specs)
            flat = [p for spec in prefill_specs for p in spec[3] + [0] * (width - len(spec[3]))]
            meta.prefill_q_start = self._to_device([spec[0] for spec in prefill_specs])
            meta.prefill_q_len = self._to_device([spec[1] for spec in prefill_specs])
            meta.prefill_seq_lens = self._to_device([spec[2] for spec in prefill_specs])
            meta.prefill_page_table = self._to_device(flat).view(len(prefill_specs), width)
            meta.prefill_max_q_len = max(spec[1] for spec in prefill_specs)
            meta.prefills = [  # the reference backend's per-request view of the same table
                PrefillSeq(q_start, q_len, seq_len, meta.prefill_page_table[i, : len(pages)])
                for i, (q_start, q_len, seq_len, pages) in enumerate(prefill_specs)
            ]
        return self._to_device(ids), self._to_device(positions), meta, sample_rows

    def set_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Point at a re-created pool; captured graphs baked the old one in."""
        self.kv_caches = kv_caches
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

    def _replay(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        ps = self.page_size
        reqs = sched.requests
        slots = [r.page_table[r.start // ps] * ps + r.start % ps for r in reqs]
        tables = [r.page_table[: r.start // ps + 1] for r in reqs]
        hidden = self.graphs.run(
            [r.new_token_ids[0] for r in reqs], [r.start for r in reqs], slots, tables
        )
        return hidden, [i for i, r in enumerate(reqs) if r.sample]

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        graph = self._graph_ok(sched)
        if not graph:
            with record_function("batchgen.prepare"):
                input_ids, positions, meta, sample_rows = self.prepare(sched)
        for load in sched.wait_for:  # rule 3: compute reads loaded pages only after the copy
            load.wait_on_current_stream()
        if graph:
            with record_function("batchgen.replay"):
                hidden, sample_rows = self._replay(sched)
        else:
            with (
                record_function("batchgen.forward"),
                bind_forward_context(
                    ForwardContext(
                        meta, self.kv_caches, self.attention_backend, sched.on_kv_written
                    )
                ),
            ):
                hidden = self.model(input_ids, positions)
        sampled = [r for r in sched.requests if r.sample]
        if not sampled:
            return ModelRunnerOutput([], [], [])
        logits = self.model.compute_logits(hidden[sample_rows]).float()
        if self.debug:
            self._check_finite(logits, sampled)
        with record_function("batchgen.sample"):
            return self._sample(logits, sampled)

    def _sample(self, logits: torch.Tensor, sampled) -> ModelRunnerOutput:
        smeta = SamplingMetadata.build(
            [r.params for r in sampled],
            [r.prompt_token_ids for r in sampled],
            [r.output_token_ids for r in sampled],
            self.vocab_size,
            self.device,
            self.eos_token_ids,
        )
        out = self.sampler(logits, smeta)
        token_ids = out.sampled_token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(sampled)
        if any(r.params.logprobs is not None for r in sampled):
            lp = out.sampled_logprobs.tolist()
            ranks = out.sampled_ranks.tolist()
            top_ids = out.topk_token_ids.tolist() if out.topk_token_ids is not None else None
            top_lps = out.topk_logprobs.tolist() if out.topk_logprobs is not None else None
            for i, r in enumerate(sampled):
                k = r.params.logprobs
                if k is None:
                    continue
                top = list(zip(top_ids[i][:k], top_lps[i][:k])) if k and top_ids else []
                logprobs[i] = TokenLogprobs(lp[i], ranks[i], top)
        return ModelRunnerOutput([r.request_id for r in sampled], token_ids, logprobs)

    @staticmethod
    def _check_finite(logits: torch.Tensor, sampled) -> None:
        bad = (~torch.isfinite(logits)).any(dim=-1)
        if bool(bad.any()):
            rows = bad.nonzero().flatten().tolist()
            raise FloatingPointError(
                "non-finite logits for request(s) " + ", ".join(sampled[i].request_id for i in rows)
            )

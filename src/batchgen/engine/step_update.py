"""What a step's results do to its requests: `Scheduler.update` and its two halves,
`commit` (the counters a launched step advances before its tokens are known) and `apply`
(its tokens appended, full pages cached, token-level stops).

    update(step) = commit(step) + apply(step)      a step nobody committed: one pass each
                   (commit at launch: async)       `_advance` (counters, pages cached)
                                                   and `_append` (tokens, stops); a
                                                   blind decode step: one pass for both

Each runs once a step over every row of the step, so each is one loop with its names
bound before it (a full decode step has ~900 rows); a step whose entries the scheduler's
feed made reads its rows' requests from there (`RunnerFeed.requests_of`), not each by id.
A request that left the engine is finished, so either way a finished one is skipped. The
rows a step finishes are finished after its pass, in row order (the pages its rows fill
registered first)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from batchgen.engine.request import Request, RequestStatus
from batchgen.engine.runner_feed import RunnerFeed
from batchgen.kv.kv_manager import KVCacheManager
from batchgen.runner.batch import ModelRunnerOutput, SchedulerOutput, row_fields


class StepUpdates:
    """The scheduler's half that takes a step's results (engine/scheduler.py's
    `Scheduler` is one): it reads `kv`, `eos_token_ids` (a set), `stop_token_union`
    (every stop_token_ids of a request added, a superset of the running ones'),
    `max_model_len` and `finish(req, reason, stop_reason)`, `feed` (its steps'
    requests), and keeps `_committed` (steps committed and not applied, oldest first,
    with what each counted), `num_computed_tokens_total` and
    `num_prompt_tokens_computed`."""

    kv: KVCacheManager
    feed: RunnerFeed
    eos_token_ids: set[int]
    stop_token_union: set[int]
    max_model_len: int
    _committed: deque[tuple[SchedulerOutput, dict[str, int]]]
    num_computed_tokens_total: int
    num_prompt_tokens_computed: int
    finish: Callable[..., None]

    def update(
        self, sched: SchedulerOutput, result: ModelRunnerOutput, requests: dict[str, Request]
    ) -> list[Request]:
        """Advance counters (unless `commit` did at the step's launch), append sampled
        tokens, finish on token-level stops. Returns the requests that got a new token
        this step."""
        if self.is_committed(sched):
            return self.apply(sched, result, requests)
        reqs = self.feed.requests_of(sched)
        sampled = self._sampled(sched, result, reqs)
        # its rows' counters beside their tokens; with the host tier active a page's
        # check wants every hash of the tokens known, so it keeps its own pass first
        if sched.blind and sampled is not None and not self.kv.tier_active:
            return self._append(result, requests, sampled, advance=True)
        self._advance(sched, requests, reqs)  # commit and apply's counters in one pass
        return self._append(result, requests, sampled)

    @staticmethod
    def _sampled(
        sched: SchedulerOutput, result: ModelRunnerOutput, reqs: list[Request] | None
    ) -> list[Request] | None:
        """The requests of `result`'s rows where they are `reqs`, those of every row of
        `sched` (a step whose every row samples), else None."""
        if reqs is None or len(reqs) != len(result.request_ids):
            return None
        if result.step_entries is sched.requests:  # its rows are the step's, in order
            return reqs
        ids = result.request_ids
        return reqs if ids == [s.request_id for s in sched.requests] else None

    def is_committed(self, sched: SchedulerOutput) -> bool:
        """`commit` has counted the step and `apply` has not taken its tokens yet."""
        return any(step is sched for step, _ in self._committed)

    def commit(self, sched: SchedulerOutput, requests: dict[str, Request]) -> None:
        """The step's effects that need none of its tokens (computed counters, a token
        pending per sampling row). Async scheduling commits a step at its launch, to
        schedule the next while it runs; `apply` follows once its tokens are on the host."""
        committed: dict[str, int] = {}
        self._committed.append((sched, committed))
        get, finished = requests.get, RequestStatus.FINISHED
        computed = prompt_computed = 0
        for rid, n, sample, start in row_fields(sched.requests):
            req = get(rid)
            if req is None or req.status is finished:  # stopped, a pipelined step queued
                continue
            committed[rid] = n
            req.num_computed_tokens += n
            req.num_pending += sample
            computed += n
            prompt = req.num_prompt_tokens
            if start < prompt:
                prompt_computed += min(n, prompt - start)
        self.num_computed_tokens_total += computed
        self.num_prompt_tokens_computed += prompt_computed

    def _take_committed(self, sched: SchedulerOutput) -> dict[str, int]:
        """What commit counted for `sched`; older commits never applied (a queued step
        dropped by abort) go with it."""
        for i, (step, committed) in enumerate(self._committed):
            if step is sched:
                for _ in range(i + 1):
                    self._committed.popleft()
                return committed
        raise RuntimeError("Scheduler.apply: the step was never committed")

    def apply(
        self, sched: SchedulerOutput, result: ModelRunnerOutput, requests: dict[str, Request]
    ) -> list[Request]:
        """The committed step's tokens: full pages cached, tokens appended, token-level
        stops (a request that ended after the commit takes back what the step computed
        for it). Returns the requests that got a new token."""
        committed = self._take_committed(sched)
        get, cached = requests.get, []
        finished, running = RequestStatus.FINISHED, RequestStatus.RUNNING
        for rid, _, sample, start in row_fields(sched.requests):
            n = committed.get(rid)
            req = get(rid)
            if n is None or req is None:
                continue
            req.num_pending -= sample
            if req.status is finished:  # its queued extra token is discarded
                self.num_computed_tokens_total -= n
                prompt = req.num_prompt_tokens
                if start < prompt:
                    self.num_prompt_tokens_computed -= min(n, prompt - start)
            elif req.status is running:
                cached.append(req)
        self.kv.cache_computed_for(cached)
        return self._append(
            result, requests, self._sampled(sched, result, self.feed.requests_of(sched))
        )

    def _advance(
        self,
        sched: SchedulerOutput,
        requests: dict[str, Request],
        reqs: list[Request] | None = None,
    ) -> None:
        """`commit` and `apply`'s first pass in one loop, for a step nobody committed
        (`reqs`: its rows' requests, if known; else looked up in `requests`)."""
        running, finished, cached = RequestStatus.RUNNING, RequestStatus.FINISHED, []
        if reqs is None:
            get = requests.get
            reqs = [get(s.request_id) for s in sched.requests]
        computed = prompt_computed = 0
        if sched.blind:  # one token a row, past its prompt: its entries need not be read
            # a row checked at its last step fills a page now only if its count reaches
            # the page's end or it was behind (KVCacheManager.behind): only those checked
            ps, behind = self.kv.page_size, self.kv.behind
            for req in reqs:
                if req is None or req.status is finished:  # stopped, step queued
                    continue
                req.num_computed_tokens += 1
                computed += 1
                if req.status is running and (
                    not req.num_computed_tokens % ps or (behind and req.request_id in behind)
                ):
                    cached.append(req)
        else:
            for s, req in zip(sched.requests, reqs):  # enum members looked up once, not a row
                if req is None or req.status is finished:  # stopped, step queued
                    continue
                n = len(s.new_token_ids)
                req.num_computed_tokens += n
                computed += n
                prompt = req.num_prompt_tokens
                if s.start < prompt:
                    prompt_computed += min(n, prompt - s.start)
                if req.status is running:
                    cached.append(req)
        self.kv.cache_computed_for(cached)  # full pages, after every row's counters
        self.num_computed_tokens_total += computed
        self.num_prompt_tokens_computed += prompt_computed

    def _append(
        self,
        result: ModelRunnerOutput,
        requests: dict[str, Request],
        reqs: list[Request] | None = None,
        advance: bool = False,
    ) -> list[Request]:
        """Append the step's tokens; stop on EOS, stop_token_ids or length (`reqs`: the
        requests of its rows, if known; else looked up in `requests`). `advance`: the
        step is a blind decode step nobody committed, `reqs` every row's request, and
        `_advance`'s counters are taken in the same pass (the pages checked then see
        the step's tokens appended: the same pages registered, a page's hash known a
        step earlier, so not with the host tier active, whose check wants every known
        hash); either way the pages they fill are registered, and the step's stores
        submitted, before any row finishes."""
        advanced, ends, cached = [], [], []
        finished, running, eos = RequestStatus.FINISHED, RequestStatus.RUNNING, self.eos_token_ids
        # a token outside every stop set ends no row by stop: most rows' one check
        stopping = eos | self.stop_token_union if self.stop_token_union else eos
        max_model_len = self.max_model_len
        if reqs is None:
            get = requests.get
            reqs = [get(rid) for rid in result.request_ids]
        ps, behind = self.kv.page_size, self.kv.behind
        for req, token, lp in zip(reqs, result.sampled_token_ids, result.logprobs):
            if req is None or req.status is finished:
                continue
            if advance:  # `_advance`'s blind branch, this row's part
                req.num_computed_tokens += 1
                if req.status is running and (
                    not req.num_computed_tokens % ps or (behind and req.request_id in behind)
                ):
                    cached.append(req)
            out, ids = req.output_token_ids, req.token_ids
            out.append(token)
            ids.append(token)
            if lp is not None:
                req.logprobs.append(lp)
            advanced.append(req)
            if token in stopping and len(out) >= req.min_tokens:
                if token in eos and req.stops_on_eos:
                    ends.append((req, "stop", None))
                    continue
                stops = req.stop_token_ids
                if stops is not None and token in stops:
                    ends.append((req, "stop", token))
                    continue
            if len(out) >= req.max_tokens or len(ids) >= max_model_len:
                ends.append((req, "length", None))
        if advance:
            self.kv.cache_computed_for(cached)
            self.num_computed_tokens_total += len(advanced)  # one token a row
        self.kv.after_step()
        for rid, entries in result.prompt_logprobs.items():
            if rid in requests:
                requests[rid].prompt_logprobs.update(entries)
        for req, reason, stop_reason in ends:  # in row order, as each was found
            self.finish(req, reason, stop_reason)
        return advanced

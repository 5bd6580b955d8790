"""A queued step whose tokens are still on their way to the host, and the per-row
helpers its sampling shares with the runner."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from batchgen.runner.batch import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from batchgen.runner.input_batch import StepRows, request_ids
from batchgen.runner.step_columns import plain_greedy


class InFlightDecode:
    """A queued decode step: its batch, sampled tokens on the device and, once `done`
    has passed, on the host. `pending`, until `launch_sample()` runs it, queues the
    step's sampling; `deferred`: it was not queued with the forward (structured-output
    masks waiting for the previous step's tokens)."""

    def __init__(self, sched: SchedulerOutput, sampled) -> None:
        self.sched = sched
        # the rows that sample (StepRow), in the order of `tokens`
        self.sampled = sampled
        self.tokens = self._host = self._done = None
        self._reported: tuple = ()  # the logprobs' host copies, where a row reports them
        self.pending = None
        self.deferred = False
        self._greedy: bool | None = None
        # run once the tokens are on the host, before they are used (tensor parallel:
        # raises if a worker ended while the step ran)
        self.check: Callable[[], None] | None = None

    def copy_tokens(self, tokens: torch.Tensor, reported: tuple | None = ()) -> None:
        """Queue the sampled tokens' copy to the host, and the logprobs' where a row
        reports them (sampled logprobs, ranks, top ids and logprobs); `result()` waits
        for them."""
        reported = reported or ()
        if tokens.device.type != "cuda":
            self._host, self._reported = tokens, reported
            return
        host = []
        for t in (tokens, *reported):
            host.append(torch.empty(t.shape, dtype=t.dtype, pin_memory=True))
            host[-1].copy_(t, non_blocking=True)
        self._host, self._reported = host[0], tuple(host[1:])
        self._done = torch.cuda.Event()
        self._done.record()

    def plain_greedy(self) -> bool:
        """Whether every sampled row is plain greedy (its sampling an argmax of the raw
        logits): a `StepRows`' from the flags its step took (`StepRows.plain_greedy`: no
        row's params read), other rows' from their params."""
        if self._greedy is None:
            rows = self.sampled
            if isinstance(rows, StepRows):
                self._greedy = rows.plain_greedy()
            else:
                self._greedy = all(plain_greedy(r.params) for r in rows)
        return self._greedy

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
            logprobs = token_logprobs(reqs, self._reported)
        out = ModelRunnerOutput(request_ids(reqs), self._host.tolist(), logprobs)
        if isinstance(reqs, StepRows) and reqs.entries is self.sched.requests:
            out.step_entries = reqs.entries  # every row of the step sampled (launch_decode)
        return out


def token_logprobs(reqs, reported: tuple) -> list[TokenLogprobs | None]:
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


def sample_steps(reqs) -> np.ndarray:
    """Each sampling row's output index, [n] int64: its output tokens on the host, plus
    the one in flight when its input is a placeholder (seeded noise and min_tokens count
    it); a `StepRows`' from its columns (`StepRows.steps`)."""
    if isinstance(reqs, StepRows):
        return reqs.steps()
    steps = (r.num_output_tokens + (r.new_token_ids[-1] == -1) for r in reqs)
    return np.fromiter(steps, np.int64, len(reqs))

"""The batchgen side of an evaluation: prompts through an EngineCore, logprobs back.

The engine reports, per sampled position, the raw logprob of the sampled token and of
the k most likely tokens (k <= TOP_K, SamplingParams' limit); it does not report prompt
logprobs. So the log-likelihood of a given continuation is read position by position,
one max_tokens=1 request per prefix (prompt + cont[:j]); the shared prefixes hit the
prefix cache, so each extra request computes only its last page or so. A token outside
the top-k has no reported logprob: callers treat it as censored (see mc.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from batchgen.console import progress_enabled
from batchgen.engine.engine_core import EngineCore
from batchgen.engine.request import Request
from batchgen.sampling_params import SamplingParams

TOP_K = 20  # the most logprobs one position reports (SamplingParams.logprobs <= 20)

_request_ids = itertools.count()


@dataclass
class Position:
    """One next-token distribution, reduced to what scoring reads.

    top: the k most likely tokens' raw logprobs. exact: exact raw logprobs of the tokens
    the caller asked about, where the side knows them (batchgen: those inside `top`;
    transformers: all of them).
    """

    top: dict[int, float]
    exact: dict[int, float]


@dataclass
class Query:
    """Distributions wanted after prompt + cont[:j], for j in range(len(asked)).

    asked[j] lists the tokens whose exact logprob position j should report. Letter
    scoring asks one position (cont empty); full-choice scoring asks one per cont token.
    """

    prompt: list[int]
    cont: list[int]
    asked: list[list[int]]

    def __post_init__(self) -> None:
        if not self.asked or len(self.asked) > len(self.cont) + 1:
            raise ValueError("a query asks for 1 to len(cont) + 1 positions")


@dataclass
class GreedyRun:
    """A greedy completion: the tokens and each one's raw logprob."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str | None


class EngineScorer:
    """Runs evaluation prompts through an idle EngineCore (e.g. `LLM(...).engine`)."""

    def __init__(self, engine: EngineCore, top_k: int = TOP_K, progress: bool = False) -> None:
        if not 1 <= top_k <= TOP_K:
            raise ValueError(f"top_k must be in [1, {TOP_K}], got {top_k}")
        self.engine = engine
        self.top_k = top_k
        self.progress = progress

    def positions(self, queries: list[Query], desc: str = "batchgen") -> list[list[Position]]:
        """For each query, its asked positions, in order."""
        prompts, owners = [], []
        for qi, q in enumerate(queries):
            for j in range(len(q.asked)):
                prompts.append(q.prompt + q.cont[:j])
                owners.append((qi, j))
        params = SamplingParams(temperature=0, max_tokens=1, logprobs=self.top_k, ignore_eos=True)
        reqs = self.run(prompts, params, desc)
        out: list[list[Position]] = [[] for _ in queries]
        for (qi, j), req in zip(owners, reqs):
            lp = req.logprobs[0]
            top = dict(lp.top)
            top.setdefault(req.output_token_ids[0], lp.sampled_logprob)
            asked = queries[qi].asked[j]
            out[qi].append(Position(top, {t: top[t] for t in asked if t in top}))
        return out

    def greedy(
        self, prompts: list[list[int]], max_tokens: int, desc: str = "batchgen"
    ) -> list[GreedyRun]:
        """Greedy completions (stopping at EOS or max_tokens) with each token's logprob."""
        params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0)
        return [
            GreedyRun(
                list(r.output_token_ids), [lp.sampled_logprob for lp in r.logprobs], r.finish_reason
            )
            for r in self.run(prompts, params, desc)
        ]

    def run(self, prompts: list[list[int]], params: SamplingParams, desc: str) -> list[Request]:
        """Run every prompt to completion; finished requests in prompt order.

        The first prompt runs alone so that a header shared by all of them is in the
        prefix cache before the rest are admitted (admitted together, none would hit).
        """
        if self.engine.has_unfinished:
            raise RuntimeError("the engine has unfinished requests; evaluate on an idle engine")
        ids = [f"eval-{next(_request_ids)}" for _ in prompts]
        for i, ids_ in enumerate(prompts):
            self.engine.validate(ids_, params, f"prompt {i}")
        bar = None
        if self.progress and progress_enabled():
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc=desc, unit="req", dynamic_ncols=True)
        done: dict[str, Request] = {}
        try:
            for start, stop in ((0, 1), (1, len(ids))):
                for rid, tokens in zip(ids[start:stop], prompts[start:stop]):
                    self.engine.add_request(rid, tokens, params)
                while self.engine.has_unfinished:
                    for req in self.engine.step():
                        done[req.request_id] = req
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in ids]

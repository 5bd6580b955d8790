"""Helpers of the GPU tests that run the configuration users run (bf16, decode CUDA
graphs, pipelined decode, EOS and stop-string endings, no logprobs, debug off): proof
that the path ran (graphs replayed, steps queued ahead), and the logprob-closeness rule
between such a run and a reference run that reported five logprobs a step."""

from __future__ import annotations

import random

from conftest import record_launches
from parity import top5_after

from batchgen import LLM, SamplingParams
from batchgen.eval.closeness import close_under_top5, top5_from_logprobs

# what a GPU engine of these tests is given besides its model: the device and dtype
# users run on a GPU
GPU = dict(device="cuda", dtype="bfloat16")


def grouped_prompts(seed: int) -> list[list[int]]:
    """Four groups of four prompts sharing 100 tokens, each with 3 to 60 of its own
    (prefix hits), then sixteen prompts of 5 to 150 tokens."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(4):
        prefix = [rng.randint(3, 500) for _ in range(100)]
        prompts += [
            prefix + [rng.randint(3, 500) for _ in range(rng.randint(3, 60))] for _ in range(4)
        ]
    return prompts + [[rng.randint(3, 500) for _ in range(rng.randint(5, 150))] for _ in range(16)]


class PathSeen:
    """Checks that llm runs the Triton backend with decode CUDA graphs, then counts its
    decode graph replays and its decode steps queued behind another (pipelined)."""

    def __init__(self, llm) -> None:
        runner = llm.engine.runner
        assert runner.attention_backend == "triton", runner.attention_backend
        assert runner.graphs is not None, "no decode CUDA graphs were captured"
        if llm.engine.state_pool is not None:  # linear-attention layers: slots bound too
            assert runner.graphs.linear_states is not None
        self.replays = 0
        run = runner.graphs.run

        def counted(*args, **kwargs):
            self.replays += 1
            return run(*args, **kwargs)

        runner.graphs.run = counted
        self._launches = record_launches(runner)

    @property
    def queued_ahead(self) -> int:
        return sum(behind for _, behind in self._launches)

    def check(self) -> None:
        assert self.replays > 0, "no decode step replayed a CUDA graph"
        assert self.queued_ahead > 0, "no decode step was queued ahead"


def collapsed_rows(llm, prompts, outs, ref, eos_ids) -> list[int]:
    """Indices of the rows of `outs` (CompletionOutputs of a run on `llm`) that break the
    logprob-closeness rule, endings included, against the same rows of `ref`
    (CompletionOutputs with logprobs >= 5, run with the same stop conditions). A row of
    `outs` run without logprobs has its top five at a divergence from a one-token
    request on its prefix on `llm` (parity.top5_after). eos_ids: the ids that end a row
    on both sides."""
    bad = []
    for p, (o, r) in enumerate(zip(outs, ref, strict=True)):
        ours = list(o.token_ids)
        if o.logprobs is not None:
            top5 = top5_from_logprobs(o.logprobs)
        else:
            top5 = lambda i, p=p, ours=ours: top5_after(llm, prompts[p], ours, i)  # noqa: E731
        if not close_under_top5(
            ours,
            list(r.token_ids),
            top5,
            top5_from_logprobs(r.logprobs),
            a_finish=o.finish_reason,
            b_finish=r.finish_reason,
            eos_ids=eos_ids,
        ):
            bad.append(p)
    return bad


def generated(model_dir, prompts, params, **options) -> tuple[list[tuple], PathSeen]:
    """Each prompt's (token ids, logprobs, finish reason) from a fresh engine on
    `model_dir` with the GPU's defaults and `options`, and the PathSeen of its run (the
    Triton backend and decode CUDA graphs checked before it runs)."""
    llm = LLM(model=str(model_dir), **GPU, **options)
    seen = PathSeen(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].finish_reason) for o in outs
    ], seen


def seeded_sampled(count: int, max_tokens: int = 24) -> list:
    """A user's sampled rows: temperature 0.8, top_p 0.95, a seed per row, EOS endings."""
    return [
        SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=max_tokens)
        for i in range(count)
    ]


def params_for(mode: str, count: int):
    """A two-row matrix's params: "defaults" (first: seeded sampled rows, EOS endings, no
    logprobs: pipelined decode in CUDA graphs) or "greedy_logprobs" (every logprob
    compared too)."""
    if mode == "defaults":
        return seeded_sampled(count)
    return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


def run_checked(model_dir, prompts, params, mode: str, **options) -> list[tuple]:
    """`generated`'s rows, the path checked: graphs replayed and (in "defaults") steps
    queued ahead."""
    outs, seen = generated(model_dir, prompts, params, **options)
    if mode == "defaults":
        seen.check()
    else:
        assert seen.replays > 0, "no decode step replayed a CUDA graph"
    return outs

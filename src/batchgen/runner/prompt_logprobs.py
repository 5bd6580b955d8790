"""Prompt logprobs: for requests that ask (SamplingParams.prompt_logprobs), the logprob
of each prompt token the step computes the position before, with its rank and the top-k.

A step's hidden rows are its requests' new tokens packed end to end. The row of prompt
position p predicts prompt token p + 1:

    prompt:   t0  t1  t2 ... t(P-1) | output ...
    row p  -> logprobs of t(p+1), for p in [start, min(start + n, P - 1))

so the entry of token p + 1 is filed under p + 1 (token 0 has none, as in vLLM).
Logprobs are those of the raw distribution, as for sampled tokens.
"""

from __future__ import annotations

import torch

from batchgen.runner.batch import TokenLogprobs
from batchgen.runner.input_batch import StepRow

_ROWS_PER_CHUNK = 512  # logits of this many positions at a time ([rows, vocab] float32)


def wants_prompt_logprobs(reqs: list[StepRow]) -> bool:
    return any(
        r.params.prompt_logprobs is not None and r.start < len(r.prompt_token_ids) - 1 for r in reqs
    )


def prompt_logprobs(
    model, hidden: torch.Tensor, reqs: list[StepRow]
) -> dict[str, dict[int, TokenLogprobs]]:
    """Per request asking for them: {prompt position: TokenLogprobs of its token}.
    Reads results back to the host (only steps with such requests pay for it)."""
    out: dict[str, dict[int, TokenLogprobs]] = {}
    row = 0
    for r in reqs:
        n, start, prompt = len(r.new_token_ids), r.start, r.prompt_token_ids
        stop = min(start + n, len(prompt) - 1)
        k = r.params.prompt_logprobs
        if k is not None and start < stop:
            entries: dict[int, TokenLogprobs] = {}
            for lo in range(start, stop, _ROWS_PER_CHUNK):
                hi = min(lo + _ROWS_PER_CHUNK, stop)
                rows = hidden[row + lo - start : row + hi - start]
                logprobs = torch.log_softmax(model.compute_logits(rows).float(), dim=-1)
                target = torch.tensor(prompt[lo + 1 : hi + 1], device=logprobs.device)
                chosen = logprobs.gather(1, target[:, None])
                ranks = (logprobs > chosen).sum(dim=1) + 1
                top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
                chosen, ranks = chosen[:, 0].tolist(), ranks.tolist()
                top_lp = top_lp.tolist() if k else [[]] * (hi - lo)
                top_ids = top_ids.tolist() if k else [[]] * (hi - lo)
                for i in range(hi - lo):
                    top = list(zip(top_ids[i], top_lp[i]))
                    entries[lo + i + 1] = TokenLogprobs(chosen[i], ranks[i], top)
            out[r.request_id] = entries
        row += n
    return out

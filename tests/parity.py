"""Reference comparison against transformers: greedy tokens and raw logprobs."""

from __future__ import annotations

import torch

from batchgen.eval import closeness


def reference_greedy(model, prompt: list[int], max_new_tokens: int, eos: int | list[int] | None):
    """transformers' greedy continuation of one prompt and each step's raw logprobs; it
    ends at any of the eos ids (pass all the engine stops at: their order in the config
    differs between transformers versions)."""
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


def close_under_top5(ours_tokens, our_logprobs, ref_tokens, ref_logprobs) -> bool:
    """The logprob-closeness rule (batchgen.eval.closeness) between our greedy tokens with
    their {token: Logprob} dicts and transformers' tokens with raw logprob tensors."""
    return closeness.close_under_top5(
        ours_tokens,
        ref_tokens,
        closeness.top5_from_logprobs(our_logprobs),
        lambda i: torch.topk(ref_logprobs[i], 5).indices.tolist(),
    )


def top5_after(llm, prompt: list[int], tokens: list[int], i: int) -> list[int]:
    """The five most likely next tokens after `prompt` and tokens[:i], by a one-token
    greedy request on that prefix: the top five at a divergence of a side that was run
    without logprobs."""
    from batchgen import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    out = llm.generate([prompt + tokens[:i]], params, use_tqdm=False)[0].outputs[0]
    return closeness.top5_from_logprobs(out.logprobs)(0)

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


def reference_agrees(
    model, prompt: list[int], tokens: list[int], eos: list[int], max_new_tokens: int
) -> bool:
    """Whether `tokens` are transformers' greedy continuation of `prompt` (what
    reference_greedy generates, ending at any of the `eos` ids or after max_new_tokens),
    from one forward over prompt + tokens: at every position the reference's argmax is
    the next token, no token before the last is an eos id, and the row ends on one
    unless it is max_new_tokens long. A forward per prompt instead of a generate() step
    per token: ~0.2 s a row on the CPU against ~2.4 s for 40 tokens."""
    if not tokens or len(tokens) > max_new_tokens:
        return False
    if any(t in eos for t in tokens[:-1]) or (
        len(tokens) < max_new_tokens and tokens[-1] not in eos
    ):
        return False
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    return logits.argmax(-1).tolist() == tokens


def eos_list(eos: int | list[int] | None) -> list[int]:
    """reference_greedy's eos argument as a list of ids."""
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def reference_finish(tokens: list[int], eos: int | list[int] | None) -> str:
    """The finish reason of a reference_greedy continuation: "stop" when it ends on one
    of the eos ids, else "length" (generate() ran out of max_new_tokens)."""
    return "stop" if tokens and tokens[-1] in eos_list(eos) else "length"


def close_under_top5(ours, ref_tokens, ref_logprobs, eos: int | list[int] | None) -> bool:
    """The logprob-closeness rule (batchgen.eval.closeness), endings included, between our
    greedy CompletionOutput (logprobs >= 5) and transformers' tokens with raw logprob
    tensors, both run to the same eos ids (None: ignore_eos on our side)."""
    return closeness.close_under_top5(
        ours.token_ids,
        ref_tokens,
        closeness.top5_from_logprobs(ours.logprobs),
        lambda i: torch.topk(ref_logprobs[i], 5).indices.tolist(),
        a_finish=ours.finish_reason,
        b_finish=reference_finish(ref_tokens, eos),
        eos_ids=eos_list(eos),
    )


def completions(llm, prompts, params) -> list:
    """Each prompt's CompletionOutput (token ids, finish reason, logprobs)."""
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def collapsed(rows, ref, eos_ids=()) -> int:
    """Rows (CompletionOutputs with logprobs >= 5) departing from the same rows of `ref`
    beyond the logprob-closeness rule, endings included; eos_ids: the ids both runs end a
    row at (the engine's eos_token_ids unless ignore_eos)."""
    top5 = closeness.top5_from_logprobs
    return sum(
        not closeness.close_under_top5(
            a.token_ids,
            b.token_ids,
            top5(a.logprobs),
            top5(b.logprobs),
            a_finish=a.finish_reason,
            b_finish=b.finish_reason,
            eos_ids=eos_ids,
        )
        for a, b in zip(rows, ref, strict=True)
    )


def top5_after(llm, prompt: list[int], tokens: list[int], i: int) -> list[int]:
    """The five most likely next tokens after `prompt` and tokens[:i], by a one-token
    greedy request on that prefix: the top five at a divergence of a side that was run
    without logprobs."""
    from batchgen import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    out = llm.generate([prompt + tokens[:i]], params, use_tqdm=False)[0].outputs[0]
    return closeness.top5_from_logprobs(out.logprobs)(0)

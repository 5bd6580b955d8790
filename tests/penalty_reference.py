"""An independent reference for the repetition, frequency and presence penalties: greedy
decoding with transformers' model on the same weights, one full forward a step, the
repetition penalty applied by transformers' own RepetitionPenaltyLogitsProcessor over the
prompt and the tokens generated so far, then frequency (penalty x count) and presence
(penalty once) subtracted for each generated token, as vLLM defines them."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from batchgen import SamplingParams


@torch.no_grad()
def penalized_logits(
    model, prompt: list[int], out: list[int], params: SamplingParams, count_prompt: bool = True
):
    """The next token's float32 logits after `prompt` + `out`, penalised as `params` says
    (count_prompt False: the repetition penalty left the prompt's tokens out, a wrong
    sampler). `model` is a transformers causal LM on any device and dtype."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + out], device=device)
    logits = model(ids).logits[0, -1].float()
    if params.repetition_penalty != 1.0:
        from transformers import RepetitionPenaltyLogitsProcessor

        skip = None if count_prompt else len(prompt)
        rep = RepetitionPenaltyLogitsProcessor(params.repetition_penalty, skip)
        logits = rep(ids, logits[None].clone())[0]
    for token, count in Counter(out).items():
        logits[token] -= params.frequency_penalty * count + params.presence_penalty
    return logits


def penalized_greedy(
    model, prompt: list[int], params: SamplingParams, stops=(), count_prompt: bool = True
) -> list[int]:
    """The greedy continuation under `params`' penalties, up to params.max_tokens tokens
    or the first token in `stops` (kept)."""
    out: list[int] = []
    while len(out) < params.max_tokens:
        logits = penalized_logits(model, prompt, out, params, count_prompt)
        out.append(int(logits.argmax()))
        if out[-1] in stops:
            break
    return out


def penalized_top5(model, prompt: list[int], tokens: list[int], params: SamplingParams):
    """For the closeness rule: the five most likely ids after prompt + tokens[:i],
    penalised, as a function of i."""
    return lambda i: penalized_logits(model, prompt, tokens[:i], params).topk(5).indices.tolist()


def set_eos(path: Path, eos: int) -> None:
    """Make `eos` the checkpoint's EOS token (config and generation config)."""
    for name in ("config.json", "generation_config.json"):
        data = json.loads((path / name).read_text())
        data["eos_token_id"] = eos
        (path / name).write_text(json.dumps(data))


def emitted_eos(runs: list[list[int]], avoid=()) -> int:
    """A token the runs emit mid-way in the most rows (not an id below 3, nor one in
    `avoid`): set as the EOS, it ends some rows early and leaves others to their
    length."""
    rows = Counter(t for tokens in runs for t in set(tokens[2:-2]) if t > 2 and t not in avoid)
    return rows.most_common(1)[0][0]


def cut_at(tokens: list[int], stops) -> tuple[list[int], str]:
    """A continuation cut at its first stop token (kept), with its finish reason."""
    for n, t in enumerate(tokens):
        if t in stops:
            return tokens[: n + 1], "stop"
    return tokens, "length"

"""Requests the default-configuration engine tests share: short prompts, every third with
a shared prefix; greedy rows beside seeded sampled ones; a small JSON schema."""

from __future__ import annotations

import random

from batchgen import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "maxLength": 6},
    },
    "required": ["ok", "n", "color", "name"],
    "additionalProperties": False,
}


def prefix_prompts(n: int, top: int) -> list[list[int]]:
    """n prompts of 5 to 40 token ids in [3, top], every third sharing a 24-token prefix."""
    rng = random.Random(0)
    shared = [rng.randint(3, top) for _ in range(24)]
    prompts = []
    for i in range(n):
        tail = [rng.randint(3, top) for _ in range(rng.randint(5, 16))]
        prompts.append(shared + tail if i % 3 == 0 else tail)
    return prompts


def greedy_and_sampled(n: int, max_tokens: int) -> list[SamplingParams]:
    """Greedy rows, and every third row sampled with a seed of its own."""
    return [
        SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=max_tokens)
        if i % 3 == 2
        else SamplingParams(temperature=0, max_tokens=max_tokens)
        for i in range(n)
    ]

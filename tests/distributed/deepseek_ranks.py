"""A tiny DeepSeek-V3 with experts (a dense layer, then 8 routed experts and a shared one)
whose EOS is a token one process emits mid-way, so some requests stop on it, and one
process's runs of it: what the multi-rank tests (attention data parallel and tensor parallel,
over processes or Ray actors) compare their tokens with."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

from deepseek_checkpoints import CONFIGS, save_tiny_deepseek
from penalty_reference import set_eos

from batchgen import LLM, SamplingParams

KW = dict(
    device="cpu",
    dtype="float32",
    page_size=4,
    max_model_len=128,
    max_num_batched_tokens=24,  # chunked prefills next to decodes
    num_kv_pages=200,
)
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def shared_head_prompts(n: int = 6, length: int = 12, seed: int = 0) -> list[list[int]]:
    """Prompts of 9 to 8 + length tokens, the first 8 (two pages) shared."""
    rng = random.Random(seed)
    head = [rng.randint(3, 500) for _ in range(8)]
    return [head + [rng.randint(3, 500) for _ in range(rng.randint(1, length))] for _ in range(n)]


def mixed_params(n: int) -> list[SamplingParams]:
    """Greedy rows, sampled rows with a seed of their own, sampled rows without one (the
    engine seeds them by arrival), in turn."""
    kinds = [
        GREEDY,
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, seed=7),
        SamplingParams(temperature=1.0, max_tokens=24),
    ]
    return [kinds[i % 3] for i in range(n)]


def generated(llm: LLM, prompts, params) -> list[tuple[list[int], str]]:
    """Each request's tokens and finish reason."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def one_process(path: str, prompts, params, **kw) -> list[tuple[list[int], str]]:
    """`generated` by an engine of one process (KW, and kw over it)."""
    llm = LLM(path, **KW, **kw)
    try:
        return generated(llm, prompts, params)
    finally:
        llm.engine.shutdown()


def emitted_mid_way(rows: list[list[int]]) -> int:
    """The token the rows emit most often away from their first and last two, special
    ids (0 to 2) aside (penalty_reference.emitted_eos counts rows, not tokens: it picks
    another token, and another checkpoint, for these runs)."""
    counts = Counter(t for tokens in rows for t in tokens[2:-2])
    return next(t for t, _ in counts.most_common() if t > 2)


def save_with_emitted_eos(path: Path) -> str:
    """The checkpoint at path, its EOS the token one process's greedy run of
    shared_head_prompts() emits most mid-way."""
    save_tiny_deepseek(path, **CONFIGS["moe_dense_first"])
    first = one_process(str(path), shared_head_prompts(), GREEDY)
    set_eos(path, emitted_mid_way([tokens for tokens, _ in first]))
    return str(path)


def add_long_requests(engine) -> None:
    """Four requests ("0" to "3") that decode 100 tokens, EOS ignored: still running
    whenever a test loses a rank."""
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    for i, ids in enumerate(shared_head_prompts(4)):
        engine.add_request(str(i), ids, long)

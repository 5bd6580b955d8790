"""Per-token cost of structured-output masks at batch 256: xgrammar vs llguidance.

    python3 benchmarks/grammar_mask_cost.py                      # default model's tokenizer
    python3 benchmarks/grammar_mask_cost.py --tokenizer DIR      # any HF tokenizer directory
    python3 benchmarks/grammar_mask_cost.py --batch 64 --out /tmp/mask
    python3 benchmarks/grammar_mask_cost.py --only batchgen      # the engine's own path

The choice of grammar engine for structured outputs rests on this figure: the host time
to fill the next-token bitmask of every row of a decode step, per token. Each of --batch
rows decodes a different valid JSON instance of one extraction schema (names, numbers,
arrays, a nested object; compact separators), token by token: each step fills the
bitmask of every unfinished row, then advances each row by its next token. Timed: the
bitmask fills only (advancing is the same work for both and small); compile time is
reported apart. Each engine runs in the ways it offers: one row after another, and its
batched fill (xgrammar's BatchGrammarMatcher, llguidance's fill_next_token_bitmask_par,
both on their own thread pools). Every row's tokens are checked against its mask as it
goes, so an engine that rejects a valid instance fails the run.

Needs the optional packages xgrammar and llguidance (not batchgen dependencies yet);
an engine that is not installed is skipped with a message. Runs on the CPU: the masks
are computed on the host in both engines. Prints a table and writes grammar_mask.json
into --out.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "score", "tags", "address", "active"],
    "additionalProperties": False,
}
WORDS = "alpha beta gamma delta omega river stone cloud maple cedar amber north".split()


def instance(rng: random.Random) -> str:
    """A valid instance of SCHEMA, keys in schema order, compact separators."""
    obj = {
        "name": " ".join(rng.choice(WORDS).title() for _ in range(rng.randint(1, 3))),
        "age": rng.randint(1, 99),
        "email": f"{rng.choice(WORDS)}{rng.randint(1, 999)}@example.org",
        "score": round(rng.uniform(0, 100), rng.randint(0, 3)),
        "tags": [rng.choice(WORDS) for _ in range(rng.randint(0, 4))],
        "address": {"city": rng.choice(WORDS).title(), "zip": f"{rng.randint(0, 99999):05d}"},
        "active": rng.random() < 0.5,
    }
    return json.dumps(obj, separators=(",", ":"))


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    if name == "default":
        from batchgen.models.default_model import default_model_path

        path = default_model_path()
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(name)


def rows_of_tokens(tokenizer, batch: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [tokenizer.encode(instance(rng), add_special_tokens=False) for _ in range(batch)]


def _allowed(mask_row: torch.Tensor, token: int) -> bool:
    return bool((int(mask_row[token // 32]) >> (token % 32)) & 1)


def run_xgrammar(tokenizer, rows, batched: bool) -> dict:
    import xgrammar as xgr

    vocab = len(tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    start = time.perf_counter()
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - start
    matchers = [xgr.GrammarMatcher(compiled) for _ in rows]
    mask = xgr.allocate_token_bitmask(len(rows), info.vocab_size)
    batch_matcher = xgr.BatchGrammarMatcher() if batched else None

    def fill(active: list[int]) -> None:
        if batched:
            batch_matcher.batch_fill_next_token_bitmask(
                [matchers[i] for i in active], mask, indices=active
            )
        else:
            for i in active:
                matchers[i].fill_next_token_bitmask(mask, i)

    def accept(i: int, token: int) -> None:
        if not matchers[i].accept_token(token):
            raise AssertionError(f"xgrammar rejected token {token} of row {i}")

    return dict(_drive(rows, mask, fill, accept), compile_s=compile_s)


def run_llguidance(tokenizer, rows, batched: bool) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lltorch

    lltok = llguidance.hf.from_tokenizer(tokenizer)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
    )
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in rows]
    compile_s = time.perf_counter() - start
    for m in matchers:
        if m.is_error():
            raise RuntimeError(f"llguidance: {m.get_error()}")
    mask = lltorch.allocate_token_bitmask(len(rows), lltok.vocab_size)
    executor = llguidance.LLExecutor() if batched else None

    def fill(active: list[int]) -> None:
        if batched:
            lltorch.fill_next_token_bitmask_par(executor, [(matchers[i], i) for i in active], mask)
        else:
            for i in active:
                lltorch.fill_next_token_bitmask(matchers[i], mask, i)

    def accept(i: int, token: int) -> None:
        if not matchers[i].consume_token(token):
            raise AssertionError(f"llguidance rejected token {token} of row {i}")

    return dict(_drive(rows, mask, fill, accept), compile_s=compile_s)


def _drive(rows, mask, fill, accept) -> dict:
    """Decode every row's tokens in lock step; time the fills."""
    fill_s, tokens, steps = 0.0, 0, 0
    for step in range(max(len(r) for r in rows)):
        active = [i for i, r in enumerate(rows) if step < len(r)]
        start = time.perf_counter()
        fill(active)
        fill_s += time.perf_counter() - start
        for i in active:
            token = rows[i][step]
            if not _allowed(mask[i], token):
                raise AssertionError(f"token {token} of row {i} at step {step} masked out")
            accept(i, token)
        tokens += len(active)
        steps += 1
    return {
        "tokens": tokens,
        "steps": steps,
        "fill_s": fill_s,
        "us_per_token": fill_s / tokens * 1e6,
        "ms_per_step": fill_s / steps * 1e3,
    }


def run_engine(tokenizer, rows) -> dict:
    """batchgen's own per-step host path (engine.structured.StructuredOutputs): the
    masks of the step's unfinished rows filled into one reused buffer (the runner's
    pinned rows), then the rows' tokens handed to their matchers as
    `EngineCore._advance_grammars` does; a row ends with EOS and its matcher is dropped,
    as the engine drops a finished request's. Both halves timed."""
    from batchgen.engine.structured import StructuredOutputs
    from batchgen.sampling_params import StructuredOutputsParams

    eos = tokenizer.eos_token_id
    grammar = StructuredOutputs(tokenizer, len(tokenizer), [eos])
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    start = time.perf_counter()
    grammar.compile(spec)
    compile_s = time.perf_counter() - start
    ids = [f"r{i}" for i in range(len(rows))]
    for rid in ids:
        grammar.add(rid, spec)
    rows = [r + [eos] for r in rows]
    out = torch.empty((len(rows), grammar.words), dtype=torch.int32).numpy()  # the runner's
    fill_s = advance_s = 0.0
    tokens = steps = 0
    for step in range(max(len(r) for r in rows)):
        active = [i for i, r in enumerate(rows) if step < len(r)]
        start = time.perf_counter()
        mask = torch.from_numpy(grammar.bitmask([ids[i] for i in active], out))
        fill_s += time.perf_counter() - start
        for k, i in enumerate(active):
            if not _allowed(mask[k], rows[i][step]):
                raise AssertionError(f"token {rows[i][step]} of row {i} masked out")
        start = time.perf_counter()
        rejected = grammar.advance([ids[i] for i in active], [rows[i][step] for i in active])
        advance_s += time.perf_counter() - start
        if rejected:
            raise AssertionError(f"batchgen rejected the tokens of {rejected}")
        for i in active:
            if step == len(rows[i]) - 1:
                grammar.remove(ids[i])
        tokens += len(active)
        steps += 1
    return {
        "tokens": tokens,
        "steps": steps,
        "fill_s": fill_s,
        "advance_s": advance_s,
        "us_per_token": fill_s / tokens * 1e6,
        "ms_per_step": fill_s / steps * 1e3,
        "advance_ms_per_step": advance_s / steps * 1e3,
        "compile_s": compile_s,
    }


ENGINES = {"xgrammar": run_xgrammar, "llguidance": run_llguidance}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default="default", help='"default" or an HF tokenizer dir')
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--only", default=None, help='runs whose name holds this, e.g. "batchgen"')
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    rows = rows_of_tokens(tokenizer, args.batch, args.seed)
    results = {}
    for name, run in ENGINES.items():
        for batched in (False, True):
            key = f"{name}/{'batched' if batched else 'row by row'}"
            if args.only is not None and args.only not in key:
                continue
            try:
                results[key] = run(tokenizer, rows, batched)
            except ImportError as exc:
                results[key] = {"skipped": f"not installed: {exc}"}
    if args.only is None or args.only in "batchgen engine":
        results["batchgen engine"] = run_engine(tokenizer, rows)
    lines = [
        f"batch {args.batch}, {len(tokenizer):,}-token vocabulary, "
        f"{sum(map(len, rows)):,} tokens ({min(map(len, rows))}-{max(map(len, rows))} a row), "
        f"torch {torch.get_num_threads()} threads",
        f"{'engine':<24} {'us/token':>9} {'ms/step':>8} {'compile s':>10} {'advance ms/step':>16}",
    ]
    for key, r in results.items():
        if "skipped" in r:
            lines.append(f"{key:<24} {r['skipped']}")
        else:
            lines.append(
                f"{key:<24} {r['us_per_token']:>9.1f} {r['ms_per_step']:>8.2f} "
                f"{r['compile_s']:>10.3f} {r.get('advance_ms_per_step', float('nan')):>16.2f}"
            )
    sys.stdout.write("\n".join(lines) + "\n")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {"batch": args.batch, "tokenizer": args.tokenizer, "results": results}
        (args.out / "grammar_mask.json").write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

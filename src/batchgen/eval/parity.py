"""Greedy parity: batchgen and transformers on the same prompts and weights.

For each prompt both sides decode greedily (to EOS or max_tokens). Reported: the
agreement rate (prompts whose token sequences are identical), where the first
divergence falls (index of the first differing generated token), and the largest
|logprob difference| of batchgen's tokens, compared only where both sides saw the same
context (up to and including the first divergence). A run passes when the agreement
rate is at least the threshold (and, if given, the logprob difference at most a bound).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from batchgen.eval.engine_scorer import EngineScorer, GreedyRun, Position
from batchgen.eval.reference import TransformersReference


@dataclass
class PromptParity:
    index: int
    ours: list[int]
    ref: list[int]
    first_divergence: int | None  # index of the first differing token; None if identical
    max_logprob_diff: float
    # at the divergence: each side's token and the reference's logprobs of both
    ours_token_ref_logprob: float | None = None
    ref_token_ref_logprob: float | None = None

    @property
    def identical(self) -> bool:
        return self.first_divergence is None


@dataclass
class ParityReport:
    prompts: list[PromptParity] = field(default_factory=list)

    @property
    def agreement(self) -> float:
        if not self.prompts:
            return 1.0
        return sum(p.identical for p in self.prompts) / len(self.prompts)

    @property
    def max_logprob_diff(self) -> float:
        return max((p.max_logprob_diff for p in self.prompts), default=0.0)

    @property
    def divergences(self) -> list[int]:
        return [p.first_divergence for p in self.prompts if p.first_divergence is not None]

    @property
    def token_agreement(self) -> float:
        """Tokens matching before the first divergence, over the tokens compared."""
        matched = total = 0
        for p in self.prompts:
            n = max(len(p.ours), len(p.ref))
            total += n
            matched += n if p.identical else p.first_divergence
        return matched / total if total else 1.0

    def passes(self, threshold: float, max_logprob_diff: float | None = None) -> bool:
        if self.agreement < threshold:
            return False
        return max_logprob_diff is None or self.max_logprob_diff <= max_logprob_diff

    def summary(self, decode: Callable[[list[int]], str] | None = None) -> str:
        """A few lines of text; `decode` (e.g. tokenizer.decode) shows tokens as text."""
        n = len(self.prompts)
        same = sum(p.identical for p in self.prompts)
        lines = [
            f"greedy agreement: {same}/{n} prompts identical ({100 * self.agreement:.1f}%), "
            f"{100 * self.token_agreement:.1f}% of tokens before the first divergence",
            f"largest |logprob difference| (same context): {self.max_logprob_diff:.3e}",
        ]
        div = self.divergences
        if div:
            lines.append(
                f"first divergence at generated token: min {min(div)}, "
                f"median {statistics.median(div):g}, max {max(div)}"
            )
            for p in [p for p in self.prompts if not p.identical][:10]:
                lines.append(
                    f"  prompt {p.index}: token {p.first_divergence}: batchgen "
                    f"{_token_at(p.ours, p.first_divergence, decode)} (ref logprob "
                    f"{_fmt(p.ours_token_ref_logprob)}) vs transformers "
                    f"{_token_at(p.ref, p.first_divergence, decode)} "
                    f"({_fmt(p.ref_token_ref_logprob)})"
                )
        return "\n".join(lines) + "\n"

    def write_json(self, path: str | Path) -> None:
        data = {
            "agreement": self.agreement,
            "token_agreement": self.token_agreement,
            "max_logprob_diff": self.max_logprob_diff,
            "prompts": [asdict(p) for p in self.prompts],
        }
        Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def compare_prompt(
    index: int, ours: GreedyRun, ref: GreedyRun, ref_steps: list[Position]
) -> PromptParity:
    """ref_steps[j].exact holds the reference's logprob of ours.tokens[j] (if j is in range)."""
    first = next((j for j, (a, b) in enumerate(zip(ours.tokens, ref.tokens)) if a != b), None)
    if first is None and len(ours.tokens) != len(ref.tokens):
        first = min(len(ours.tokens), len(ref.tokens))
    last = len(ours.tokens) if first is None else first + 1
    worst = 0.0
    for j in range(min(last, len(ours.tokens), len(ref_steps))):
        token = ours.tokens[j]
        if token in ref_steps[j].exact:
            worst = max(worst, abs(ours.logprobs[j] - ref_steps[j].exact[token]))
    result = PromptParity(index, ours.tokens, ref.tokens, first, worst)
    if first is not None and first < len(ours.tokens) and first < len(ref.tokens):
        result.ours_token_ref_logprob = ref_steps[first].exact.get(ours.tokens[first])
        result.ref_token_ref_logprob = ref.logprobs[first]
    return result


def run_parity(
    scorer: EngineScorer,
    reference: TransformersReference,
    prompts: list[list[int]],
    max_tokens: int,
) -> ParityReport:
    ours = scorer.greedy(prompts, max_tokens)
    refs = reference.greedy(
        prompts, max_tokens, scorer.engine.eos_token_ids, lookups=[r.tokens for r in ours]
    )
    return ParityReport(
        [compare_prompt(i, a, b, steps) for i, (a, (b, steps)) in enumerate(zip(ours, refs))]
    )


def load_prompts(path: str | Path, tokenizer, chat: bool = False) -> list[list[int]]:
    """Token ids of each prompt in a file.

    .jsonl/.json: one JSON value a line — a string, or an object with "prompt" (str),
    "prompt_token_ids" (list of ints) or "messages" (a chat, through the chat template),
    or an OpenAI batch line whose "body" holds one of those (its sampling options are
    ignored: parity is greedy).
    Any other file: each non-empty line is a prompt. With chat=True a string prompt is
    sent as one user message through the chat template.
    """
    path = Path(path)
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            item = line.rstrip("\n")
            if path.suffix in (".jsonl", ".json"):
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not JSON: {e}") from e
            out.append(_prompt_ids(item, tokenizer, chat, f"{path}:{lineno}"))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def _prompt_ids(item, tokenizer, chat: bool, where: str) -> list[int]:
    if isinstance(item, dict) and isinstance(item.get("body"), dict):
        item = item["body"]  # an OpenAI batch line: its request body
    if isinstance(item, dict):
        if "prompt_token_ids" in item:
            ids = item["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ValueError(f"{where}: 'prompt_token_ids' must be a list of ints")
            return ids
        if "messages" in item:
            return _chat_ids(tokenizer, item["messages"])
        item = item.get("prompt")
    if not isinstance(item, str) or not item:
        raise ValueError(
            f"{where}: expected a prompt string, 'prompt', 'prompt_token_ids' or 'messages'"
        )
    if chat:
        return _chat_ids(tokenizer, [{"role": "user", "content": item}])
    return tokenizer.encode(item)


def _chat_ids(tokenizer, messages) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _token_at(tokens: list[int], j: int, decode) -> str:
    if j >= len(tokens):
        return "<end>"
    return f"{tokens[j]} {decode([tokens[j]])!r}" if decode else str(tokens[j])


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"

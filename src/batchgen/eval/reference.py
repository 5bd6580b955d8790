"""The transformers side of an evaluation: the same weights through AutoModelForCausalLM.

Loads the model batchgen loads (the same ModelSource: an HF directory, or a GGUF file
that transformers dequantizes the same way; GGUF loading needs `accelerate`) in float32
by default, and answers the same questions as EngineScorer — `positions(queries)` and
`greedy(prompts, max_tokens)` — one prompt at a time, with no padding, so nothing but
the two implementations differs (shared prefixes reuse a copied DynamicCache, as the
engine reuses cached pages). It reports exact logprobs for the asked tokens and the
same top-k the engine reports, so both sides can be scored by one rule.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import torch

from batchgen.console import library_progress_bars, progress_enabled
from batchgen.eval.engine_scorer import TOP_K, GreedyRun, Position, Query
from batchgen.models.loader import ModelSource


class TransformersReference:
    """AutoModelForCausalLM over a ModelSource, with EngineScorer's interface."""

    def __init__(self, model, top_k: int = TOP_K, progress: bool = False) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.top_k = top_k
        self.progress = progress
        # transformers renamed the KV cache argument and output `past_key_values` -> `cache`
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keep_arg = "logits_to_keep" in params

    @classmethod
    def load(
        cls,
        source: ModelSource | str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        top_k: int = TOP_K,
        progress: bool = False,
    ) -> TransformersReference:
        from transformers import AutoModelForCausalLM

        if not isinstance(source, ModelSource):
            source = ModelSource.resolve(source)
        kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
        with library_progress_bars(progress and progress_enabled()):
            model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype, **kwargs)
        return cls(model.to(device), top_k, progress)

    @torch.inference_mode()
    def _forward(self, ids: list[int], cache, last: int) -> tuple[torch.Tensor, object]:
        """Run ids after a KV cache (None: from scratch; a given cache is copied, not
        changed). Returns the [last, vocab] float32 raw logprobs of the token after each
        of the last `last` prefixes (logits only there: the vocabulary is large), and the
        extended cache."""
        kwargs: dict = {"use_cache": True}
        if cache is not None:
            kwargs[self._cache_arg] = copy.deepcopy(cache)
        if self._keep_arg:
            kwargs["logits_to_keep"] = last
        out = self.model(input_ids=torch.tensor([ids], device=self.device), **kwargs)
        return torch.log_softmax(out.logits[0, -last:].float(), dim=-1), _cache_of(out)

    def _position(self, row: torch.Tensor, asked: list[int]) -> Position:
        vals, idx = torch.topk(row, self.top_k)
        top = dict(zip(idx.tolist(), vals.tolist()))
        return Position(top, {t: row[t].item() for t in asked})

    def positions(self, queries: list[Query], desc: str = "transformers") -> list[list[Position]]:
        """Like EngineScorer.positions. KV is reused as batchgen's prefix cache would: the
        prefix all prompts share is computed once, each distinct prompt (all but its last
        token) once more, and each query runs only its last prompt token and cont[:n-1]."""
        if not queries:
            return []
        shared = _common_prefix([q.prompt for q in queries])
        shared = shared[: min(len(q.prompt) for q in queries) - 1]
        base = self._forward(shared, None, 1)[1] if shared else None
        out, held, held_cache = [], None, None
        for q in self._bar(queries, desc):
            if q.prompt is not held and q.prompt != held:
                body = q.prompt[len(shared) : -1]
                held, held_cache = q.prompt, self._forward(body, base, 1)[1] if body else base
            n = len(q.asked)
            rows = self._forward(q.prompt[-1:] + q.cont[: n - 1], held_cache, n)[0]
            out.append([self._position(rows[j], q.asked[j]) for j in range(n)])
        return out

    @torch.inference_mode()
    def greedy(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        eos_token_ids: list[int],
        lookups: list[list[int]] | None = None,
        desc: str = "transformers",
    ) -> list[tuple[GreedyRun, list[Position]]]:
        """Greedy completions with a KV cache, stopping at an EOS token or max_tokens.

        For each prompt also the Position at every generated step, with the exact logprob
        of lookups[i][step] (e.g. batchgen's token at that step) where given.
        """
        eos = set(eos_token_ids)
        results = []
        for i, prompt in enumerate(self._bar(prompts, desc)):
            wanted = lookups[i] if lookups else []
            x = torch.tensor([prompt], device=self.device)
            keep = {"logits_to_keep": 1} if self._keep_arg else {}
            out = self.model(input_ids=x, use_cache=True, **keep)
            tokens, logprobs, steps = [], [], []
            for step in range(max_tokens):
                row = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                token = int(row.argmax())
                tokens.append(token)
                logprobs.append(row[token].item())
                steps.append(self._position(row, wanted[step : step + 1]))
                if token in eos or step + 1 == max_tokens:
                    break
                out = self.model(
                    input_ids=torch.tensor([[token]], device=self.device),
                    use_cache=True,
                    **{self._cache_arg: _cache_of(out)},
                )
            reason = "stop" if tokens and tokens[-1] in eos else "length"
            results.append((GreedyRun(tokens, logprobs, reason), steps))
        return results

    def _bar(self, items: list, desc: str):
        if not (self.progress and progress_enabled()):
            return items
        from tqdm.auto import tqdm

        return tqdm(items, desc=desc, unit="prompt", dynamic_ncols=True)


def _cache_of(output):
    cache = output.get("cache")
    return cache if cache is not None else output.get("past_key_values")


def _common_prefix(seqs: list[list[int]]) -> list[int]:
    first = seqs[0]
    n = len(first)
    for seq in seqs[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], seq)) if a != b), min(n, len(seq)))
    return first[:n]

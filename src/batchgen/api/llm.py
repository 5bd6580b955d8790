"""The Python API: LLM.generate / LLM.chat, in vLLM's shape."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from batchgen.config import EngineConfig
from batchgen.console import progress_enabled
from batchgen.engine.engine_core import EngineCore
from batchgen.engine.request import Request
from batchgen.outputs import CompletionOutput, Logprob, RequestOutput
from batchgen.sampling_params import SamplingParams

PromptLike = str | list[int] | dict[str, Any]


class LLM:
    """An offline engine over one model.

    LLM(model=None) loads the embedded default model (SmolLM2-135M-Instruct). Keyword
    arguments name EngineConfig fields (dtype, device, max_num_seqs,
    max_num_batched_tokens, max_model_len, page_size, kv_cache_size_gib,
    gpu_memory_utilization, ...); unknown ones raise TypeError.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s): {', '.join(sorted(unknown))}")
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = EngineCore.from_config(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in input order.

        A prompt is a string, a list of token ids, or {"prompt": str} /
        {"prompt_token_ids": [...]}. Every prompt is checked before any work starts.
        """
        items = _as_list(prompts)
        params = _params_for(items, sampling_params)
        encoded = [self._encode(p, i) for i, p in enumerate(items)]
        for i, (ids, _) in enumerate(encoded):
            self.engine.validate(ids, params[i], f"prompt {i}")
        return self._run(encoded, params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Complete conversations through the tokenizer's chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for i, conv in enumerate(convs):
            if not conv:
                raise ValueError(f"conversation {i} has no messages")
            prompts.append(
                self.apply_chat_template(
                    conv, add_generation_prompt, **(chat_template_kwargs or {})
                )
            )
        params = _params_for(prompts, sampling_params)
        encoded = [(self.tokenizer.encode(p, add_special_tokens=False), p) for p in prompts]
        for i, (ids, _) in enumerate(encoded):
            self.engine.validate(ids, params[i], f"conversation {i}")
        return self._run(encoded, params, use_tqdm)

    def apply_chat_template(
        self, conversation: list[dict[str, str]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template; use generate()")
        return self.tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def _encode(self, prompt: PromptLike, index: int) -> tuple[list[int], str | None]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(
                    f"prompt {index}: a dict prompt needs 'prompt' or 'prompt_token_ids'"
                )
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), prompt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt, None
        raise TypeError(
            f"prompt {index}: expected a string or a list of token ids, got {type(prompt).__name__}"
        )

    def _run(
        self,
        encoded: list[tuple[list[int], str | None]],
        params: list[SamplingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        batch = next(self._ids)
        ids = [f"{batch}-{i}" for i in range(len(encoded))]
        for rid, (tokens, _), p in zip(ids, encoded, params):
            self.engine.add_request(rid, tokens, p)
        done: dict[str, Request] = {}
        bar = None
        if use_tqdm and progress_enabled():
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished:
                for req in self.engine.step():
                    done[req.request_id] = req
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(out_tok=self.engine.stats.output_tokens, refresh=False)
        except BaseException:
            self.engine.abort(rid for rid in ids if rid not in done)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [self._output(done[rid], text) for rid, (_, text) in zip(ids, encoded)]

    def _output(self, req: Request, prompt: str | None) -> RequestOutput:
        logprobs = None
        if req.params.logprobs is not None:
            logprobs = []
            for token, lp in zip(req.output_token_ids, req.logprobs):
                entry = {
                    tid: Logprob(val, rank + 1, self.tokenizer.decode([tid]))
                    for rank, (tid, val) in enumerate(lp.top)
                }
                entry[token] = Logprob(
                    lp.sampled_logprob, lp.sampled_rank, self.tokenizer.decode([token])
                )
                logprobs.append(entry)
        completion = CompletionOutput(
            index=0,
            text=req.text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=sum(lp.sampled_logprob for lp in req.logprobs) if logprobs else None,
        )
        return RequestOutput(req.request_id, prompt, req.prompt_token_ids, [completion])


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


def _params_for(items: list, params) -> list[SamplingParams]:
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * len(items)
    params = list(params)
    if len(params) != len(items):
        raise ValueError(f"got {len(params)} SamplingParams for {len(items)} prompts")
    return params

"""The Python API: LLM.generate / LLM.chat, in vLLM's shape."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from batchgen.api.chat_messages import checked_conversation
from batchgen.api.engine_args import engine_config
from batchgen.api.parallel_sampling import child_params, select
from batchgen.console import progress_enabled
from batchgen.engine.dp_attention import start_engine
from batchgen.engine.memory import fewer_full_collections
from batchgen.engine.request import Request
from batchgen.outputs import CompletionOutput, Logprob, RequestOutput
from batchgen.sampling_params import SamplingParams

PromptLike = str | list[int] | dict[str, Any]


class LLM:
    """An offline engine over one model.

    LLM(model=None) loads the embedded default model (SmolLM2-135M-Instruct). Keyword
    arguments name EngineConfig fields (dtype, device, max_num_seqs,
    max_num_batched_tokens, max_model_len, page_size, kv_cache_size_gib,
    gpu_memory_utilization, ...) or their vLLM names (block_size, swap_space,
    download_dir; kv_cache_dtype "fp8" for FP8 KV pages; tokenizer at the value batchgen
    takes: see engine_args); unknown ones raise TypeError naming the nearest option. A model named
    by its Hugging Face id is loaded at `revision` (None: main) from the Hugging Face
    cache `download_dir` (None: HF_HUB_CACHE), downloaded into it where it is missing.
    max_model_len above the model's context length (max_position_embeddings) raises
    ValueError, as in vLLM.

    trust_remote_code is accepted for compatibility with vLLM's signature and ignored:
    batchgen runs its own model classes and loads configs and tokenizers with
    transformers' built-in classes, so no code shipped with a checkpoint is ever run
    (a checkpoint that needs such code fails to load either way).
    """

    def __init__(
        self, model: str | None = None, trust_remote_code: bool = False, **kwargs: Any
    ) -> None:
        if not isinstance(trust_remote_code, bool):
            raise TypeError(f"trust_remote_code must be a bool, got {trust_remote_code!r}")
        self.config = engine_config(model, kwargs)
        self.config.torch_device()  # a device this torch cannot use fails before loading
        self.engine = start_engine(self.config)  # attention data parallel, or one EngineCore
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def get_tokenizer(self):
        """The tokenizer the engine encodes prompts and decodes outputs with."""
        return self.engine.tokenizer

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
        params = _params_for(items, sampling_params, "prompt")
        encoded = [self._encode(p, i) for i, p in enumerate(items)]
        for i, (ids, _) in enumerate(encoded):
            self._validate(ids, params[i], f"prompt {i}")
        return self._run(encoded, params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Complete conversations through the tokenizer's chat template.

        `messages` is one conversation (a list of messages) or a list of them. Each is
        checked as a batch line's messages are (chat_messages.checked_conversation:
        roles system, user, assistant, developer; content a string or OpenAI text parts)
        before any work starts.
        """
        if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], list):
            convs = [
                checked_conversation(conv, f"conversation {i}: ") for i, conv in enumerate(messages)
            ]
        elif isinstance(messages, (list, tuple)) and not messages:
            convs = []  # no conversations, as vLLM reads an empty list
        else:
            convs = [checked_conversation(messages)]
        # every conversation rendered and encoded in one call each (the fast tokenizer's
        # batch encode): the same ids as one at a time, less per-prompt overhead
        prompts = self._render(convs, add_generation_prompt, chat_template_kwargs or {})
        params = _params_for(prompts, sampling_params, "conversation")
        encoded = list(zip(_encode_batch(self.tokenizer, prompts), prompts))
        for i, (ids, _) in enumerate(encoded):
            self._validate(ids, params[i], f"conversation {i}")
        return self._run(encoded, params, use_tqdm)

    def _validate(self, ids: list[int], params: SamplingParams, what: str) -> None:
        """The engine's checks, on the parameters of one sample (the engine runs one)."""
        if isinstance(params, SamplingParams):
            params = child_params(params)[0]
        self.engine.validate(ids, params, what)

    def apply_chat_template(
        self, conversation: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text of one conversation, checked and flattened as LLM.chat does."""
        return self._render(checked_conversation(conversation), add_generation_prompt, kwargs)

    def _render(self, flat: list, add_generation_prompt: bool, kwargs: dict[str, Any]):
        """The prompt text of one flattened conversation (a list of messages), or the
        list of texts of a list of them, rendered in one call."""
        if not flat:
            return []  # no conversations
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template; use generate()")
        return self.tokenizer.apply_chat_template(
            flat, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
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
        if isinstance(prompt, list):  # its ids' types are checked with their range
            return prompt, None
        raise TypeError(
            f"prompt {index}: expected a string or a list of token ids, got {type(prompt).__name__}"
        )

    @fewer_full_collections()  # adding the requests and every step run inside it
    def _run(
        self,
        encoded: list[tuple[list[int], str | None]],
        params: list[SamplingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        batch = next(self._ids)
        groups: list[list[str]] = []  # per prompt: its engine requests, one per sample
        work = []  # per prompt: (its requests, prompt ids, one SamplingParams per sample)
        for i, ((tokens, _), p) in enumerate(zip(encoded, params)):
            children = child_params(p)
            rid = f"{batch}-{i}"
            group = [rid] if len(children) == 1 else [f"{rid}#{k}" for k in range(len(children))]
            groups.append(group)
            work.append((group, tokens, children))
        ids = [rid for group in groups for rid in group]
        done: dict[str, Request] = {}
        tokens_before = self.engine.stats.output_tokens  # the bar counts this call's tokens
        bar = None
        if use_tqdm and progress_enabled():
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Generating", unit="req", dynamic_ncols=True)
        # prompts are added as the batch job adds its lines: before each step, up to
        # config.read_ahead unfinished requests (a prompt's samples together, consecutive
        # so that one prefill serves them all), so `batchgen run` and this call batch alike
        window, queued, in_flight = self.engine.config.read_ahead, iter(work), 0
        try:
            while True:
                while in_flight < window and (nxt := next(queued, None)) is not None:
                    group, tokens, children = nxt
                    for child_id, child in zip(group, children):
                        self.engine.add_request(child_id, tokens, child, validated=True)
                    in_flight += len(group)
                if not self.engine.has_unfinished:
                    break
                for req in self.engine.step():
                    done[req.request_id] = req
                    in_flight -= 1
                    if bar is not None:
                        bar.update(1)
                        out_tok = self.engine.stats.output_tokens - tokens_before
                        bar.set_postfix(out_tok=out_tok, refresh=False)
        except BaseException:
            self.engine.abort(rid for rid in ids if rid not in done)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [
            self._output(f"{batch}-{i}", [done[rid] for rid in group], text, p)
            for i, (group, (_, text), p) in enumerate(zip(groups, encoded, params))
        ]

    def _output(
        self, request_id: str, reqs: list[Request], prompt: str | None, params: SamplingParams
    ) -> RequestOutput:
        samples = [self._completion(req) for req in reqs]
        out = RequestOutput(request_id, prompt, reqs[0].prompt_token_ids, select(params, samples))
        if params.prompt_logprobs is not None:  # the first sample computed them
            first = reqs[0]
            out.prompt_logprobs = [None] + [
                self._logprob_entry(token, first.prompt_logprobs[i])
                for i, token in enumerate(first.prompt_token_ids[1:], start=1)
            ]
        return out

    def _completion(self, req: Request) -> CompletionOutput:
        logprobs = None
        if req.params.logprobs is not None:
            logprobs = [
                self._logprob_entry(token, lp)
                for token, lp in zip(req.output_token_ids, req.logprobs)
            ]
        return CompletionOutput(
            index=0,
            text=req.text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=sum(lp.sampled_logprob for lp in req.logprobs) if logprobs else None,
        )

    def _logprob_entry(self, token: int, lp) -> dict[int, Logprob]:
        """The top-k of a TokenLogprobs by rank, and the token itself (which may rank
        below them)."""
        entry = {
            tid: Logprob(val, rank + 1, self.tokenizer.decode([tid]))
            for rank, (tid, val) in enumerate(lp.top)
        }
        entry[token] = Logprob(lp.sampled_logprob, lp.sampled_rank, self.tokenizer.decode([token]))
        return entry


def _encode_batch(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's ids as `tokenizer.encode(text, add_special_tokens=False)` gives them,
    in one batch call."""
    if not texts:
        return []
    return list(tokenizer(texts, add_special_tokens=False)["input_ids"])


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


def _params_for(items: list, params, what: str) -> list[SamplingParams]:
    """One SamplingParams a prompt (`what` names one: "prompt", "conversation")."""
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * len(items)
    if not isinstance(params, (list, tuple)):
        raise TypeError(
            "sampling_params must be a SamplingParams or a list of them (one a "
            f"{what}), got {_kind(params)}"
        )
    if len(params) != len(items):
        raise ValueError(f"got {len(params)} SamplingParams for {len(items)} {what}s")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"{what} {i}: sampling params must be a SamplingParams, got {_kind(p)}")
    return list(params)


def _kind(value) -> str:
    """A value's type, with the fix for the dict a user may pass for SamplingParams."""
    if isinstance(value, dict):
        return "a dict; write SamplingParams(**d) for a dict d of its fields"
    return type(value).__name__

"""What benchmarks/precision.py measures on one engine, and how it compares two precisions'
outputs on the same weights.

- `timed(llm, prompts, out_lens, tag)`: greedy requests to exactly their output lengths,
  output tok/s over the whole run and over its decode phase (after every request has its
  first token), the prefill phase's seconds and steps (until then), the slowest steps,
  and the Triton specializations first met in the run (engine_runs.compile_log: each
  compiled, or read from Triton's disk cache, in the middle of the timed run);
- `probe(llm, prompts, max_tokens)`: greedy outputs with five logprobs a step, and
  `closeness_of(rows, ref)`: how close they are to a reference's on the same prompts
  (eval/closeness.py's rule, plus token agreement and the largest logprob difference);
- `dequantized_state(model, dtype)`: a quantized model's weights dequantized into the
  parameters a plain model of the same config holds, on the host, and
  `load_state(model, state)`: those weights copied into a built engine's plain model in
  place (its CUDA graphs keep reading the same tensors), its derived forms remade.
"""

from __future__ import annotations

import time

from benchmarks.card import sync
from benchmarks.engine_runs import compile_log

SLOWEST = 5  # the slowest steps a timed run reports


def timed(llm, prompts: list[list[int]], out_lens: list[int], tag: str) -> dict:
    """The requests greedy (ignore_eos) on `llm`'s engine, timed from the first added to
    the last token: wall, output tok/s, and the decode phase's tok/s (its output tokens
    but each request's first, over the time after every request had its first); the
    prefill phase's seconds and steps (`engine.step()` calls until every request had its
    first token), the SLOWEST steps ("step i: ms", i counting from 0) and the Triton
    specializations first met ("step i: the launch's repr")."""
    from batchgen import SamplingParams
    from batchgen.engine.memory import fewer_full_collections

    eng = llm.engine
    sync(eng.device)
    out0 = eng.stats.output_tokens
    first_all = None
    step_s: list[float] = []  # each step() call's wall time
    prefill_steps = None
    # as LLM.generate runs; compiles logged by the index of the step that met them
    with fewer_full_collections(), compile_log(lambda: len(step_s)) as compiles:
        start = time.perf_counter()
        for i, (p, n) in enumerate(zip(prompts, out_lens)):
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            eng.add_request(f"{tag}{i}", p, params)
        while eng.has_unfinished:
            t0 = time.perf_counter()
            eng.step()
            step_s.append(time.perf_counter() - t0)
            if first_all is None and all(r.output_token_ids for r in eng.requests.values()):
                first_all = time.perf_counter() - start
                prefill_steps = len(step_s)
    sync(eng.device)
    wall = time.perf_counter() - start
    first_all = wall if first_all is None else first_all
    out = eng.stats.output_tokens - out0
    slowest = sorted(range(len(step_s)), key=lambda i: -step_s[i])[:SLOWEST]
    return {
        "wall_s": wall,
        "output_tokens": out,
        "tok_s": out / wall,
        "prefill_phase_s": first_all,
        "prefill_phase_steps": len(step_s) if prefill_steps is None else prefill_steps,
        "decode_tok_s": (out - len(prompts)) / max(wall - first_all, 1e-9),
        "steps": len(step_s),
        "slowest_steps": [f"step {i}: {step_s[i] * 1000:.1f} ms" for i in slowest],
        "compiles": compiles,
    }


def probe(llm, prompts: list[list[int]], max_tokens: int) -> list:
    """Each prompt's greedy CompletionOutput to max_tokens (ignore_eos), five logprobs a
    step (the closeness rule's top five, and the chosen token's logprob)."""
    from batchgen import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def closeness_of(rows: list, ref: list) -> dict:
    """`rows` against `ref` (probe outputs of the same prompts): rows with identical
    tokens; token agreement (the tokens before each row's first difference, over all the
    reference's tokens); the largest difference between the two sides' logprobs of the
    same token at the same step before the first difference; rows that collapsed under
    the logprob-closeness rule (eval/closeness.py, no EOS: ignore_eos)."""
    from batchgen.eval import closeness

    agree = total = identical = collapsed = 0
    max_diff = 0.0
    for a, b in zip(rows, ref, strict=True):
        d = closeness.first_difference(a.token_ids, b.token_ids)
        common = min(len(a.token_ids), len(b.token_ids)) if d is None else d
        agree += common
        total += len(b.token_ids)
        identical += list(a.token_ids) == list(b.token_ids)
        for i, token in enumerate(a.token_ids[:common]):
            diff = abs(a.logprobs[i][token].logprob - b.logprobs[i][token].logprob)
            max_diff = max(max_diff, diff)
        collapsed += not closeness.close_under_top5(
            a.token_ids,
            b.token_ids,
            closeness.top5_from_logprobs(a.logprobs),
            closeness.top5_from_logprobs(b.logprobs),
            a_finish=a.finish_reason,
            b_finish=b.finish_reason,
        )
    return {
        "rows": len(ref),
        "identical_rows": identical,
        "token_agreement": agree / max(total, 1),
        "max_logprob_diff": max_diff,
        "collapsed_rows": collapsed,
    }


def dequantized_state(model, dtype) -> dict:
    """{parameter name: host tensor} of the plain model of `model`'s config: a quantized
    Linear's `weight` and quantized routed experts' `gate_up_proj` / `down_proj`
    dequantized and rounded once into `dtype` (an expert at a time, so the device needs
    no more than one expert's dense weight beside the engine), every other parameter as
    it is."""
    import torch

    from batchgen.layers.linear import Linear
    from batchgen.layers.routed_experts import RoutedExperts

    state: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    with torch.no_grad():
        for name, module in model.named_modules():
            prefix = f"{name}." if name else ""
            own = [prefix + p for p, _ in module.named_parameters(recurse=False)]
            if isinstance(module, Linear) and module.quant is not None:
                state[prefix + "weight"] = module.dense_weight().to(dtype).cpu()
                if module.bias is not None:
                    state[prefix + "bias"] = module.bias.detach().cpu()
            elif isinstance(module, RoutedExperts) and (
                module.fp8_block is not None or module.group_size is not None
            ):
                for param, w in zip(("gate_up_proj", "down_proj"), module.weights()):
                    dense = torch.empty(w.shape, dtype=dtype)
                    for e in range(w.shape[0]):
                        dense[e].copy_(w.expert(e, dtype))
                    state[prefix + param] = dense
            else:
                continue
            done.update(own)
        for name, p in model.named_parameters():
            if name not in done:
                state[name] = p.detach().cpu()
    return state


def load_state(model, state: dict) -> None:
    """Copy `state` (dequantized_state of a model of the same config) into `model`'s
    parameters in place, then remake what its layers derive from their weights
    (`after_load`, as the loader calls it) into the tensors they held, so a CUDA graph
    captured over them reads the new weights. ValueError where the parameters differ."""
    import torch

    params = dict(model.named_parameters())
    if set(params) != set(state):
        odd = sorted(set(params) ^ set(state))[:6]
        raise ValueError(f"the state is another model's: {odd} are not in both")
    with torch.no_grad():
        for name, p in params.items():
            if tuple(p.shape) != tuple(state[name].shape) or p.dtype != state[name].dtype:
                raise ValueError(
                    f"{name}: {tuple(state[name].shape)} {state[name].dtype} for "
                    f"{tuple(p.shape)} {p.dtype}"
                )
            p.copy_(state[name])
        for module in model.modules():
            after_load = getattr(module, "after_load", None)
            if after_load is None:
                continue
            held = dict(module._buffers)
            after_load()
            for key, old in held.items():
                new = module._buffers.get(key)
                if new is old:
                    continue
                if old is None or new is None or new.shape != old.shape:
                    raise ValueError(f"{type(module).__name__}.{key} changed form on reload")
                old.copy_(new)
                module._buffers[key] = old

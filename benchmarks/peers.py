"""The peers each workload is measured against, in the same process: transformers on
the same architecture (BENCHMARKS.md names which API each workload uses)."""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.card import sync

PEER_BATCH = 64  # W4's and W6's padded generate() batches


def continuous_batching(ckpt, prompts, out_lens, args) -> dict:
    """W1's peer: transformers' continuous batching with paged|sdpa, per-request
    max_new_tokens."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.bfloat16, attn_implementation="paged|sdpa"
    ).to(args.device)
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max(out_lens), eos_token_id=None, pad_token_id=0
    )
    mgr = model.init_continuous_batching(generation_config=gen)
    mgr.start()
    sync(args.device)
    start = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, out_lens)):
        mgr.add_request(p, request_id=f"r{i}", max_new_tokens=n)
    got = 0
    for _ in prompts:
        res = mgr.get_result(timeout=600)
        if res is None:
            break
        got += len(res.generated_tokens)
    wall = time.perf_counter() - start
    mgr.stop()
    return {"wall_s": wall, "output_tokens": got, "tok_s": got / wall}


def padded_generate(ckpt: Path, prompts, out_lens, args, batches: int | None = None) -> dict:
    """W4's and W6's peer: transformers' model of the checkpoint's architecture, random bf16 weights,
    generate() in padded batches of PEER_BATCH. `batches`: time only that many batches,
    after an untimed warm-up that takes the first-call costs (kernel compilation and
    autotuning): the first batch's prompts for two new tokens (the same prefill shapes,
    then a decode step), so the warm-up costs about a prefill, not a whole batch; batches
    of the same shapes run one after another, so their tok/s is the whole run's. None:
    every batch, timed from the first."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(ckpt))
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype)).eval()
    for p in model.parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, 0.0, 0.02)
    starts = list(range(0, len(prompts), PEER_BATCH))
    if batches is not None:
        _peer_batch(model, prompts, out_lens, starts[0], args, new_tokens=2)  # warm-up
        starts = starts[1 : 1 + batches]
    got = 0
    sync(args.device)
    start = time.perf_counter()
    for b in starts:
        got += _peer_batch(model, prompts, out_lens, b, args)
    sync(args.device)
    wall = time.perf_counter() - start
    result = {"wall_s": wall, "output_tokens": got, "tok_s": got / wall, "batch": PEER_BATCH}
    if batches is not None:
        result["timed_batches"] = len(starts)
    return result


def _peer_batch(model, prompts, out_lens, b: int, args, new_tokens: int | None = None) -> int:
    """generate() on the batch of prompts starting at b (for `new_tokens` each, default
    the batch's longest output length); its output tokens."""
    import torch

    batch = prompts[b : b + PEER_BATCH]
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=args.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=args.device)
    n = new_tokens or max(out_lens[b : b + PEER_BATCH])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return (out.shape[1] - width) * len(batch)


# W6's peer: which KDA transformers' Kimi Linear runs
KDA_FUNCTIONS = (
    "chunk_kimi_delta_attention",
    "recurrent_kimi_delta_attention",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


def torch_kda_for_the_peer() -> None:
    """--small (CPU): transformers binds fla-core's Triton KDA kernels where fla-core is
    installed, which need a GPU; unwrap them to its own torch code."""
    import inspect

    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    for name in KDA_FUNCTIONS:
        setattr(kimi, name, inspect.unwrap(getattr(kimi, name)))


def peer_kda_path() -> str | None:
    """Which KDA transformers' Kimi Linear runs here: "fla-core" or "torch" (None: no
    Kimi Linear in this transformers). transformers binds fla-core's kernel at import
    where fla-core is importable (its hub-kernel wrapper keeps it as `implementation`)."""
    import importlib.util
    import inspect

    try:
        from transformers.models.kimi_linear import modeling_kimi_linear as kimi
    except ImportError:
        return None
    fn = kimi.chunk_kimi_delta_attention
    if not hasattr(fn, "__wrapped__"):
        return "torch"
    impl = inspect.getclosurevars(fn).nonlocals.get("implementation")
    if impl is None:  # another transformers: fla-core is taken where importable
        return "fla-core" if importlib.util.find_spec("fla") else "torch"
    return "fla-core" if (getattr(impl, "__module__", "") or "").startswith("fla") else "torch"

"""A tiny random Llama with near-tie logits, for tests that must see a batch's rounding
change a token: its lm_head's row 256 + i is row i nudged by a millionth, so the logits
of the two twins differ by a few ulps and a greedy pick between them follows the
rounding of its row. Its generation config ends rows on EOS ids the model emits."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
from conftest import save_tiny_model


def save_twin_model(path: Path, prompts: list[list[int]]) -> str:
    """Write the model at `path`; EOS is id 2 and the two ids its greedy rows for
    `prompts` emit most (after their first two tokens). Returns the path."""
    from batchgen import LLM, SamplingParams

    model = save_tiny_model(path, "LlamaForCausalLM")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        w = model.lm_head.weight
        nudge = 1e-6 * w[:256].abs() * torch.randn(256, w.shape[1], generator=gen)
        w[256:] = w[:256] + nudge
    model.save_pretrained(path)
    llm = LLM(model=str(path), device="cpu", dtype="float32", deterministic=True)
    params = SamplingParams(temperature=0, max_tokens=8)
    outs = llm.generate(prompts, params, use_tqdm=False)
    common = Counter(t for o in outs for t in o.outputs[0].token_ids[2:]).most_common(2)
    file = Path(path) / "generation_config.json"
    generation = json.loads(file.read_text())
    generation["eos_token_id"] = [2, *(t for t, _ in common)]
    file.write_text(json.dumps(generation))
    return str(path)

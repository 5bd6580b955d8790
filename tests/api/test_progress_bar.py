"""The progress bar's output-token counter counts the tokens of its own call."""

from __future__ import annotations

import tqdm.auto
from conftest import save_tiny_model

from batchgen import LLM, SamplingParams
from batchgen.api import llm as llm_module


class _Bar:
    """Stands in for tqdm: keeps the last out_tok postfix of each bar."""

    last: list[int] = []

    def __init__(self, *args, **kwargs) -> None:
        _Bar.last.append(0)

    def update(self, n: int) -> None:
        pass

    def set_postfix(self, out_tok: int, refresh: bool = True) -> None:
        _Bar.last[-1] = out_tok

    def close(self) -> None:
        pass


def test_each_call_counts_its_own_output_tokens(tmp_path, monkeypatch):
    save_tiny_model(tmp_path, "LlamaForCausalLM")
    monkeypatch.setattr(tqdm.auto, "tqdm", _Bar)
    monkeypatch.setattr(llm_module, "progress_enabled", lambda: True)  # as on a terminal
    _Bar.last = []
    llm = LLM(model=str(tmp_path), device="cpu", dtype="float32", page_size=4)
    params = SamplingParams(temperature=0, max_tokens=6, stop=["w7"])
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12]]
    for _ in range(2):
        outs = llm.generate(prompts, params)
        assert _Bar.last[-1] == sum(len(o.outputs[0].token_ids) for o in outs)
    assert len(_Bar.last) == 2

"""Kimi Linear decode steps through DecodeGraphs' static buffers, as a graph replay sees
them (on the CPU each "replay" runs the captured forward eagerly; the MLA layers' Triton
kernels in Triton's interpreter, as test_deepseek_v3_triton sets up): the KDA layers
read and write each request's state slot from the static slot buffer, padding rows go to
the spare slot, and the outputs stay those of plain eager steps on the same backend
(tokens identical, logprobs within 1e-5, float32). The GPU test of the real capture is
tests/models/test_kimi_linear_gpu.py."""

from __future__ import annotations

import pytest
from eager_graphs import install_eager_graphs
from test_kimi_linear import RUN, save_tiny_kimi

from batchgen import LLM, SamplingParams

pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


def _graphs_on(llm) -> list[int]:
    """Eager-replay graphs on llm's runner, bound to its state pool (spare slot last)."""
    states = llm.engine.state_pool.layer_states()
    return install_eager_graphs(llm, RUN, linear_states=states, spare_slot=RUN["max_num_seqs"])


def test_graph_shaped_decode_matches_eager_steps(tmp_path):
    save_tiny_kimi(tmp_path, layer_types=["linear_attention"] * 3 + ["full_attention"])
    prompts = [[5, 9, 77, 300, 41], [8] * 9, [250, 3, 17]]  # decode in the bucket of 4
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0)  # EOS endings on
    kw = dict(model=str(tmp_path), num_kv_pages=64, attention_backend="triton", **RUN)
    eager = LLM(**kw)
    eager.engine.runner.split_plan = lambda n: 2
    expected = eager.generate(prompts, params, use_tqdm=False)
    llm = LLM(**kw)
    replays = _graphs_on(llm)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert 4 in replays, replays  # a padded bucket: the spare slot took its rows
    worst = 0.0
    for i, (a, b) in enumerate((x.outputs[0], y.outputs[0]) for x, y in zip(got, expected)):
        assert a.token_ids == b.token_ids, f"request {i}"
        for step, tok in enumerate(a.token_ids):
            worst = max(worst, abs(a.logprobs[step][tok].logprob - b.logprobs[step][tok].logprob))
    assert worst < 1e-5, f"largest logprob difference {worst:.2e}"


def test_replay_without_state_slots_is_refused(tmp_path):
    save_tiny_kimi(tmp_path, layer_types=["linear_attention", "full_attention"])
    llm = LLM(model=str(tmp_path), num_kv_pages=64, attention_backend="triton", **RUN)
    _graphs_on(llm)
    graphs = llm.engine.runner.graphs
    import numpy as np

    one = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match="state_slots"):
        graphs.run(one, one, one, np.zeros((1, 1), dtype=np.int64), llm.engine.runner.stage)

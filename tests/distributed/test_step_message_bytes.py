"""What rank 0 sends its workers a step does not grow with the tokens the ranks hold:
ten times longer prompts, the same decode steps, the same bytes a step (tensor parallel:
the step record carries diffs, a running request's new pages and tokens; attention data
parallel: a request's data goes out once, a tick's message is then empty)."""

from __future__ import annotations

import random

import pytest
from deepseek_checkpoints import CONFIGS, save_tiny_deepseek

from batchgen import LLM, SamplingParams
from batchgen.distributed.messages import DPStep
from batchgen.engine.tensor_parallel import TPStep

KW = dict(device="cpu", dtype="float32", page_size=4, max_model_len=1024, num_kv_pages=1200)
PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
RANKS = {
    "tp": (dict(tensor_parallel_size=2), TPStep),
    "dp": (dict(data_parallel_size=2, enable_expert_parallel=True), DPStep),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("deepseek_bytes")
    save_tiny_deepseek(path, **CONFIGS["moe_dense_first"])
    return str(path)


def _decode_step_bytes(path: str, kind: str, prompt_len: int) -> tuple[float, dict]:
    """Four requests of prompt_len tokens, prefilled in the first step; the mean bytes
    of the step messages of the 20 decode steps after the third, and the engine's
    metrics."""
    options, message = RANKS[kind]
    llm = LLM(path, **KW, **options)
    engine = llm.engine
    try:
        rng = random.Random(0)
        for i in range(4):
            engine.add_request(str(i), [rng.randint(3, 500) for _ in range(prompt_len)], PARAMS)
        workers = engine.executor if kind == "tp" else engine.workers
        for _ in range(3):
            engine.step()
        before = workers.message_metrics(message)
        for _ in range(20):
            engine.step()
        after = workers.message_metrics(message)
        metrics = engine.metrics()
    finally:
        engine.shutdown()
    steps = after["step_messages"] - before["step_messages"]
    assert steps == 20  # one step message a step
    size = after["step_message_bytes_total"] - before["step_message_bytes_total"]
    return size / steps, metrics


@pytest.mark.slow
def test_tensor_parallel_step_bytes_do_not_grow_with_tokens_held(checkpoint):
    short, metrics = _decode_step_bytes(checkpoint, "tp", 30)
    long, _ = _decode_step_bytes(checkpoint, "tp", 300)
    # the same fields; a position or page id past 255 pickles one byte wider
    assert short <= long <= 1.02 * short, (short, long)
    # the engine's metrics report them: one step message a step (warm-up's included)
    assert metrics["step_messages"] >= 23
    assert metrics["step_message_bytes_total"] >= 20 * short


@pytest.mark.slow
def test_data_parallel_step_bytes_do_not_grow_with_tokens_held(checkpoint):
    short, metrics = _decode_step_bytes(checkpoint, "dp", 30)
    long, _ = _decode_step_bytes(checkpoint, "dp", 300)
    assert long == short
    # the first tick carried the worker's requests (120 or 1,200 prompt tokens) once
    assert metrics["step_messages"] == 23
    assert metrics["step_message_bytes_total"] > 23 * short + 2 * 30

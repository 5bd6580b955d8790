"""metrics()["weight_bytes"]: what the engine's weights occupy on its device, as the
plan (`batchgen plan`) counts them from the config alone."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_tokenizer, tiny_config
from kimi_checkpoints import tiny_config as tiny_kimi

from batchgen import LLM
from batchgen.api.plan import PRECISIONS
from batchgen.api.plan_model import Parallel, model_weights, read_config
from batchgen.engine.memory import weight_bytes

KW = dict(device="cpu", num_kv_pages=32, max_model_len=64, page_size=4, load_format="dummy")


@pytest.mark.parametrize(
    "config",
    [
        tiny_config("Qwen2ForCausalLM"),  # tied embeddings: one storage, counted once
        tiny_kimi(["linear_attention", "full_attention"]),  # float32 A_log, router copy
    ],
    ids=["qwen2", "kimi_linear"],
)
def test_metrics_report_the_weights_bytes_the_plan_counts(tmp_path, config):
    config.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path, 512)
    llm = LLM(model=str(tmp_path), dtype="bfloat16", **KW)
    planned = sum(
        PRECISIONS[0].nbytes(w, False) for w in model_weights(read_config(tmp_path), Parallel())
    )
    assert llm.engine.metrics()["weight_bytes"] == planned


def test_views_of_one_storage_count_once_and_meta_tensors_by_size():
    model = torch.nn.Linear(8, 4, bias=False)
    model.register_buffer("rows", model.weight.data[:2])  # a view: no bytes of its own
    assert weight_bytes(model) == 8 * 4 * 4
    with torch.device("meta"):
        meta = torch.nn.Linear(8, 4)
    assert weight_bytes(meta) == (8 * 4 + 4) * 4

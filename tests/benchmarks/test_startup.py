"""benchmarks/startup.py on a tiny model: each loading phase of one build is timed, and
the script leaves loader and builder_load as it found them."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load
from conftest import save_tiny_model


@pytest.mark.parametrize("parse_each_read", [False, True])
def test_startup_times_each_phase_of_one_build(tmp_path, parse_each_read):
    startup = load("startup")
    from batchgen.engine import builder_load
    from batchgen.models import loader

    before = (loader.ModelSource.load_config, builder_load.build_model, builder_load.gguf_read_once)
    model = tmp_path / "model"
    save_tiny_model(model, "LlamaForCausalLM")
    args = ["--model", str(model), "--dtype", "float32", "--out", str(tmp_path)]
    assert startup.main(args + ["--parse-each-read"] * parse_each_read) == 0
    result = json.loads((tmp_path / "startup.json").read_text())
    phases = result["phases_s"]
    assert list(phases) == ["config", "tokenizer", "weights", "engine"]
    assert all(phases[name] > 0 for name in ("config", "tokenizer", "weights"))
    assert result["parse_each_read"] is parse_each_read and result["kv_pages"] > 0
    after = (loader.ModelSource.load_config, builder_load.build_model, builder_load.gguf_read_once)
    assert after == before

"""benchmarks/startup.py on a tiny model: each loading phase of one build is timed, and
the script leaves loader and builder_load as it found them."""

from __future__ import annotations

import json

import pytest
import torch
import triton
import triton.language as tl
from bench_scripts import load
from conftest import save_tiny_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


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


def test_a_named_model_builds_with_its_engine_phases(tmp_path):
    startup = load("startup")
    argv = ["--model", "kimi-w6", "--small", "--dtype", "float32", "--out", str(tmp_path)]
    argv += ["--first-requests"]
    assert startup.main(argv + ["--ckpt", str(tmp_path / "config")]) == 0
    result = json.loads((tmp_path / "startup.json").read_text())
    assert json.loads((tmp_path / "config" / "config.json").read_text())["model_type"] == (
        "kimi_linear"
    )
    engine = result["engine_s"]
    assert list(engine) == ["kernels", "plan", "tier_cost", "runner", "rest"]
    # the warm-up profile and the host tier's cost rule run forward steps on the CPU too
    assert engine["plan"] > 0 and engine["tier_cost"] > 0 and engine["runner"] > 0
    assert engine["kernels"] < 0.05  # nothing to make ready off CUDA
    assert sum(engine.values()) == pytest.approx(result["phases_s"]["engine"])
    assert result["compiles"] == 0  # the interpreter compiles nothing
    assert result["first_requests_s"] > 0 and result["first_requests_compiles"] == 0


def test_recording_needs_a_gpu(tmp_path):
    startup = load("startup")
    with pytest.raises(SystemExit, match="--device cuda"):
        startup.main(["--record-tuning", str(tmp_path / "t.json")])


BENCHES: list[int] = []


def _counting_bench(kernel_call, quantiles):
    kernel_call()
    BENCHES.append(1)
    return [float(len(BENCHES))] * len(quantiles)


@triton.autotune(
    configs=[triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 32}, num_warps=2)],
    key=["n"],
    do_bench=_counting_bench,
)
@triton.jit
def _negate(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, -tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def _negate_rows(n: int) -> None:
    x = torch.arange(n, dtype=torch.float32, device=DEVICE)
    out = torch.zeros_like(x)
    _negate[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, out, n)
    assert torch.equal(out, -x)


def test_a_recorded_table_round_trips_into_a_build_without_benchmarking(tmp_path):
    startup = load("startup")
    from batchgen.engine import kernel_prep
    from batchgen.kernels import autotune_table
    from batchgen.kernels.precompile import CompileWatch

    _negate.cache.clear()
    BENCHES.clear()
    _negate_rows(50)
    assert len(BENCHES) == 2
    path = tmp_path / "table.json"
    autotune_table.write_section(path, "Another GPU", {"autotune": {}})
    with CompileWatch(record=True) as watch:
        pass  # the interpreter compiles nothing: the section's compile list stays empty
    section = startup.record_tuning(path, "Test GPU", watch, prefixes=(__name__,))
    kernel_id = f"{__name__}:_negate"
    assert section["triton"] == triton.__version__ and section["compile"] == {}
    assert "fla-core" in section and section["capability"] is None  # no GPU here
    assert section["autotune"][kernel_id][0]["key"] == [50, "torch.float32", "torch.float32"]
    table = autotune_table.load_table(path)
    assert sorted(table["gpus"]) == ["Another GPU", "Test GPU"]
    _negate.cache.clear()
    BENCHES.clear()
    got = kernel_prep.apply_section(autotune_table.gpu_section(table, "Test GPU"), 2)
    assert got == (1, 0, 0)
    _negate_rows(50)
    assert BENCHES == []
    _negate.cache.clear()

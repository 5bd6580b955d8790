"""kernels/autotune_table.py on a tiny autotuned kernel (TRITON_INTERPRET=1 on the CPU):
a recorded decision fills the Autotuner's cache so that its key runs without
benchmarking, keys the table lacks (or another GPU's section) still autotune, and
malformed or foreign entries are skipped."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import triton
import triton.language as tl

from batchgen.kernels import autotune_table

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BENCHES: list[int] = []  # one entry per config the autotuner benchmarks


def _counting_bench(kernel_call, quantiles):
    """The autotuner's timing: each config benchmarked runs once and is counted; the
    first one benchmarked is the fastest."""
    kernel_call()
    BENCHES.append(1)
    return [float(len(BENCHES))] * len(quantiles)


@triton.autotune(
    configs=[
        triton.Config({"BLOCK": 16}, num_warps=1),
        triton.Config({"BLOCK": 32}, num_warps=2),
    ],
    key=["n"],
    do_bench=_counting_bench,
)
@triton.jit
def _double(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2, mask=mask)


KERNEL_ID = f"{__name__}:_double"
PREFIXES = (__name__,)


def run(n: int) -> None:
    x = torch.arange(n, dtype=torch.float32, device=DEVICE)
    out = torch.zeros_like(x)
    _double[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, out, n)
    assert torch.equal(out, x * 2)


@pytest.fixture(autouse=True)
def fresh_tuner():
    _double.cache.clear()
    BENCHES.clear()
    yield
    _double.cache.clear()


def test_a_recorded_decision_runs_without_benchmarking():
    run(40)
    assert len(BENCHES) == 2  # both configs benchmarked on the first meeting
    recorded = autotune_table.record_decisions(PREFIXES)
    assert list(recorded) == [KERNEL_ID]
    (entry,) = recorded[KERNEL_ID]
    assert entry["key"] == [40, "torch.float32", "torch.float32"]
    assert entry["config"]["kwargs"] == {"BLOCK": 16} and entry["config"]["num_warps"] == 1
    _double.cache.clear()
    BENCHES.clear()
    assert autotune_table.apply_decisions(json.loads(json.dumps(recorded))) == 1
    assert _double.cache[(40, "torch.float32", "torch.float32")] is _double.configs[0]
    run(40)
    assert BENCHES == []
    run(100)  # a key the table lacks autotunes as before
    assert len(BENCHES) == 2


def test_a_decision_never_replaces_one_the_process_made():
    run(40)
    recorded = autotune_table.record_decisions(PREFIXES)
    recorded[KERNEL_ID][0]["config"] = autotune_table.describe_config(_double.configs[1])
    assert autotune_table.apply_decisions(recorded) == 0
    assert _double.cache[(40, "torch.float32", "torch.float32")] is _double.configs[0]


def test_another_gpus_section_leaves_the_kernel_autotuning(tmp_path):
    run(40)
    path = tmp_path / "table.json"
    autotune_table.write_section(
        path, "GPU A", {"autotune": autotune_table.record_decisions(PREFIXES)}
    )
    autotune_table.write_section(path, "GPU C", {"autotune": {}})
    table = autotune_table.load_table(path)
    assert sorted(table["gpus"]) == ["GPU A", "GPU C"]  # the first section kept
    _double.cache.clear()
    BENCHES.clear()
    section = autotune_table.gpu_section(table, "GPU B")
    assert section == {}
    assert autotune_table.apply_decisions(section.get("autotune", {})) == 0
    run(40)
    assert len(BENCHES) == 2
    _double.cache.clear()
    BENCHES.clear()
    assert (
        autotune_table.apply_decisions(autotune_table.gpu_section(table, "GPU A")["autotune"]) == 1
    )
    run(40)
    assert BENCHES == []


def test_a_gpu_without_a_section_takes_one_of_its_compute_capability(tmp_path):
    path = tmp_path / "table.json"
    autotune_table.write_section(path, "GPU H", {"capability": "9.0", "autotune": {"h": []}})
    autotune_table.write_section(path, "GPU A", {"capability": "8.0", "autotune": {"a": []}})
    autotune_table.write_section(path, "GPU G", {"capability": "9.0", "autotune": {"g": []}})
    table = autotune_table.load_table(path)
    assert autotune_table.gpu_section(table, "GPU A", "9.0")["autotune"] == {"a": []}  # its own
    assert autotune_table.gpu_section(table, "GPU X", "9.0")["autotune"] == {"g": []}  # by name
    assert autotune_table.gpu_section(table, "GPU X", "8.0")["autotune"] == {"a": []}
    assert autotune_table.gpu_section(table, "GPU X", "10.0") == {}
    assert autotune_table.gpu_section(table, "GPU X") == {}


@pytest.mark.parametrize(
    "text",
    ["{not json", "[1, 2]", json.dumps({"format": 99, "gpus": {}}), json.dumps({"format": 1})],
)
def test_a_malformed_file_reads_as_an_empty_table(tmp_path, text):
    path = tmp_path / "table.json"
    path.write_text(text)
    assert autotune_table.load_table(path) == {"format": 1, "gpus": {}}
    assert autotune_table.load_table(tmp_path / "missing.json")["gpus"] == {}


def test_malformed_and_foreign_entries_are_skipped_and_the_good_one_applied():
    good = {"key": [40, "torch.float32", "torch.float32"], "config": _described(0)}
    decisions = {
        KERNEL_ID: [
            {
                "key": [41, "torch.float32", "torch.float32"],
                "config": dict(_described(0), num_warps=8),
            },
            {"key": [42, {"a": 1}], "config": _described(0)},
            {"key": "43", "config": _described(0)},
            {"key": [44, "torch.float32", "torch.float32"]},
            "not an entry",
            good,
        ],
        f"{__name__}:no_such_kernel": [good],
        "no.such.module:_double": [good],
        "batchgen.kernels.no_such_module:_double": [good],  # imports nothing, raises nothing
        f"{__name__}:run": [good],  # not a kernel
        7: [good],
    }
    assert autotune_table.apply_decisions(decisions) == 1
    assert list(_double.cache) == [(40, "torch.float32", "torch.float32")]
    assert autotune_table.apply_decisions({KERNEL_ID: "not a list"}) == 0
    assert autotune_table.apply_decisions(["not", "a", "mapping"]) == 0


def _described(i: int) -> dict:
    return autotune_table.describe_config(_double.configs[i])


def test_autotuning_stays_on_disk_for_the_block_only(monkeypatch):
    """Inside: the knob and its environment variable on, every Autotuner made before
    kept on disk, and so is one made meanwhile (Triton reads the knob then; the
    interpreter is turned off while it is made, as on a GPU). After: each as before."""
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    knob = triton.knobs.autotuning.cache
    _double.cache_results = False
    module = sys.modules[__name__]
    with autotune_table.autotuning_on_disk(PREFIXES) as turned_on:
        assert turned_on
        assert triton.knobs.autotuning.cache and os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
        assert _double.cache_results
        with triton.knobs.runtime.scope():
            triton.knobs.runtime.interpret = False
            made = triton.autotune(configs=_double.configs, key=["n"])(_double.fn)
        monkeypatch.setattr(module, "_made_meanwhile", made, raising=False)
        assert made.cache_results
    assert triton.knobs.autotuning.cache == knob
    assert "TRITON_CACHE_AUTOTUNING" not in os.environ
    assert not _double.cache_results and not made.cache_results


def test_a_users_choice_of_autotune_caching_is_left_alone(monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    _double.cache_results = False
    with autotune_table.autotuning_on_disk(PREFIXES) as turned_on:
        assert not turned_on and not _double.cache_results
        assert not triton.knobs.autotuning.cache
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "0"

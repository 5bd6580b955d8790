"""kernels/precompile.py on the CPU: the compile watch counts, records and logs compiles
through Triton's post-compile hook and nests; the recorded specializations become jobs
for the loaded kernels only; the jobs compile concurrently, a failure left to the
kernel's first launch. (The interpreter compiles nothing: Triton's hook is called as a
compile calls it, and the compile step is passed in.)"""

from __future__ import annotations

import json
import logging
import threading
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from batchgen.kernels import precompile
from batchgen.kernels.precompile import CompileWatch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class _Preloadable:
    """Stands for a JITFunction: what preload_jobs needs of one."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    def preload(self, data: str) -> None:
        self.loaded.append(data)


_kernel = _Preloadable()
_wrapped = SimpleNamespace(fn=_kernel)  # as an Autotuner holds its kernel


def _spec(name: str, block: int) -> str:
    options = {"num_warps": 4, "extern_libs": [["libdevice", "/somewhere/libdevice.10.bc"]]}
    key = f"k{block}"  # Triton's cache key: the specialization's
    return json.dumps({"name": name, "constant_vals": [block], "options": options, "key": key})


def _compile(watch_hook, module: str, name: str, block: int):
    """Call the hook as Triton's _do_compile calls its post-compile hook."""
    fn = SimpleNamespace(module=module, name=name, jit_function=None)
    compile = {"key": f"k{block}", "specialization_data": _spec(name, block)}
    return watch_hook(
        key=f"k{block}",
        repr=name,
        fn=fn,
        compile=compile,
        is_manual_warmup=False,
        already_compiled=False,
    )


def _plan(kernel_id: str, name: str, *blocks: int) -> dict:
    """A table's compile section listing `blocks` of one kernel."""
    return {kernel_id: [json.loads(_spec(name, b)) for b in blocks]}


def test_the_watch_counts_records_and_logs_each_compile(caplog):
    seen = []
    outer_hook = triton.knobs.runtime.jit_post_compile_hook
    with caplog.at_level(logging.INFO, logger=precompile.__name__):
        with CompileWatch(record=True) as outer:
            with CompileWatch(expected=_plan("mod.a:kern", "kern", 16, 32, 64)) as inner:
                hook = triton.knobs.runtime.jit_post_compile_hook
                assert hook == inner.hook
                _compile(hook, "mod.a", "kern", 16)
                _compile(hook, "mod.a", "kern", 32)
                seen.append(triton.knobs.runtime.jit_post_compile_hook)
            assert triton.knobs.runtime.jit_post_compile_hook == outer.hook
            _compile(triton.knobs.runtime.jit_post_compile_hook, "mod.b", "other", 8)
    assert triton.knobs.runtime.jit_post_compile_hook is outer_hook
    assert (inner.count, outer.count) == (2, 3)  # the inner watch called the outer's hook
    assert inner.specs == {}
    assert sorted(outer.specs) == ["mod.a:kern", "mod.b:other"]
    assert [s["constant_vals"] for s in outer.specs["mod.a:kern"]] == [[16], [32]]
    assert all("extern_libs" not in s["options"] for s in outer.specs["mod.a:kern"])
    assert outer.specs["mod.b:other"][0]["options"] == {"num_warps": 4}
    lines = [r.getMessage() for r in caplog.records]
    assert "building: compiling kernels 2/3" in lines  # the inner watch's last line
    assert "building: compiling kernels 3" in lines


def test_the_count_of_planned_compiles_never_passes_the_plan(caplog):
    """Compiles the plan does not list (another kernel, another key, a listed one met
    again) are counted apart: N of "N/M" counts each listed compile once."""
    with caplog.at_level(logging.INFO, logger=precompile.__name__):
        with CompileWatch() as watch:
            watch.expect(_plan("mod.a:kern", "kern", 16, 32))
            hook = triton.knobs.runtime.jit_post_compile_hook
            _compile(hook, "mod.a", "kern", 16)
            for block in (8, 16):  # a key the plan lacks; the first one again
                _compile(hook, "mod.a", "kern", block)
            _compile(hook, "mod.b", "kern", 32)  # a listed key of another kernel
            _compile(hook, "mod.a", "kern", 32)
    assert (watch.count, watch.planned_done, watch.expected) == (5, 2, 2)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "building: compiling kernels 1/2"  # the first compile logs at once
    assert lines[-1] == "building: compiling kernels 2/2 (+3 not in the plan)"
    for line in lines:
        done, total = line.split()[3].split("/")
        assert int(done) <= int(total)


def test_planned_compiles_count_each_listed_entry_under_its_key():
    plan = _plan("m:a", "a", 16, 16, 32)
    plan["m:b"] = [{"no": "key"}, "not a spec"]
    plan["m:c"] = "not a list"
    planned = precompile.planned_compiles(plan)
    assert planned == {
        ("m:a", '"k16"'): 2,
        ("m:a", '"k32"'): 1,
        ("m:b", "null"): 2,
    }
    assert precompile.planned_compiles(["not", "a", "mapping"]) == {}


def test_jobs_name_loaded_kernels_only_each_specialization_once():
    spec = json.loads(_spec("_kernel", 16))
    other = json.loads(_spec("_kernel", 32))
    specs = {
        f"{__name__}:_wrapped": [spec, other, spec, "not a spec"],
        f"{__name__}:_no_such": [spec],
        "not.loaded.module:_kernel": [spec],
        f"{__name__}:_compile": [spec],  # a function, not a kernel
        f"{__name__}:_kernel": "not a list",
    }
    jobs = precompile.preload_jobs(specs)
    assert [(kid, kernel) for kid, kernel, _ in jobs] == [(f"{__name__}:_wrapped", _kernel)] * 2
    assert [s["constant_vals"] for _, _, s in jobs] == [[16], [32]]
    assert precompile.preload_jobs(["not", "a", "mapping"]) == []


class _Ordered(_Preloadable):
    """A kernel whose arguments are not in alphabetical order."""

    arg_names = ["x_ptr", "out_ptr", "stride", "eps", "BLOCK"]


_ordered = _Ordered()


def test_jobs_from_a_written_table_preload_signatures_in_argument_order(tmp_path):
    """The table is written with sorted keys; Triton's preload reads the signature by
    position, so the job must hand it over in the kernel's argument order again."""
    from batchgen.kernels.autotune_table import gpu_section, load_table, write_section

    types = ["*bf16", "*bf16", "i32", "fp32", "constexpr"]
    spec = json.loads(_spec("_ordered", 16))
    spec["signature"] = dict(zip(_Ordered.arg_names, types))
    path = tmp_path / "table.json"
    write_section(path, "GPU", {"compile": {f"{__name__}:_ordered": [spec]}})
    written = gpu_section(load_table(path), "GPU")["compile"][f"{__name__}:_ordered"][0]
    assert list(written["signature"]) == sorted(_Ordered.arg_names)  # what the file holds
    [(_, kernel, job)] = precompile.preload_jobs({f"{__name__}:_ordered": [written]})
    precompile._preload(kernel, job)
    loaded = json.loads(_ordered.loaded[-1])["signature"]
    assert list(loaded.items()) == list(zip(_Ordered.arg_names, types))
    # a signature that does not name the kernel's arguments is passed on untouched
    odd = {**written, "signature": {"a": "i32", "b": "fp32"}}
    assert precompile.preload_jobs({f"{__name__}:_ordered": [odd]})[0][2] == odd


def test_the_jobs_compile_concurrently_and_a_failure_is_left_out():
    both_running = threading.Barrier(2, timeout=10)  # breaks unless two run at once
    started = []

    def compile_one(kernel, spec):
        started.append(threading.current_thread().name)
        if spec["constant_vals"] == [0]:
            raise RuntimeError("does not compile")
        if spec["constant_vals"][0] < 3:
            both_running.wait()
        kernel.preload(json.dumps(spec))

    kernel = _Preloadable()
    jobs = [("k", kernel, json.loads(_spec("_kernel", b))) for b in (1, 2, 0, 3)]
    before = []
    prepared = lambda: before.append(threading.current_thread().name)  # noqa: E731
    done = precompile.precompile(jobs, 4, compile_one, before=prepared)
    assert done == 3
    assert sorted(json.loads(d)["constant_vals"][0] for d in kernel.loaded) == [1, 2, 3]
    assert len(set(started)) >= 2 and set(started) <= set(before)  # each thread set up first
    assert precompile.precompile([], 4, compile_one) == 0


def test_portable_spec_refuses_what_is_not_a_specialization():
    assert precompile.portable_spec(None) is None
    assert precompile.portable_spec("{oops") is None
    assert precompile.portable_spec(json.dumps({"options": 3})) is None
    assert precompile.portable_spec(_spec("k", 4))["constant_vals"] == [4]


def _timing(kernel_call, quantiles):
    kernel_call()
    _timing.calls = getattr(_timing, "calls", 0) + 1
    return [float(_timing.calls)] * len(quantiles)  # the first config benchmarked wins


@triton.autotune(
    configs=[triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 32}, num_warps=2)],
    key=["n"],
    do_bench=_timing,
)
@triton.jit
def _copy(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def _compiled(block, num_warps, num_stages=3, wrapped=False):
    """A specialization of _copy as Triton records it: BLOCK is argument 3."""
    value = {"constexpr": block} if wrapped else block
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return {"constant_keys": [[3]], "constant_vals": [value], "options": options}


def test_the_recorded_compiles_keep_only_the_configs_an_autotuner_chose():
    _copy.cache.clear()
    x = torch.arange(20, dtype=torch.float32, device=DEVICE)
    out = torch.zeros_like(x)
    _copy[lambda meta: (triton.cdiv(20, meta["BLOCK"]),)](x, out, 20)
    assert torch.equal(out, x) and _copy.cache[(20, "torch.float32", "torch.float32")].kwargs == {
        "BLOCK": 16
    }
    specs = {
        f"{__name__}:_copy": [
            _compiled(16, 1),  # the chosen config
            _compiled(32, 2),  # benchmarked, not chosen
            _compiled(16, 2),  # another launch option than the chosen one's
            _compiled(16, 1, wrapped=True),  # a tl.constexpr value as Triton serialises it
            {"options": {}},  # malformed
        ],
        f"{__name__}:_kernel": [{"anything": 1}],  # not autotuned: kept whole
    }
    kept = precompile.chosen_only(specs)
    assert kept[f"{__name__}:_copy"] == [_compiled(16, 1), _compiled(16, 1, wrapped=True)]
    assert kept[f"{__name__}:_kernel"] == [{"anything": 1}]
    _copy.cache.clear()
    assert f"{__name__}:_copy" not in precompile.chosen_only(specs)  # nothing chosen yet

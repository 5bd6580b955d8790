"""Triton compiles counted, recorded, and made again in parallel before they are needed.

A Triton kernel compiles once per specialization (its constexprs, the dtypes and
alignment of its arguments, its launch options) the first time a launch meets it; the
engine's warm-up meets them one after another. Triton can compile one from data alone:
`JITFunction.preload(specialization_data)` (the JSON its compile hooks hand over, Triton
3.6 and 3.9 alike) compiles it, fills the kernel's in-process cache and Triton's disk
cache, and its compiler does its work in C++ and in ptxas.

    CompileWatch(expected, record)  while entered, every compile is counted and logged
                                    ("building: compiling kernels 12/40", the planned
                                    ones among those `expected`) and, with record, its
                                    specialization kept under its kernel id
    chosen_only(specs)              the recorded compiles less those of configs that an
                                    autotuner benchmarked and did not choose
    preload_jobs(specs)             [(kernel id, kernel, specialization)] of the loaded
                                    kernels among {kernel id: [specialization]}, each
                                    signature put back in its kernel's argument order
    precompile(jobs, workers, ...)  each job compiled on a thread pool, returns how many
                                    succeeded (a failure: debug log, it compiles at its
                                    first launch as before)

A recorded specialization leaves out the compiler's library paths ("extern_libs"), so
that the local install's are used; Triton hashes those libraries by content, so a
precompiled kernel meets the launch's entry in the disk cache wherever it was recorded.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed

from batchgen.kernels.autotune_table import find_autotuner, resolve

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 1.0  # at most one progress line a second (and the last)


class CompileWatch:
    """While entered: counts each Triton compile of this process (any thread) and logs
    "building: compiling kernels N/M" at INFO, at most once every PROGRESS_EVERY_S;
    with `record`, keeps each compile's specialization in `specs` {kernel id: [...]}.
    Installs Triton's jit_post_compile_hook and calls the hook it found there too; puts
    that one back on exit, so watches nest.

    M is how many compiles `expected` (or `expect(...)`) lists, in `specs`' form (a
    table's "compile" section); N counts the compiles of this process that are listed
    ones (the same kernel id and Triton cache key, each listed entry met at most once),
    so N never passes M. Compiles the plan does not list (a key the table has no
    decision for, whose configs the tuner compiles to benchmark; a specialization the
    recording build never met) are counted apart and logged as "(+K not in the plan)".
    With nothing expected the line is "building: compiling kernels N"."""

    def __init__(self, expected: dict | None = None, record: bool = False) -> None:
        self.record = record
        self.count = 0
        self.planned_done = 0
        self.specs: dict[str, list[dict]] = {}
        self._planned: Counter = Counter()
        self._met: Counter = Counter()
        self._lock = threading.Lock()
        self._last_log = 0.0
        self._previous = None
        self.expect(expected)

    def expect(self, specs: dict | None) -> None:
        """The compiles planned, {kernel id: [specialization]} (M of the progress line);
        called before they start."""
        planned = planned_compiles(specs)
        with self._lock:
            self._planned = planned
            self._met = Counter()
            self.planned_done = 0

    @property
    def expected(self) -> int:
        """How many compiles the plan lists (M)."""
        return sum(self._planned.values())

    def __enter__(self) -> CompileWatch:
        import triton

        self._previous = triton.knobs.runtime.jit_post_compile_hook
        triton.knobs.runtime.jit_post_compile_hook = self.hook
        return self

    def __exit__(self, *exc) -> None:
        import triton

        triton.knobs.runtime.jit_post_compile_hook = self._previous
        if self.count:
            self._log(time.monotonic())

    def hook(self, *, key, fn, compile, **kwargs):
        """Triton's post-compile hook: `fn` names the kernel (module, name), `key` is the
        compile's cache key, `compile` carries its specialization_data."""
        kernel_id = f"{fn.module}:{fn.name}"
        with self._lock:
            self.count += 1
            planned = (kernel_id, _key_text(key))
            if self._met[planned] < self._planned[planned]:
                self._met[planned] += 1
                self.planned_done += 1
            if self.record:
                spec = portable_spec(compile.get("specialization_data"))
                if spec is not None:
                    self.specs.setdefault(kernel_id, []).append(spec)
            now = time.monotonic()
            if now - self._last_log >= PROGRESS_EVERY_S:
                self._log(now)
        if self._previous is not None:
            return self._previous(key=key, fn=fn, compile=compile, **kwargs)
        return None

    def _log(self, now: float) -> None:
        self._last_log = now
        if not self._planned:
            logger.info("building: compiling kernels %d", self.count)
            return
        others = self.count - self.planned_done
        logger.info(
            "building: compiling kernels %d/%d%s",
            self.planned_done,
            self.expected,
            f" (+{others} not in the plan)" if others else "",
        )


def planned_compiles(specs) -> Counter:
    """{(kernel id, cache key as text): how many times listed} over the specializations
    of `specs` ({kernel id: [specialization]}); an entry that is not a dict counts under
    no key (no compile matches it)."""
    planned = Counter()
    if not isinstance(specs, dict):
        return planned
    for kernel_id, entries in specs.items():
        if isinstance(entries, list):
            for spec in entries:
                key = spec.get("key") if isinstance(spec, dict) else None
                planned[(kernel_id, _key_text(key))] += 1
    return planned


def _key_text(key) -> str:
    """A Triton cache key as text that is the same for the key a compile hands its hook
    and for the one its recorded specialization carries (JSON turns tuples to lists)."""
    return json.dumps(key, sort_keys=True, default=str)


def portable_spec(data: str | None) -> dict | None:
    """A compile's specialization_data as a dict without the machine's library paths;
    None where it is not JSON."""
    try:
        spec = json.loads(data)
    except (TypeError, ValueError):
        return None
    if not isinstance(spec, dict) or not isinstance(spec.get("options"), dict):
        return None
    spec["options"].pop("extern_libs", None)
    return spec


def chosen_only(specs: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """`specs` (CompileWatch.specs) less the compiles an autotuner made to benchmark a
    config it did not choose: a kept specialization of an autotuned kernel has the
    constexprs and the num_warps/num_stages of a config in its Autotuner's cache. Kernels
    that are not autotuned (or have one config) keep every compile."""
    kept = {}
    for kernel_id, entries in specs.items():
        tuner = find_autotuner(resolve(kernel_id))
        if tuner is None or len(tuner.configs) <= 1:
            kept[kernel_id] = entries
            continue
        chosen = list({id(c): c for c in tuner.cache.values()}.values())
        names = list(tuner.arg_names)
        mine = [s for s in entries if any(_made_with(s, c, names) for c in chosen)]
        if mine:
            kept[kernel_id] = mine
    return kept


def _made_with(spec: dict, config, arg_names: list[str]) -> bool:
    """Whether the specialization was compiled with `config`'s meta-parameters."""
    try:
        constants = {tuple(k): v for k, v in zip(spec["constant_keys"], spec["constant_vals"])}
        options = spec["options"]
    except (KeyError, TypeError):
        return False
    for name, value in config.kwargs.items():
        if name not in arg_names:
            return False
        got = constants.get((arg_names.index(name),))
        if isinstance(got, dict):
            got = got.get("constexpr")
        if got != value:
            return False
    for field in ("num_warps", "num_stages"):
        want = getattr(config, field, None)
        if want is not None and options.get(field) != want:
            return False
    return True


def preload_jobs(specs: dict) -> list[tuple[str, object, dict]]:
    """(kernel id, the kernel that preloads it, specialization) for each recorded
    specialization of a kernel loaded in this process (others: debug log), each once."""
    jobs = []
    if not isinstance(specs, dict):
        return jobs
    for kernel_id, entries in specs.items():
        kernel = _preloadable(resolve(kernel_id)) if isinstance(kernel_id, str) else None
        if kernel is None or not isinstance(entries, list):
            logger.debug("precompile: %r is not a loaded Triton kernel", kernel_id)
            continue
        seen = set()
        for spec in entries:
            text = json.dumps(spec, sort_keys=True)
            if isinstance(spec, dict) and text not in seen:
                seen.add(text)
                jobs.append((kernel_id, kernel, in_argument_order(spec, kernel)))
    return jobs


def in_argument_order(spec: dict, kernel) -> dict:
    """`spec` with its signature's entries in `kernel`'s argument order. Triton's preload
    takes the signature's types by position, and a table written with sorted keys holds
    them alphabetically: preloaded so, a kernel is compiled for its arguments' types in
    the wrong places (on an H100: scalars read from tensors, illegal addresses). A
    signature whose names are not the kernel's arguments is left as it is."""
    signature, names = spec.get("signature"), getattr(kernel, "arg_names", None)
    if not isinstance(signature, dict) or not names or set(signature) != set(names):
        return spec
    return {**spec, "signature": {name: signature[name] for name in names}}


def _preloadable(kernel):
    """The object under `kernel`'s wrappers that has `preload` (a JITFunction)."""
    for _ in range(8):
        if kernel is None or callable(getattr(kernel, "preload", None)):
            return kernel
        kernel = getattr(kernel, "fn", None)
    return None


def precompile(
    jobs: list[tuple[str, object, dict]],
    workers: int,
    compile_one: Callable[[object, dict], None] | None = None,
    before: Callable[[], None] | None = None,
) -> int:
    """Compile every job on `workers` threads; returns how many compiled. `compile_one`
    (kernel, spec) defaults to `kernel.preload(json)`; `before` runs once on each worker
    thread first (the CUDA device to compile for is per thread)."""
    if not jobs:
        return 0
    if compile_one is None:
        compile_one = _preload
        for kernel in {id(k): k for _, k, _ in jobs}.values():
            _bind_device(kernel)
    done = 0
    with ThreadPoolExecutor(max_workers=max(1, workers), initializer=before) as pool:
        futures = {pool.submit(compile_one, kernel, spec): kid for kid, kernel, spec in jobs}
        for future in as_completed(futures):
            try:
                future.result()
            except Exception as exc:  # noqa: BLE001 - it compiles at its first launch instead
                logger.debug("precompile of %s failed: %s", futures[future], exc)
            else:
                done += 1
    return done


def _bind_device(kernel) -> None:
    """Make the kernel's per-device state for the current device here, on one thread:
    made by two workers at once, one's compiled kernels would land in a copy the other
    replaced."""
    from triton.runtime.driver import driver

    kernel.device_caches[driver.active.get_current_device()]


def _preload(kernel, spec: dict) -> None:
    kernel.preload(json.dumps(spec))

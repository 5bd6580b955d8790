"""Triton autotuning decisions shipped as data, so that a fresh machine does not benchmark.

A `triton.autotune`d kernel benchmarks every config of its space the first time it meets
a new key (the values of its `key` arguments, then the dtype of each tensor argument as
a string, e.g. (4096, 128, 'torch.bfloat16')) and keeps the winner in `Autotuner.cache`,
a dict {key tuple: Config} that lives as long as the process. fla-core's KDA and norm
kernels (its `CachedAutotuner` subclasses Triton's and calls its `run`) took most of
W6's 245 s first build on a fresh H100 this way. Triton 3.6 and 3.9 build the key alike
(`Autotuner.run`), and both read `.cache`, `.configs`, `.keys` and `.arg_names`.

    record_decisions(prefixes) -> {kernel id: [{"key": [...], "config": {...}}]}
        the cache of every Autotuner in the loaded modules under `prefixes`
    apply_decisions(decisions) -> number of cache entries filled
        each entry put into its Autotuner's cache where that key has none, as the
        Config of the Autotuner's own space that the entry describes

A kernel id is "module:name", the module a kernel's function was defined in and the
name it is bound to there. The table file (TABLE_PATH, package data) holds one section
per GPU name (torch.cuda.get_device_name()); a GPU without one takes a section recorded
on a GPU of its compute capability:

    {"format": 1, "gpus": {"NVIDIA H100 80GB HBM3": {"triton": "3.6.0", "fla-core": ...,
        "capability": "9.0", "autotune": {kernel id: [entries]},
        "compile": {kernel id: [specialization]}}}}

("compile" is precompile.py's). Anything the running process cannot use (an unknown
GPU, a module not loaded, a kernel or config that is no longer there, a malformed entry)
is skipped with a debug log: that key autotunes as it would without the table.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

TABLE_PATH = Path(__file__).with_name("autotune_table.json")
TABLE_FORMAT = 1
CONFIG_FIELDS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
SCALARS = (bool, int, float, str, type(None))
KERNEL_PACKAGES = ("fla", "batchgen")  # whose autotuned kernels the table covers


def load_table(path: Path | None = None) -> dict:
    """The table at `path` (default TABLE_PATH) as {"format", "gpus"}; an empty one where
    the file is missing, unreadable or not a table of TABLE_FORMAT."""
    path = TABLE_PATH if path is None else Path(path)
    empty = {"format": TABLE_FORMAT, "gpus": {}}
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        logger.debug("autotune table %s not read: %s", path, exc)
        return empty
    if not isinstance(table, dict) or table.get("format") != TABLE_FORMAT:
        logger.debug("autotune table %s is not of format %d", path, TABLE_FORMAT)
        return empty
    if not isinstance(table.get("gpus"), dict):
        return empty
    return table


def gpu_section(table: dict, gpu: str, capability: str | None = None) -> dict:
    """The table's section for the GPU named `gpu`; where it has none, the first (by name)
    recorded on a GPU of the same compute `capability` ("9.0": an H200 takes an H100's
    decisions; the kernels compile for the same architecture); {} where neither exists
    (or the section is malformed)."""
    sections = {
        name: section
        for name, section in table.get("gpus", {}).items()
        if isinstance(section, dict)
    }
    if gpu in sections:
        return sections[gpu]
    for name in sorted(sections):
        if capability is not None and sections[name].get("capability") == capability:
            logger.info(
                "no autotune table section for %s: using %s's (compute capability %s)",
                gpu,
                name,
                capability,
            )
            return sections[name]
    return {}


def write_section(path: Path, gpu: str, section: dict) -> None:
    """Write `section` as `gpu`'s into the table at `path`, keeping the other GPUs'."""
    table = load_table(path)
    table["gpus"][gpu] = section
    Path(path).write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def kernel_interfaces(prefixes: tuple[str, ...]):
    """(kernel id, module attribute) for every Triton kernel object (a JITFunction or an
    Autotuner/Heuristics around one) bound at the top level of a loaded module whose name
    starts with one of `prefixes`, in the module its function was defined in."""
    from triton.runtime.jit import KernelInterface

    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(prefixes):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, KernelInterface) and _defined_in(value, name):
                yield f"{name}:{attr}", value


def _defined_in(kernel, module_name: str) -> bool:
    base = _base_function(kernel)
    return base is not None and getattr(base, "__module__", None) == module_name


def _base_function(kernel):
    """The Python function under a chain of Triton wrappers (each holds the next in .fn)."""
    for _ in range(8):
        if kernel is None or inspect.isfunction(kernel):
            return kernel
        kernel = getattr(kernel, "fn", None)
    return None


def find_autotuner(kernel):
    """The Autotuner in `kernel`'s chain of wrappers (itself, or the .fn of a
    Heuristics), or None."""
    from triton.runtime.autotuner import Autotuner

    for _ in range(8):
        if isinstance(kernel, Autotuner):
            return kernel
        kernel = getattr(kernel, "fn", None)
        if kernel is None:
            return None
    return None


def resolve(kernel_id: str):
    """The kernel object a kernel id names; None where its module has no such name or is
    not loaded. A module of a package in KERNEL_PACKAGES that is not loaded yet while its
    package is (fla-core imports some kernels' modules only when first used) is imported
    here, so that its kernels take their decisions before that first use."""
    module_name, _, attr = kernel_id.partition(":")
    module = sys.modules.get(module_name)
    top = module_name.partition(".")[0]
    if module is None and top in KERNEL_PACKAGES and top in sys.modules:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - another version of the package
            logger.debug("kernel module %s not importable: %s", module_name, exc)
    return None if module is None or not attr else getattr(module, attr, None)


def describe_config(config) -> dict | None:
    """A Config as JSON data ({"kwargs", "num_warps", ...}); None where a value is not a
    JSON scalar or the config has a pre_hook (which data cannot carry)."""
    if getattr(config, "pre_hook", None) is not None:
        return None
    kwargs = dict(getattr(config, "kwargs", {}))
    fields = {f: getattr(config, f, None) for f in CONFIG_FIELDS}
    if not all(isinstance(v, SCALARS) for v in [*kwargs.values(), *fields.values()]):
        return None
    return {"kwargs": kwargs, **fields}


def record_decisions(prefixes: tuple[str, ...] = KERNEL_PACKAGES) -> dict:
    """{kernel id: [{"key": [...], "config": {...}}]}: every autotuned kernel's cache in
    the loaded modules under `prefixes`, keys of JSON scalars only (the others, and
    configs data cannot describe, left out with a debug log)."""
    decisions: dict[str, list] = {}
    for kernel_id, kernel in kernel_interfaces(prefixes):
        tuner = find_autotuner(kernel)
        if tuner is None or len(getattr(tuner, "configs", ())) <= 1:
            continue
        entries = []
        for key, config in dict(tuner.cache).items():
            described = describe_config(config)
            if not isinstance(key, tuple) or not all(isinstance(k, SCALARS) for k in key):
                described = None
            if described is None:
                logger.debug("autotune decision of %s for %r not recordable", kernel_id, key)
                continue
            entries.append({"key": list(key), "config": described})
        if entries:
            decisions[kernel_id] = sorted(entries, key=lambda e: json.dumps(e["key"]))
    return decisions


def apply_decisions(decisions: dict) -> int:
    """Put each recorded decision into its Autotuner's cache where the key has none yet,
    as the Config of that Autotuner's space the entry describes; returns how many were
    put. Entries whose kernel is not loaded, whose config is not in the space, or that
    are malformed are skipped (debug log)."""
    filled = 0
    if not isinstance(decisions, dict):
        logger.debug("autotune decisions are not a mapping: %r", type(decisions))
        return 0
    for kernel_id, entries in decisions.items():
        tuner = find_autotuner(resolve(kernel_id)) if isinstance(kernel_id, str) else None
        if tuner is None or not isinstance(entries, list):
            logger.debug("autotune decisions for %r: no such autotuned kernel loaded", kernel_id)
            continue
        space = {_config_text(describe_config(c)): c for c in tuner.configs}
        for entry in entries:
            config = _entry_config(entry, space)
            if config is None:
                logger.debug("autotune decision of %s skipped: %r", kernel_id, entry)
                continue
            key = tuple(entry["key"])
            if key not in tuner.cache:
                tuner.cache[key] = config
                filled += 1
    return filled


def _entry_config(entry, space: dict):
    if not isinstance(entry, dict) or not isinstance(entry.get("key"), list):
        return None
    if not all(isinstance(k, SCALARS) for k in entry["key"]):
        return None
    described = entry.get("config")
    if not isinstance(described, dict):
        return None
    return space.get(_config_text(described))


def _config_text(described: dict | None) -> str | None:
    if described is None:
        return None
    full = {"kwargs": described.get("kwargs", {}), **{f: described.get(f) for f in CONFIG_FIELDS}}
    return json.dumps(full, sort_keys=True)


@contextlib.contextmanager
def autotuning_on_disk(prefixes: tuple[str, ...] = KERNEL_PACKAGES):
    """While entered, where the user has not chosen (TRITON_CACHE_AUTOTUNING unset),
    Triton keeps autotuning results in its cache directory (the user's TRITON_CACHE_DIR
    or Triton's default, unchanged), so that a second process on the machine does not
    benchmark: for Autotuners made meanwhile (triton.knobs, which Triton mirrors into
    that environment variable) and for those already made in the modules under
    `prefixes` (they read the knob when built). On exit the knob, the environment
    variable and those Autotuners' `cache_results` are as they were, and Autotuners made
    meanwhile take what the knob now says: nothing of it outlives the block. Yields
    whether it turned caching on. For CUDA builds (the interpreter keeps no results),
    one at a time in a process (the knob is process-wide: blocks that overlap on two
    threads would put back each other's setting; nested ones are fine)."""
    if "TRITON_CACHE_AUTOTUNING" in os.environ:
        yield False
        return
    import triton

    before = [(tuner, tuner.cache_results) for tuner in _autotuners(prefixes)]
    try:
        with triton.knobs.autotuning.scope():
            triton.knobs.autotuning.cache = True
            for tuner, _ in before:
                tuner.cache_results = True
            yield True
    finally:
        kept = {id(tuner): value for tuner, value in before}
        made = bool(triton.knobs.autotuning.cache) and not triton.knobs.runtime.interpret
        for tuner in _autotuners(prefixes):
            tuner.cache_results = kept.get(id(tuner), made)


def _autotuners(prefixes: tuple[str, ...]) -> list:
    """The Autotuners of the loaded modules under `prefixes`, each once."""
    found = {}
    for _, kernel in kernel_interfaces(prefixes):
        tuner = find_autotuner(kernel)
        if tuner is not None:
            found[id(tuner)] = tuner
    return list(found.values())

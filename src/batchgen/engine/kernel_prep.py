"""The Triton kernels made ready before the engine's warm-up, so that a first start on a
fresh machine neither benchmarks autotuning spaces nor compiles one kernel at a time.

On a CUDA device, `kernels_prepared(...)` (build_engine holds it around the whole build):
1. loads fla-core's kernels where the model has KDA layers (kda_ops imports them lazily
   at the first forward; their Autotuners must exist to take decisions),
2. keeps autotuning results in Triton's cache directory where the user has not set
   TRITON_CACHE_AUTOTUNING, for the build only: on exit Triton's setting is what it was
   before (autotune_table.autotuning_on_disk),
3. fills each Autotuner's cache from the shipped table's section for this GPU
   (autotune_table), so the keys it holds run their recorded config without benchmarking,
4. compiles the table's recorded specializations on a thread pool (precompile),
5. logs "building: compiling kernels N/M" while the build compiles (precompile.CompileWatch;
   M: what the recording build compiled, the table's compiles for this GPU; N: those of
   them compiled so far, never more than M; compiles the table does not list, such as
   the configs a tuner benchmarks for a key the table lacks, are counted apart).
Nothing of it runs on the CPU (the interpreter neither compiles nor benchmarks).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

from batchgen.kernels import autotune_table
from batchgen.kernels.precompile import CompileWatch, planned_compiles, precompile, preload_jobs
from batchgen.layers import kda_ops

logger = logging.getLogger(__name__)

MAX_COMPILE_THREADS = 16


@contextlib.contextmanager
def kernels_prepared(
    device: torch.device,
    linear_attention: bool,
    table: Path | None = None,
    log_compiles: bool = True,
):
    """Steps 1-5 above for a build on `device` (a model with KDA layers where
    `linear_attention`), with the table at `table` (default the package's), step 5 only
    where `log_compiles` (a tensor-parallel worker rank's build leaves the log to rank
    0); yields the CompileWatch of the build (None off CUDA or without the log)."""
    if device.type != "cuda":
        yield None
        return
    with contextlib.ExitStack() as stack:
        watch = stack.enter_context(CompileWatch()) if log_compiles else None
        stack.enter_context(autotune_table.autotuning_on_disk())
        prepare_kernels(device, linear_attention, table, watch)
        yield watch


def prepare_kernels(
    device: torch.device,
    linear_attention: bool,
    table: Path | None = None,
    watch: CompileWatch | None = None,
) -> None:
    """Steps 1, 3 and 4 above on a CUDA `device` (kernels_prepared holds step 2 around
    them and the rest of the build); `watch`, if given, expects the compiles the table
    recorded for this GPU."""
    if linear_attention:
        kda_ops.fla_kda()
        kda_ops.fla_norm()
    index = torch.cuda.current_device() if device.index is None else device.index
    gpu = torch.cuda.get_device_name(index)
    major, minor = torch.cuda.get_device_capability(index)
    table_data = autotune_table.load_table(table)
    section = autotune_table.gpu_section(table_data, gpu, f"{major}.{minor}")
    if watch is not None:
        watch.expect(section.get("compile", {}))
    threads = min(MAX_COMPILE_THREADS, os.cpu_count() or 1)
    with torch.cuda.device(index):
        filled, compiled, jobs = apply_section(
            section, threads, before=lambda: torch.cuda.set_device(index)
        )
    logger.info(
        "kernels for %s: %d autotuning decisions and %d of %d compiles (of the %d it lists "
        "for this GPU) from the shipped table%s",
        gpu,
        filled,
        compiled,
        jobs,
        recorded_compiles(section),
        "" if section else " (none recorded for this GPU: kernels autotune and compile as met)",
    )


def recorded_compiles(section: dict) -> int:
    """How many compiles a GPU's section of the table lists (M of the progress line)."""
    return sum(planned_compiles(section.get("compile", {})).values())


def apply_section(section: dict, threads: int, before=None) -> tuple[int, int, int]:
    """A GPU's section of the table put to use: its autotuning decisions into the loaded
    Autotuners' caches, then its compiles on `threads` threads (`before` runs first on
    each). Returns (decisions put, compiles done, compiles asked)."""
    filled = autotune_table.apply_decisions(section.get("autotune", {}))
    jobs = preload_jobs(section.get("compile", {}))
    return filled, precompile(jobs, threads, before=before), len(jobs)

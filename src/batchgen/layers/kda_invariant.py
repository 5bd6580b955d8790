"""fla-core's KDA kernels batch-invariant on CUDA (EngineConfig.deterministic).

What a sequence's bits in fla's varlen (cu_seqlens) KDA depend on, read in fla-core
0.6.0's sources (the forward path of chunk_kda, fused_recurrent_kda_fwd, l2norm_fwd and
rms_norm_gated):

- No kernel mixes sequences: every program of the chunked path works on one chunk of
  one sequence (the chunk index numbers chunks per sequence from its first row), the
  state pass loops over one sequence's chunks in order, the recurrent step is a
  program per (row, head, V block); no split reduction across programs, no atomics.
- But almost every kernel is autotuned, and a config fixes the tile shapes and warps,
  so the order of its dot products' and row sums' reductions (its BK loop over the key
  dimension, a [BT, D] row sum's layout). The tuner benchmarks per process and per key,
  so the same step gets other configs in another process (a resumed job, another
  shard), and two keys carry the step's size: l2norm's and the gated norm's NB
  (ceil(T / 65536)). Autotuned, key in brackets: l2norm_fwd_kernel [D, NB],
  kda_gate_chunk_cumsum_vector_kernel [H, S, BT, IS_VARLEN, REVERSE],
  chunk_kda_fwd_kernel_intra_token_parallel [K, H, HV],
  chunk_kda_fwd_kernel_inter_solve_fused [H, HV, K, BT, BC, NC], recompute_w_u_fwd's
  kernel (wy_fast), chunk_gated_delta_rule_fwd_kernel_h_blockdim64 [H, HV, K, V, BT,
  STATE_V_FIRST], chunk_gla_fwd_kernel_o [BT, HV, STATE_V_FIRST, K, V] and
  layer_norm_gated_fwd_kernel [D, NB, ...]. Fixed: fused_beta_sigmoid (elementwise),
  fused_recurrent_kda_fwd (BV 32, 4 warps) and kernels/kda_decode.py (ours).
- A chunk's arithmetic depends on where it starts: a sequence's chunks start at its
  first row of the call, so pieces must start at multiples of the chunk (the engine's
  chunk_align and its 64-token state checkpoints do that), and a one-token piece takes
  the recurrent kernel where the same token in a longer piece would end a chunk alone.

So in invariant mode `pin_autotuners()` makes every autotuned kernel of those modules
launch with one config, `pinned_config(configs)`, whatever its key (outside the mode the
tuner runs as before), and `tail_split` gives the last token of a piece of 64k + 1
tokens to the recurrent kernel, as when that token comes alone after a cut.

The pinning is process-wide and never undone: once a process (the first import of fla
through kda_ops) each tuner's `run` is wrapped, its configs and cache left as they are.
The wrapper decides per launch: inside `batch_invariant.invariant_mode(True)` (per
thread; a deterministic runner enters it around each of its calls, runner/step_mode.py,
and leaves it when the call returns or raises) it launches the pinned config, outside
it it calls the tuner's own `run`. So an engine leaves nothing to restore when it is
done: a later engine that is not deterministic, or any other user of fla in the
process, meets the tuner as fla-core made it.
"""

from __future__ import annotations

import functools
import importlib
from typing import NamedTuple

import numpy as np
import torch

from batchgen.forward_context import LinearAttentionMetadata, parts_to_device
from batchgen.layers import batch_invariant

# fla-core's modules whose autotuned kernels the forward path launches
PATH_MODULES = (
    "fla.modules.norm.l2norm",
    "fla.modules.norm.fused_norm_gate",
    "fla.ops.utils.cumsum",
    "fla.ops.kda.gate",
    "fla.ops.kda.chunk_intra",
    "fla.ops.kda.chunk_intra_token_parallel",
    "fla.ops.kda.wy_fast",
    "fla.ops.common.chunk_delta_h",
    "fla.ops.gla.chunk",
)
PINNED_WARPS = 4


def pinned_config(configs):
    """The one config a kernel runs with in invariant mode: the smallest tile meta-
    parameters (so it fits every shape the kernel serves), then the warps nearest
    PINNED_WARPS, then the fewest stages. It depends on the list alone, so every process
    picks the same."""

    def rank(c):
        tiles = tuple(v for _, v in sorted(c.kwargs.items()))
        return tiles, abs(c.num_warps - PINNED_WARPS), c.num_warps, c.num_stages

    return min(configs, key=rank)


def autotuners(module) -> list:
    """The Triton autotuners among a module's kernels (under any heuristics wrapper)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    found = []
    for obj in vars(module).values():
        while isinstance(obj, KernelInterface) and not isinstance(obj, Autotuner):
            obj = getattr(obj, "fn", None)
        if isinstance(obj, Autotuner) and all(obj is not f for f in found):
            found.append(obj)
    return found


def _pinned_run(tuner, plain, config):
    def run(*args, **kwargs):
        if not batch_invariant.active():
            return plain(*args, **kwargs)
        if config.pre_hook is not None:
            config.pre_hook({**dict(zip(tuner.arg_names, args)), **kwargs, **config.all_kwargs()})
        return tuner.fn.run(*args, **kwargs, **config.all_kwargs())

    run.pinned = config
    return run


@functools.cache
def pin_autotuners() -> tuple:
    """Once a process: every autotuner of PATH_MODULES launches with its `pinned_config`
    while batch_invariant is active (the tuner's own run otherwise, so nothing is put
    back; module docstring); returns them."""
    tuners = []
    for name in PATH_MODULES:
        for tuner in autotuners(importlib.import_module(name)):
            if all(tuner is not t for t in tuners):  # a kernel imported by two modules
                tuner.run = _pinned_run(tuner, tuner.run, pinned_config(tuner.configs))
                tuners.append(tuner)
    return tuple(tuners)


class TailSplit(NamedTuple):
    """A step's rows by kernel in invariant mode, in kda_ops._Split's order: the
    recurrent step's (one-token pieces, and the last token of a piece of 64k + 1), and
    the chunked kernel's (every other row of the pieces of several tokens), as indices."""

    step_rows: torch.Tensor
    step_slots: torch.Tensor
    step_cu: torch.Tensor
    chunk_rows: torch.Tensor
    chunk_slots: torch.Tensor
    chunk_cu: torch.Tensor
    chunk_cu_host: torch.Tensor


def tail_split(meta: LinearAttentionMetadata, seed=None, chunk: int = 64) -> TailSplit | None:
    """The step's TailSplit (one copy to the device), or None where no piece of several
    tokens has a multiple of `chunk` (fla's, kda_ops.FLA_CHUNK) plus one (the usual split
    serves). `seed(cu, cu_host)`, if given, is called with the chunked rows' cu_seqlens
    (kda_ops seeds fla's chunk index with it)."""
    if not any(s.q_len > 1 and s.q_len % chunk == 1 for s in meta.seqs):
        return None
    longer = [s for s in meta.seqs if s.q_len > 1]
    lens = np.array([s.q_len - (s.q_len % chunk == 1) for s in longer], dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(lens)])
    starts = np.array([s.q_start for s in longer], dtype=np.int64)
    chunk_rows = np.arange(int(cu[-1])) - np.repeat(cu[:-1] - starts, lens)
    single = [s for s in meta.seqs if s.q_len == 1 or s.q_len % chunk == 1]
    parts = [[s.q_start + s.q_len - 1 for s in single], [s.slot for s in single],
             np.arange(len(single) + 1), chunk_rows, [s.slot for s in longer], cu]  # fmt: skip
    split = TailSplit(*parts_to_device(parts, meta.cu_seqlens.device), torch.from_numpy(cu))
    if seed is not None:
        seed(split.chunk_cu, split.chunk_cu_host)
    return split

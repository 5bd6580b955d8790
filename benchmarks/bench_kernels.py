"""Triton attention kernels on the GPU: decode bandwidth, prefill throughput, store-KV.

Qwen3-0.6B attention geometry (16 query heads, 8 KV heads, head_dim 128), bf16, pages of
16 tokens scattered at random through the pool. Times are triton.testing.do_bench
medians. Decode is judged on achieved bandwidth (K/V bytes read + q/out bytes over the
time) against the H200 device-copy ceiling of 4.23 TB/s; prefill on attention TFLOP/s
(4 * visible query-key pairs * heads * head_dim) against ~790 TFLOP/s bf16.

    python3 -m benchmarks.bench_kernels            # defaults plus a small tuning sweep
    python3 -m benchmarks.bench_kernels --quick    # defaults only
    python3 -m benchmarks.bench_kernels --moe      # W6's routed experts (see bench_moe)
    python3 -m benchmarks.bench_kernels --mla      # W4's MLA prefill attention only
    python3 -m benchmarks.bench_kernels --silu     # silu_and_mul launches at W4/W6 shapes
    python3 -m benchmarks.bench_kernels --kda      # W6's KDA decode and prefill, two layouts
    python3 -m benchmarks.bench_kernels --conv     # W6's prefill convolution launches
    python3 -m benchmarks.bench_kernels --route    # W6's router and routed sum, fused or not

--kda: W6's KDA layer (16 heads of 128, float32 state slots) through fla-core, in the
engine's state layout, fla's `state_v_first` [H, V, K], and in [H, K, V]: the decode step
(fused_recurrent_kda_fwd in place on 512 and 256 slots, rated on the state bytes read and
written against the copy ceiling) and a 32,768-token prefill chunk (chunk_kda, 32
prompts of 1,024, states gathered and returned); each layout's outputs are checked
against the engine's. Beside fla's decode step, ours (kernels/kda_decode.py) in the
engine's layout at a sweep of launches, each from the states fla's started from, its
output and states compared with fla's. Also the decode step's short convolution:
kernels/conv_decode.py against the torch step (kda_torch.short_conv_decode), and a
prefill step's (--conv: that alone): kernels/conv_packed.py at a sweep of launches
against fla-core's causal_conv1d with the copies it needs.

--moe: W6's routed experts (64 experts of hidden 2048 and intermediate 1024, top-6,
bf16) at 512 and 4,096 tokens (--moe-w4: W4's, intermediate 1408, at 64 to 8192),
through torch._grouped_mm (layers.routed_experts, the engine's path) and through
kernels/fused_moe.py's Triton GEMMs at a few block shapes, each timed as the whole
fused_experts call; rate: the expert weights read once over the time (decode is bound by
them) against the copy ceiling, and the GEMM TFLOP/s.

--route: an MoE layer's small steps at W6's shape (64 experts, top-6, hidden 2048) at
512 and 32,768 tokens, each eager and replayed from a CUDA graph (a decode step's
launch costs are the graph's): the expert choice as moe_routing's torch ops against
kernels/expert_select.py, and the routed sum plus the shared experts' output as
moe_combine then an add against moe_combine with the residual; each fused result is
checked against the unfused one.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch

from benchmarks.card import COPY_BW, kernel_seconds, page_table

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 8, 128, 16
DTYPE = torch.bfloat16
ELEM = 2  # bytes per bf16


def bench_decode(caches, batch: int, ctx: int, sweep: bool, gen) -> list[tuple]:
    from batchgen.kernels import decode_attention as da

    k_cache, v_cache = caches
    seq_lens = [ctx] * batch
    table = page_table(seq_lens, k_cache.shape[0], PAGE, gen)
    lens = torch.tensor(seq_lens, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    nbytes = sum(seq_lens) * KV_HEADS * HEAD_DIM * ELEM * 2 + 2 * q.numel() * ELEM
    auto = da.choose_num_splits(batch, KV_HEADS, ctx, q.device)
    configs = [(da.GPU_TUNING, None)]
    if sweep:
        tunings = [
            da.DecodeTuning(32, 4, 2),
            da.DecodeTuning(64, 8, 2),
            da.DecodeTuning(64, 4, 3),
            da.DecodeTuning(128, 8, 2),
        ]
        configs += [(t, None) for t in tunings]
        configs += [(da.GPU_TUNING, s) for s in (1, 2, 4, 8, 16) if s != auto]
    rows = []
    for tuning, splits in configs:

        def run(tuning=tuning, splits=splits):
            da.decode_attention(
                q,
                k_cache,
                v_cache,
                table,
                lens,
                0.088,
                out=out,
                max_seq_len=ctx,
                num_splits=splits,
                tuning=tuning,
            )

        seconds = kernel_seconds(run)
        bw = nbytes / seconds
        label = f"n={tuning.block_n} w={tuning.num_warps} s={tuning.num_stages}"
        split_label = f"{splits if splits else auto}{'' if splits else ' (auto)'}"
        rows.append(
            (
                f"decode {batch}x{ctx}",
                label,
                split_label,
                f"{seconds * 1e6:.1f} us",
                f"{bw / 1e12:.2f} TB/s",
                f"{100 * bw / COPY_BW:.0f}% of copy",
            )
        )
    return rows


def bench_prefill(caches, specs: list[tuple[int, int]], sweep: bool, gen) -> list[tuple]:
    """specs: (cached prefix, chunk length) per request."""
    from batchgen.kernels import prefill_attention as pa

    k_cache, v_cache = caches
    seq_lens = [p + n for p, n in specs]
    q_len = [n for _, n in specs]
    q_start = [sum(q_len[:i]) for i in range(len(specs))]
    table = page_table(seq_lens, k_cache.shape[0], PAGE, gen)
    args = [torch.tensor(x, device="cuda") for x in (q_start, q_len, seq_lens)]
    q = torch.randn(sum(q_len), HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    pairs = sum(n * p + n * (n + 1) // 2 for p, n in specs)
    flops = 4 * pairs * HEADS * HEAD_DIM
    tunings = [pa.GPU_TUNING]
    if sweep:
        tunings += [
            pa.PrefillTuning(64, 64, 4, 2),
            pa.PrefillTuning(64, 64, 4, 3),
            pa.PrefillTuning(128, 64, 8, 3),
            pa.PrefillTuning(128, 32, 8, 2),
            pa.PrefillTuning(64, 32, 4, 2),
        ]
    name = f"prefill {len(specs)}x{specs[0][1]} after {specs[0][0]}"
    rows = []
    for tuning in tunings:

        def run(tuning=tuning):
            pa.prefill_attention(
                q, k_cache, v_cache, *args, table, max(q_len), 0.088, out=out, tuning=tuning
            )

        seconds = kernel_seconds(run)
        label = f"m={tuning.block_m} n={tuning.block_n} w={tuning.num_warps} s={tuning.num_stages}"
        rows.append(
            (
                name,
                label,
                "-",
                f"{seconds * 1e6:.1f} us",
                f"{flops / seconds / 1e12:.1f} TFLOP/s",
                f"{sum(q_len) / seconds / 1e6:.2f} M tok/s",
            )
        )
    return rows


def bench_mla_prefill(num_seqs: int, seq_len: int, sweep: bool, gen) -> list[tuple]:
    """W4's decompressed MLA prefill (layers/mla_triton.paged_prefill): 16 heads, keys in
    two parts (128 per head | a 64-wide rope part shared by the heads), values 128 wide,
    keys and values strided views of kv_b_proj's [tokens, 16, 256] output; num_seqs
    prompts of seq_len from position 0, pages in order (the step gathers them)."""
    from batchgen.kernels import prefill_attention as pa

    heads, nope, rope, vdim = 16, 128, 64, 128
    tokens = num_seqs * seq_len
    pages = seq_len // PAGE
    q = torch.randn(tokens, heads, nope, generator=gen).to("cuda", DTYPE)
    q_pe = torch.randn(tokens, heads, rope, generator=gen).to("cuda", DTYPE)
    kv = torch.randn(tokens, heads, nope + vdim, generator=gen).to("cuda", DTYPE)
    k_pe = torch.randn(tokens, rope, generator=gen).to("cuda", DTYPE)
    n = num_seqs * pages
    k = kv[..., :nope].view(n, PAGE, heads, nope)
    v = kv[..., nope:].view(n, PAGE, heads, vdim)
    kr = k_pe.view(n, PAGE, 1, rope)
    starts = torch.arange(num_seqs, device="cuda") * seq_len
    lens = torch.full((num_seqs,), seq_len, device="cuda")
    table = torch.arange(n, device="cuda").view(num_seqs, pages)
    out = torch.empty(tokens, heads, vdim, device="cuda", dtype=DTYPE)
    pairs = num_seqs * seq_len * (seq_len + 1) // 2
    flops = 2 * pairs * heads * (nope + rope + vdim)
    tunings = [pa.default_tuning(q, vdim)]
    if sweep:  # (block_m, block_n, warps, stages)
        launches = [(128, 64, 8, 3), (128, 32, 8, 2), (128, 128, 8, 2), (64, 64, 4, 2)]
        launches += [(64, 64, 4, 3), (64, 128, 4, 2), (64, 32, 4, 3), (128, 64, 4, 2)]
        launches += [(128, 64, 4, 3)]
        tunings += [pa.PrefillTuning(*t) for t in launches if pa.PrefillTuning(*t) != tunings[0]]
    rows = []
    for tuning in tunings:

        def run(tuning=tuning):
            pa.prefill_attention(
                q, k, v, starts, lens, lens, table, seq_len, 0.072, out=out, tuning=tuning,
                q_rope=q_pe, k_rope=kr,
            )  # fmt: skip

        seconds = kernel_seconds(run)
        label = f"m={tuning.block_m} n={tuning.block_n} w={tuning.num_warps} s={tuning.num_stages}"
        rows.append(
            (
                f"mla prefill {num_seqs}x{seq_len}",
                label,
                "-",
                f"{seconds * 1e6:.1f} us",
                f"{flops / seconds / 1e12:.1f} TFLOP/s",
                f"{tokens / seconds / 1e6:.2f} M tok/s",
            )
        )
    return rows


def bench_store_kv(caches, gen) -> list[tuple]:
    from batchgen.kernels.store_kv import store_kv

    k_cache, v_cache = caches
    t = 8192
    k = torch.randn(t, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    slots = torch.randperm(k_cache.shape[0] * PAGE, generator=gen)[:t].cuda()
    seconds = kernel_seconds(lambda: store_kv(k_cache, v_cache, k, v, slots))
    nbytes = 4 * k.numel() * ELEM  # read k, v; write both
    bw = nbytes / seconds
    return [
        (
            f"store_kv {t} tokens",
            "-",
            "-",
            f"{seconds * 1e6:.1f} us",
            f"{bw / 1e12:.2f} TB/s",
            f"{100 * bw / COPY_BW:.0f}% of copy",
        )
    ]


# routed experts (intermediate size, token counts) by workload: 64 experts of hidden
# 2048, top-6; W6 at its decode step (512 rows) and at 4,096 tokens
MOE_SHAPES = {"W4": ("W4", 1408, (64, 256, 1024, 8192)), "W6": ("W6", 1024, (512, 4096))}


def bench_moe(gen, label: str, inter: int, sizes: tuple[int, ...]) -> list[tuple]:
    from batchgen.kernels import fused_moe
    from batchgen.layers.routed_experts import fused_experts

    num_experts, top_k, hidden = 64, 6, 2048
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen).to("cuda", DTYPE)
    down = torch.randn(num_experts, hidden, inter, generator=gen).to("cuda", DTYPE)
    gate_up /= hidden**0.5
    down /= inter**0.5
    weight_bytes = (gate_up.numel() + down.numel()) * ELEM
    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the first four as measured before;
    # then deeper K tiles and pipelines, which a weight-bound decode step wants
    launches = [(16, 128, 64, 4, 3), (32, 64, 64, 4, 3), (64, 128, 64, 8, 3)]
    launches += [(16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (16, 64, 256, 4, 3)]
    launches += [(32, 64, 128, 4, 4), (16, 128, 256, 8, 3), (64, 64, 128, 4, 3)]
    # one block of rows an expert at W6's decode step (48 a expert on average), deeper
    # pipelines
    launches += [(64, 128, 128, 8, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 5)]
    launches += [(32, 128, 128, 4, 4), (64, 64, 64, 4, 6)]
    tunings = [fused_moe.TUNING] + [fused_moe.MoETuning(*t) for t in launches]
    rows = []
    for t in sizes:
        x = torch.randn(t, hidden, generator=gen).to("cuda", DTYPE)
        scores = torch.rand(t, num_experts, generator=gen).to("cuda")
        weights, ids = scores.topk(top_k, dim=-1)
        touched = min(num_experts, t * top_k)  # experts whose weights a step reads
        flops = 2 * t * top_k * 3 * hidden * inter
        ref = fused_experts(x, gate_up, down, weights, ids)
        args = (x, gate_up, down, weights, ids)
        cases = [("grouped_mm", partial(fused_experts, *args))]
        for tn in tunings:
            launch = f"triton {tn.block_m}x{tn.block_n}x{tn.block_k} w{tn.num_warps}"
            run = partial(fused_experts, *args, triton_moe=tn)
            err = (run().float() - ref.float()).abs().max().item()
            cases.append((f"{launch} (max diff {err:.1e})", run))
        for launch, fn in cases:
            seconds = kernel_seconds(fn)
            bw = weight_bytes * touched / num_experts / seconds
            rows.append(
                (
                    f"{label} moe T={t}",
                    launch,
                    "-",
                    f"{seconds * 1e6:.1f} us",
                    f"{bw / 1e12:.2f} TB/s, {flops / seconds / 1e12:.0f} TFLOP/s",
                    f"{100 * bw / COPY_BW:.0f}% of copy",
                )
            )
    return rows


def _graphed(fn):
    """fn captured in a CUDA graph (after a warm-up call on a side stream): its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _then_add(fn, other: torch.Tensor) -> torch.Tensor:
    return fn() + other


def bench_route(gen) -> list[tuple]:
    from batchgen.kernels.expert_select import expert_select
    from batchgen.kernels.moe_combine import moe_combine
    from batchgen.layers import moe_routing

    experts, top_k, hidden, scale = 64, 6, 2048, 2.446
    cfg = moe_routing.RoutingConfig(experts, top_k, routed_scaling_factor=scale)
    bias = (0.05 * torch.randn(experts, generator=gen)).cuda()

    def torch_ops(logits):
        return moe_routing.select_experts_torch(logits, bias, cfg)

    rows = []
    for t in (512, 32768):
        logits = (2 * torch.randn(t, experts, generator=gen)).cuda()
        fused = partial(expert_select, logits, bias, top_k, scale=scale)
        same = torch.equal(fused()[1], torch_ops(logits)[1])
        h = torch.randn(t * top_k, hidden, generator=gen).to("cuda", DTYPE)
        position = torch.randperm(t * top_k, generator=gen).cuda()
        weights = torch.rand(t, top_k, generator=gen).cuda()
        shared = torch.randn(t, hidden, generator=gen).to("cuda", DTYPE)
        with_add = partial(moe_combine, h, position, weights, residual=shared)
        without = partial(moe_combine, h, position, weights)
        bits = torch.equal(with_add(), without() + shared)
        combine_bytes = (h.numel() + 2 * shared.numel()) * ELEM
        cases = [
            ("route: torch ops", partial(torch_ops, logits), None),
            (f"route: expert_select ({'same ids' if same else 'IDS DIFFER'})", fused, None),
            ("combine, then + shared", partial(_then_add, without, shared),
             combine_bytes + 2 * shared.numel() * ELEM),
            (f"combine with residual ({'same bits' if bits else 'BITS DIFFER'})", with_add,
             combine_bytes),
        ]  # fmt: skip
        for name, fn, moved in cases:
            for how, run in (("eager", fn), ("graph", _graphed(fn))):
                seconds = kernel_seconds(run)
                rate = "-" if moved is None else f"{moved / seconds / 1e12:.2f} TB/s"
                rows.append((f"W6 T={t} {name}", how, "-", f"{seconds * 1e6:.1f} us", rate, "-"))
    return rows


def bench_silu(gen) -> list[tuple]:
    """kernels/silu_and_mul.py at the MoE models' shapes, rated on the bytes it moves
    (the [T, 2I] input read once, the [T, I] output written once) against the copy
    ceiling; launches (rows, block, warps), the shape's default first."""
    from batchgen.kernels import silu_and_mul as sm

    launches = [(1, 1024, 4), (1, 2048, 8), (2, 1024, 8), (2, 512, 4), (4, 512, 4)]
    launches += [(4, 256, 4), (8, 256, 4), (8, 128, 4), (16, 128, 4), (16, 256, 8)]
    launches += [(32, 128, 8)]
    shapes = [
        ("W4 routed prefill", 16384 * 6, 1408),
        ("W6 routed prefill", 16384 * 6, 1024),
        ("W4 shared prefill", 16384, 2 * 1408),
        ("W4 dense prefill", 16384, 11264),
        ("W4 routed decode", 512 * 6, 1408),
    ]
    rows = []
    for name, t, inter in shapes:
        x = torch.randn(t, 2 * inter, generator=gen).to("cuda", DTYPE)
        out = torch.empty(t, inter, device="cuda", dtype=DTYPE)
        ref = sm.silu_and_mul(x)
        moved = 3 * t * inter * ELEM
        default = sm.launch_for(inter)
        others = [sm.SiluTuning(*launch) for launch in launches]
        for tn in [default] + [o for o in others if o != default]:
            sm.silu_and_mul(x, out=out, tuning=tn)
            same = "same bits" if torch.equal(out, ref) else "DIFFERS"
            seconds = kernel_seconds(partial(sm.silu_and_mul, x, out=out, tuning=tn))
            bw = moved / seconds
            rows.append(
                (
                    f"silu {name} [{t}, {inter}]",
                    f"{tn.block_rows}x{tn.block} w{tn.num_warps} ({same})",
                    "-",
                    f"{seconds * 1e6:.1f} us",
                    f"{bw / 1e12:.2f} TB/s",
                    f"{100 * bw / COPY_BW:.0f}% of copy",
                )
            )
    return rows


def bench_kda(gen) -> list[tuple]:
    """W6's KDA kernels (see --kda in the module text)."""
    from fla.ops.kda import chunk_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    from batchgen.kernels.conv_decode import conv_decode
    from batchgen.layers import kda_torch

    heads, dim, slots = 16, 128, 1040

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to("cuda")

    gates = dict(A_log=randn(heads, scale=0.5), dt_bias=randn(heads * dim))
    gates |= dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    gates |= dict(use_qk_l2norm_in_kernel=True, scale=dim**-0.5)
    states_k = randn(slots, heads, dim, dim, scale=0.1)  # [S, H, K, V]
    states_v = states_k.transpose(-1, -2).contiguous()  # [S, H, V, K]: the engine's
    layouts = (("[H, V, K]", states_v, True), ("[H, K, V]", states_k, False))
    rows = []

    def compared(case: str, outs: list[torch.Tensor]) -> tuple:
        diff = (outs[0].float() - outs[1].float()).abs().max().item()
        return (case, "the layouts' outputs", "-", f"max |diff| {diff:.2e}", "-", "-")

    for batch in (512, 256):
        q, k, v, f = (randn(1, batch, heads, dim).to(DTYPE) for _ in range(4))
        beta = randn(1, batch, heads).to(DTYPE)
        step_kw = dict(
            inplace_final_state=True,
            cu_seqlens=torch.arange(batch + 1, device="cuda"),
            ssm_state_indices=torch.randperm(slots - 1, generator=gen)[:batch].to("cuda"),
            **gates,
        )
        outs = []
        for name, states, v_first in layouts:
            step = partial(
                fused_recurrent_kda_fwd, q, k, v, f, beta, initial_state=states.clone(),
                state_v_first=v_first, **step_kw,
            )  # fmt: skip
            outs.append(step()[0])
            if v_first:  # fla's one step from the start, which ours are held to
                fla_state = step.keywords["initial_state"].clone()
            seconds = kernel_seconds(step)
            bw = 2 * batch * heads * dim * dim * 4 / seconds  # float32 state read and written
            rows.append(
                (f"kda decode, {batch} rows", f"state {name}", "-", f"{seconds * 1e6:.1f} us",
                 f"{bw / 1e12:.2f} TB/s", f"{100 * bw / COPY_BW:.0f}% of copy")
            )  # fmt: skip
        rows.append(compared(f"kda decode, {batch} rows", outs))
        rows += bench_kda_decode(q, k, v, f, beta, gates, states_v, step_kw, outs[0], fla_state)
        del fla_state

    prompts, length = 32, 1024
    tokens = prompts * length
    q, k, v, f = (randn(1, tokens, heads, dim).to(DTYPE) for _ in range(4))
    beta = randn(1, tokens, heads).to(DTYPE)
    cu = torch.arange(0, tokens + 1, length, device="cuda")
    chunk_kw = dict(output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(), **gates)
    idx = torch.arange(prompts, device="cuda")
    outs = []
    for name, states, v_first in layouts:

        def chunk(states=states, v_first=v_first):  # the engine gathers the states each step
            init = states.index_select(0, idx)
            return chunk_kda(
                q, k, v, f, beta, initial_state=init, state_v_first=v_first, **chunk_kw
            )

        outs.append(chunk()[0])
        seconds = kernel_seconds(chunk)
        rows.append(
            (f"kda prefill, {tokens} tokens", f"state {name}", "-", f"{seconds * 1e6:.1f} us",
             f"{tokens / seconds / 1e6:.1f} Mtok/s", "-")
        )  # fmt: skip
    rows.append(compared(f"kda prefill, {tokens} tokens", outs))

    channels, taps = 3 * heads * dim, 4
    weight = randn(channels, taps).to(DTYPE)
    windows = randn(slots, taps - 1, channels).to(DTYPE)
    for batch in (512, 256):
        x = randn(batch, channels).to(DTYPE)
        idx = torch.randperm(slots - 1, generator=gen)[:batch].to("cuda")
        for name, fn in (
            ("kernels/conv_decode.py", partial(conv_decode, x, weight, windows, idx, 3)),
            ("torch step", partial(kda_torch.short_conv_decode, x, weight, windows, idx)),
        ):
            seconds = kernel_seconds(fn)
            # the windows read and written, x read, the output written
            bw = batch * channels * (2 * (taps - 1) + 2) * ELEM / seconds
            rows.append(
                (f"conv decode, {batch} rows", name, "-", f"{seconds * 1e6:.1f} us",
                 f"{bw / 1e12:.2f} TB/s", f"{100 * bw / COPY_BW:.0f}% of copy")
            )  # fmt: skip
    return rows + bench_conv_prefill(weight, windows, prompts, length, gen)


# kernels/kda_decode.py launches (block_v, num_warps, heads_per_program, num_stages), its
# default (fla's own launch) first
KDA_DECODE_LAUNCHES = [
    (32, 4, 1, 1), (16, 2, 1, 1), (16, 4, 1, 1), (8, 1, 1, 1), (8, 2, 1, 1), (64, 4, 1, 1),
    (64, 8, 1, 1), (32, 4, 2, 2), (16, 2, 4, 2), (32, 4, 4, 3), (128, 8, 1, 1),
]  # fmt: skip


def bench_kda_decode(q, k, v, f, beta, gates, states, step_kw, fla_o, fla_state) -> list[tuple]:
    """kernels/kda_decode.py's decode step in the engine's [H, V, K] layout at a sweep of
    launches, each from a copy of the states fla's step started from: the time, the state
    bytes against the copy ceiling, and how far its output and its states (all slots)
    land from fla's (fla_o, fla_state: fla's one step from `states`)."""
    from batchgen.kernels.kda_decode import KDADecodeTuning, kda_decode

    batch = q.shape[1]
    slots = step_kw["ssm_state_indices"]
    args = (q[0], k[0], v[0], f[0], beta[0], gates["A_log"], gates["dt_bias"])
    ours = torch.empty_like(states)
    rows = []
    for launch in KDA_DECODE_LAUNCHES:
        tuning = KDADecodeTuning(*launch)
        ours.copy_(states)
        step = partial(kda_decode, *args, ours, slots, scale=gates["scale"], tuning=tuning)
        o = step()
        d_o = (o.float() - fla_o[0].float()).abs().max().item()
        d_s = (ours - fla_state).abs().max().item()
        seconds = kernel_seconds(step)
        bw = 2 * batch * states[0].numel() * 4 / seconds  # float32 state read and written
        bv, warps, pairs, stages = launch
        rows.append(
            (f"kda decode, {batch} rows", f"kda_decode.py bv{bv} w{warps} hp{pairs} st{stages}",
             "-", f"{seconds * 1e6:.1f} us", f"{bw / 1e12:.2f} TB/s",
             f"{100 * bw / COPY_BW:.0f}% of copy; vs fla max |diff| o {d_o:.1e}, state {d_s:.1e}")
        )  # fmt: skip
    return rows


def fla_prefill_conv(x, weight, windows, cu, slots):
    """A prefill step's convolution through fla-core's causal_conv1d, as the engine ran it
    before kernels/conv_packed.py: initial states [N, C, K] built from the windows (column
    0 never read), the final states written back, then q, k and v made contiguous (the
    chunked KDA kernels index rows as if contiguous)."""
    from fla.modules.causal_conv1d.ops import causal_conv1d

    width = weight.shape[1] - 1
    past = windows.index_select(0, slots)
    init = torch.zeros(past.shape[0], past.shape[2], width + 1, dtype=x.dtype, device=x.device)
    init[:, :, 1:] = past.transpose(1, 2)
    y, final = causal_conv1d(
        x.unsqueeze(0), weight=weight, initial_state=init, output_final_state=True,
        activation="silu", cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(),
    )  # fmt: skip
    windows.index_copy_(0, slots, final[:, :, 1:].transpose(1, 2).to(windows.dtype))
    return tuple(t.contiguous() for t in y[0].split(y.shape[-1] // 3, dim=-1))


def bench_conv_prefill(weight, windows, prompts: int, length: int, gen) -> list[tuple]:
    """A 32,768-token prefill step's q, k and v convolution: kernels/conv_packed.py against
    fla-core's causal_conv1d and the copies that make its thirds contiguous; each output
    compared with the torch reference in float32."""
    from batchgen.kernels.conv_packed import LAUNCH, conv_packed

    tokens, channels = prompts * length, weight.shape[0]
    x = torch.randn(tokens, channels, generator=gen).to("cuda", DTYPE)
    cu = torch.arange(0, tokens + 1, length, device="cuda")
    slots = torch.randperm(windows.shape[0], generator=gen)[:prompts].to("cuda")
    case = f"conv prefill, {tokens} tokens"
    outs, rows = [], []
    start = windows.clone()
    # conv_packed's launches (rows, channels, warps), its default first
    launches = [LAUNCH, (32, 256, 4), (64, 256, 8), (32, 128, 4), (64, 128, 4), (16, 512, 4)]
    launches += [(8, 512, 4), (32, 512, 8), (128, 128, 8), (64, 64, 4)]
    cases = [
        (f"kernels/conv_packed.py {t}x{c} w{w}", partial(conv_packed, *args, launch=(t, c, w)))
        for args in [(x, weight, windows, cu, slots, 3)]
        for t, c, w in launches
    ]
    cases.append(
        ("fla causal_conv1d + copies", partial(fla_prefill_conv, x, weight, windows, cu, slots))
    )
    for name, fn in cases:
        outs.append(torch.cat(fn(), dim=-1))  # both from the windows as they start
        seconds = kernel_seconds(fn)
        windows.copy_(start)
        bw = 2 * tokens * channels * ELEM / seconds  # x read, the output written
        rows.append(
            (case, name, "-", f"{seconds * 1e6:.1f} us", f"{bw / 1e12:.2f} TB/s",
             f"{100 * bw / COPY_BW:.0f}% of copy")
        )  # fmt: skip
    # the torch reference in float32 from the same windows: which of the two is off
    from batchgen.layers.kda_torch import short_conv_packed

    want = short_conv_packed(x.float(), weight.float(), start.float(), cu, slots)
    diffs = [(out.float() - want).abs().max().item() for out in outs]
    return rows + [
        (case, f"{row[1]} vs torch", "-", f"max |diff| {d:.2e}", "-", "-")
        for row, d in zip(rows, diffs)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="default launch parameters only")
    parser.add_argument("--moe", action="store_true", help="W6's routed-expert GEMMs")
    parser.add_argument("--moe-w4", action="store_true", help="W4's routed-expert GEMMs")
    parser.add_argument("--mla", action="store_true", help="W4's MLA prefill attention only")
    parser.add_argument("--silu", action="store_true", help="silu_and_mul launches only")
    parser.add_argument("--kda", action="store_true", help="W6's KDA kernels, two state layouts")
    parser.add_argument("--conv", action="store_true", help="W6's prefill convolution only")
    parser.add_argument("--route", action="store_true", help="W6's router and routed sum")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA device", file=sys.stderr)
        return 1
    import triton

    gen = torch.Generator().manual_seed(0)
    num_pages = 40_000  # 32 x 16000 tokens need 32,000 pages; 2 x 1.3 GB of K/V
    pool = torch.empty(1, 2, num_pages, PAGE, KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    pool.normal_()
    caches = (pool[0, 0], pool[0, 1])
    sweep = not args.quick
    print(
        f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}"
    )
    rows = []
    only = (args.moe, args.moe_w4, args.mla, args.silu, args.kda, args.conv, args.route)
    if any(only):  # those only
        if args.route:
            rows += bench_route(gen)
        if args.moe:
            rows += bench_moe(gen, *MOE_SHAPES["W6"])
        if args.moe_w4:
            rows += bench_moe(gen, *MOE_SHAPES["W4"])
        if args.mla:
            rows += bench_mla_prefill(16, 1024, sweep, gen)
        if args.silu:
            rows += bench_silu(gen)
        if args.kda:
            rows += bench_kda(gen)
        elif args.conv:  # --kda runs it too
            channels, taps, slots = 3 * 16 * 128, 4, 1040
            weight = torch.randn(channels, taps, generator=gen).to("cuda", DTYPE)
            windows = torch.randn(slots, taps - 1, channels, generator=gen).to("cuda", DTYPE)
            rows += bench_conv_prefill(weight, windows, 32, 1024, gen)
        _print(rows)
        return 0
    rows += bench_decode(caches, 256, 1000, sweep, gen)
    rows += bench_decode(caches, 32, 16000, sweep, gen)
    rows += bench_prefill(caches, [(2000, 512)] * 8, sweep, gen)
    rows += bench_prefill(caches, [(0, 2048)] * 4, sweep, gen)
    rows += bench_store_kv(caches, gen)
    _print(rows)
    return 0


def _print(rows: list[tuple]) -> None:
    header = ("case", "launch", "splits", "median", "rate", "vs ceiling")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    print("# first row of each case is the default launch; decode ceiling 4.23 TB/s")


if __name__ == "__main__":
    sys.exit(main())

"""Absorbed MLA decode attention (kernels/mla_decode.py) on a GPU: achieved bandwidth.

DeepSeek-V3 latent rows (kv_lora_rank 512 + rope 64, bf16), 16 query heads (TP 8) or 128
(TP 1), pages of --page tokens (16, the engine's default) scattered at random through the
pool, every request of a case
at the same context length. The rate counts the bytes the kernel must read at least:
each cached token's latent row once (576 * 2 bytes) plus q and out, over the
triton.testing.do_bench median, against the H200's 4.8 TB/s HBM peak (the device-copy
ceiling measured in bench_kernels.py is 4.23 TB/s).

    python3 -m benchmarks.mla_decode                  # default launch, every case
    python3 -m benchmarks.mla_decode --sweep          # plus other tunings and split counts
    python3 -m benchmarks.mla_decode --heads 128 --batch 1 256 --ctx 8192
    python3 -m benchmarks.mla_decode --sweep --heads 16 --batch 256 --ctx 1024 --best
        # W4's decode shape; the last line is the fastest launch as h,n,w,s (the
        # engine's is kernels/mla_decode.py's GPU_TUNING)
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from benchmarks.card import kernel_seconds

HBM_PEAK = 4.8e12  # bytes/s, H200 HBM3e
LORA, ROPE = 512, 64
DTYPE = torch.bfloat16
ELEM = 2  # bytes per bf16


def _table(batch: int, ctx: int, latent: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    num_pages, page = latent.shape[:2]
    need = math.ceil(ctx / page)
    perm = torch.randperm(num_pages, generator=gen)[: batch * need]
    return perm.view(batch, need).to("cuda")


def _sweep_tunings(md):
    return [
        md.MLADecodeTuning(16, 16, 4, 2),
        md.MLADecodeTuning(16, 32, 4, 2),
        md.MLADecodeTuning(16, 32, 4, 3),
        md.MLADecodeTuning(16, 64, 8, 2),
        md.MLADecodeTuning(16, 64, 4, 2),
        md.MLADecodeTuning(16, 32, 8, 3),
        md.MLADecodeTuning(16, 16, 8, 2),
        md.MLADecodeTuning(32, 32, 8, 2),
        md.MLADecodeTuning(64, 32, 8, 2),
    ]


def bench_case(latent, heads: int, batch: int, ctx: int, sweep: bool, gen) -> list[tuple]:
    from batchgen.kernels import mla_decode as md

    table = _table(batch, ctx, latent, gen)
    lens = torch.full((batch,), ctx, device="cuda")
    q_nope = torch.randn(batch, heads, LORA, device="cuda", dtype=DTYPE)
    q_pe = torch.randn(batch, heads, ROPE, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q_nope)
    nbytes = (batch * ctx * (LORA + ROPE) + q_nope.numel() + q_pe.numel() + out.numel()) * ELEM
    default = md.default_tuning(DTYPE, q_nope.device)
    configs = [(default, None)]
    if sweep:
        configs += [(t, None) for t in _sweep_tunings(md) if t != default]
        auto = md.choose_mla_num_splits(batch, heads, ctx, q_nope.device, default)
        configs += [(default, s) for s in (auto // 4, auto // 2, auto * 2, auto * 4) if s >= 1]
    rows = []
    for tuning, splits in configs:
        if splits is None:
            splits_used = md.choose_mla_num_splits(batch, heads, ctx, q_nope.device, tuning)
        else:
            splits_used = splits

        def run(tuning=tuning, splits=splits_used):
            md.mla_decode(
                q_nope, q_pe, latent, table, lens, 0.072, out=out, num_splits=splits, tuning=tuning
            )

        seconds = kernel_seconds(run)
        rate = nbytes / seconds
        launch = f"h={tuning.block_h} n={tuning.block_n} w={tuning.num_warps} s={tuning.num_stages}"
        rows.append(
            (
                seconds,
                f"{tuning.block_h},{tuning.block_n},{tuning.num_warps},{tuning.num_stages}",
                splits is None,
                f"H={heads} {batch}x{ctx}",
                launch,
                f"{splits_used}{'' if splits else ' (auto)'}",
                f"{seconds * 1e6:.1f} us",
                f"{rate / 1e9:.0f} GB/s",
                f"{100 * rate / HBM_PEAK:.0f}% of 4.8 TB/s",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also other tunings and splits")
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--page", type=int, default=16, help="tokens per page (16)")
    parser.add_argument(
        "--best",
        action="store_true",
        help="last line: the fastest launch with automatic splits as h,n,w,s",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("mla_decode: needs a CUDA device", file=sys.stderr)
        return 1
    import triton

    gen = torch.Generator().manual_seed(0)
    num_pages = max(args.batch) * math.ceil(max(args.ctx) / args.page) + 16
    latent = torch.empty(num_pages, args.page, 1, LORA + ROPE, dtype=DTYPE, device="cuda")
    latent.normal_()
    print(
        f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}"
    )
    timed = []
    for heads in args.heads:
        for batch in args.batch:
            for ctx in args.ctx:
                timed += bench_case(latent, heads, batch, ctx, args.sweep, gen)
    rows = [r[3:] for r in timed]
    header = ("case", "launch", "splits", "median", "latent+q+out", "vs peak")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    print("# first row of each case is the default launch; bytes = each latent row read once")
    if args.best:
        print(min((r for r in timed if r[2]), key=lambda r: r[0])[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())

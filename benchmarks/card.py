"""The card a run is on: its ceilings, and how the benchmarks wait for it and time work.

COPY_BW, MATMUL_FLOPS and HOST_COPY_GB_S are the H200's, measured (BENCHMARKS.md; an H100
gave 3.045 TB/s, 795 TFLOP/s and 55.5 GB/s). `measure` (and `python3 -m benchmarks.card`)
measures the three on the card it runs on (device copy counting bytes read and written, an
8192^3 bf16 matmul, one pinned 1 GiB copy each way); `ceilings` is what a benchmark's
roofline is taken against: the card's measured, the constants only where that cannot run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial

COPY_BW = 4.23e12  # bytes/s, device copy (read + written)
MATMUL_FLOPS = 790e12  # bf16 dense matmul
HOST_COPY_GB_S = 55.0  # host<->device, each way, pinned


def sync(device) -> None:
    """Wait for the work queued on `device` (a torch.device or its name; nothing to wait
    for on the CPU)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_seconds(fn) -> float:
    """`fn`'s median time on the GPU (triton.testing.do_bench: 25 ms warm-up, 100 ms of
    repeats), in seconds."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def weight_read_row(case, launch, seconds, weight_bytes, err=None) -> tuple:
    """One row of a weight-bound kernel's table: its median time, the weight bytes it
    read per second, that as a share of COPY_BW, and its largest difference from the
    reference (`err`, if checked)."""
    bw = weight_bytes / seconds
    note = "-" if err is None else f"max diff {err:.1e}"
    rate = f"{bw / 1e12:.2f} TB/s"
    return (case, launch, f"{seconds * 1e6:.1f} us", rate, f"{100 * bw / COPY_BW:.0f}%", note)


# W6's routed experts' gate_up GEMM, as the quantized-expert benchmarks time it
MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, MOE_TOP_K = 64, 2048, 1024, 6


def moe_gate_up_cases(gen, dense, tokens=(64, 512, 4096)):
    """W6's gate_up GEMM over the bf16 experts `dense` [MOE_EXPERTS, 2 * MOE_INTER,
    MOE_HIDDEN] at each token count, yielded as (case, x, experts, ref, weight_bytes,
    bf16_row):
    random rows x [t, MOE_HIDDEN] bf16, each routed to MOE_TOP_K random experts (experts:
    the pairs' experts, flat [t * MOE_TOP_K]); ref, torch._grouped_mm over the
    token-sorted rows put back in pair order; the bf16 bytes of the experts a step
    touches; and that grouped GEMM's row of the table."""
    import torch

    from batchgen.layers.routed_experts import grouped_mm

    for t in tokens:
        x = torch.randn(t, MOE_HIDDEN, generator=gen).to("cuda", torch.bfloat16)
        ids = torch.rand(t, MOE_EXPERTS, generator=gen).topk(MOE_TOP_K, dim=-1).indices
        flat = ids.to("cuda").reshape(-1)
        order = torch.sort(flat, stable=True).indices
        offs = torch.cumsum(torch.bincount(flat, minlength=MOE_EXPERTS), 0).to(torch.int32)
        sorted_rows = x.index_select(0, order // MOE_TOP_K)
        touched = min(MOE_EXPERTS, t * MOE_TOP_K)
        case = f"W6 moe gate_up T={t}"
        bf16 = partial(grouped_mm, sorted_rows, dense, offs)
        ref = torch.empty_like(bf16()).index_copy_(0, order, bf16())  # back to pair order
        w_bytes = dense.numel() * 2 * touched // MOE_EXPERTS
        row = weight_read_row(case, "bf16 grouped_mm", kernel_seconds(bf16), w_bytes)
        yield case, x, flat, ref, w_bytes, row


def page_table(seq_lens: list[int], num_pages: int, page: int, gen, device: str = "cuda"):
    """A paged-attention page table [len(seq_lens), most pages]: each sequence's pages
    drawn at random (gen) from num_pages without repeats, rows padded with page 0."""
    import torch

    need = [-(-n // page) for n in seq_lens]
    perm = torch.randperm(num_pages, generator=gen)[: sum(need)].tolist()
    width, rows, at = max(need), [], 0
    for n in need:
        rows.append(perm[at : at + n] + [0] * (width - n))
        at += n
    return torch.tensor(rows, dtype=torch.int64, device=device)


def weight_bench_main(name: str, doc: str, benches, argv=None) -> int:
    """The main() of a quantized-weight kernel benchmark: each of `benches` (gen, sweep)
    -> rows of weight_read_row, printed as one table; --quick runs the default launches
    only. Needs a CUDA device."""
    import torch

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="default launches only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{name}: needs a CUDA device", file=sys.stderr)
        return 1
    gen = torch.Generator().manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}")
    rows = [row for bench in benches for row in bench(gen, not args.quick)]
    header = ("case", "launch", "median", "weights read", "of copy", "check")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    return 0


def _median_seconds(fn, device, repeats: int) -> float:
    fn()  # first call: allocations, kernel selection
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure(device: str = "cuda", copy_gib: float = 1.0, matmul: int = 8192, repeats: int = 5):
    """The card's ceilings, measured: {copy_bytes_per_s, matmul_flops, h2d_gb_s, d2h_gb_s}
    (the host copies None off a GPU). The device copy counts the bytes it reads and writes;
    the matmul is matmul^3 in bf16 (float32 on the CPU); each timing the median of
    `repeats` after one untimed call."""
    import torch

    n = int(copy_gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = _median_seconds(lambda: dst.copy_(src), device, repeats)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    a = torch.randn(matmul, matmul, device=device, dtype=dtype)
    b = torch.randn(matmul, matmul, device=device, dtype=dtype)
    mm_s = _median_seconds(lambda: a @ b, device, repeats)
    result = {
        "copy_bytes_per_s": 2 * n / copy_s,
        "matmul_flops": 2 * matmul**3 / mm_s,
        "h2d_gb_s": None,
        "d2h_gb_s": None,
    }
    if torch.device(device).type == "cuda":
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        h2d = _median_seconds(lambda: src.copy_(host, non_blocking=True), device, repeats)
        d2h = _median_seconds(lambda: host.copy_(src, non_blocking=True), device, repeats)
        result["h2d_gb_s"], result["d2h_gb_s"] = n / h2d / 1e9, n / d2h / 1e9
        del src, dst, a, b, host
        torch.cuda.empty_cache()  # the engine built next plans its pools from free memory
    return result


def ceilings(device: str = "cuda", measured: bool = True, **sizes) -> dict:
    """The ceilings a roofline is taken against: `measure(device, **sizes)` with "source"
    "measured"; the H200's constants (source "H200 constants") where measured is False or
    the measurement fails, the latter with a warning on stderr naming why."""
    if measured:
        try:
            return {**measure(device, **sizes), "source": "measured"}
        except (RuntimeError, ValueError) as exc:  # no such device, out of memory
            sys.stderr.write(f"warning: the card's ceilings not measured ({exc}); ")
            sys.stderr.write("the roofline is at the H200's constants\n")
    return {
        "copy_bytes_per_s": COPY_BW,
        "matmul_flops": MATMUL_FLOPS,
        "h2d_gb_s": HOST_COPY_GB_S,
        "d2h_gb_s": HOST_COPY_GB_S,
        "source": "H200 constants",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="measure the card's ceilings")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--copy-gib", type=float, default=1.0)
    ap.add_argument("--matmul", type=int, default=8192)
    args = ap.parse_args(argv)
    got = measure(args.device, args.copy_gib, args.matmul)
    sys.stdout.write(json.dumps(got, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

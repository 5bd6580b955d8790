"""Running a function on N gloo ranks (processes, forks of the launcher's forkserver, as
the engines' ranks are), and the functions the tensor-parallel tests run there.
Importable by the children (multiprocessing hands them the parent's sys.path, which
holds this folder under pytest)."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batchgen.distributed import destroy_tensor_parallel, init_tensor_parallel
from batchgen.distributed.launchers import forkserver
from batchgen.forward_context import ForwardContext, bind_forward_context
from batchgen.kv.layout import KVLayout
from batchgen.kv.page_pool import PagePool
from batchgen.layers.linear import Linear, merged_shards
from batchgen.layers.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from batchgen.layers.tp_group import TPGroup
from batchgen.models.loader import ModelSource, build_model
from batchgen.runner.batch import NewRequest, ScheduledRequest, SchedulerOutput
from batchgen.runner.model_runner import ModelRunner
from batchgen.sampling_params import SamplingParams


def run_ranks(fn, world_size: int, workdir: Path, *args, timeout_s: float = 90.0) -> list:
    """fn(tp_group, *args) on `world_size` gloo ranks (forks of the forkserver, which
    imports this module too where it starts here); each rank's return value, rank 0
    first. A rank that raises or dies fails the call (the others are killed); ranks
    still running after timeout_s are killed and TimeoutError raised."""
    workdir.mkdir(parents=True, exist_ok=True)
    init = f"file://{workdir.resolve()}/rendezvous"
    forkserver([__name__])  # the server's modules, where it has not started yet
    ctx = mp.start_processes(
        _rank_main,
        args=(fn, world_size, init, str(workdir), args),
        nprocs=world_size,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks still running after {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(10)
    return [torch.load(workdir / f"rank{r}.pt") for r in range(world_size)]


def _rank_main(rank: int, fn, world_size: int, init: str, workdir: str, args) -> None:
    torch.set_num_threads(1)  # two ranks share the machine's cores
    tp = init_tensor_parallel(rank, world_size, "gloo", init, timeout_s=30)
    try:
        torch.save(fn(tp, *args), f"{workdir}/rank{rank}.pt")
        dist.barrier(group=tp.group)  # both ranks done before either tears the group down
    finally:
        destroy_tensor_parallel()
    # a finished rank leaves without the interpreter's teardown: there gloo's threads
    # sometimes abort the process ("terminate called without an active exception",
    # SIGABRT) after its result is saved, seen in two CI runs; a rank that raised above
    # still fails the run through start_processes' error file
    os._exit(0)


def _loaded(layer, tensors: dict[tuple[str, str | None], torch.Tensor]):
    for (param, shard), tensor in tensors.items():
        layer.load(param, tensor, shard)
    return layer


@torch.inference_mode()
def layer_diffs(tp: TPGroup) -> dict[str, float]:
    """Each parallel layer against the full layer on the same random weights and input
    (every rank draws the same ones from one seed): max |difference| by case."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):  # outputs of order 1, so an absolute tolerance means something
        return 0.3 * torch.randn(*shape, generator=g)

    diffs = {}
    hidden, rows = 24, 5
    x = rand(rows, hidden)
    sizes = {"q": 32, "k": 16, "v": 16}
    shards = merged_shards(sizes)
    parts = {
        (p, s): rand(n, hidden) if p == "weight" else rand(n)
        for s, n in sizes.items()
        for p in ("weight", "bias")
    }
    full = _loaded(Linear(hidden, 64, True, shards), parts)
    ref = full(x)
    col = _loaded(ColumnParallelLinear(hidden, 64, True, shards, tp, gather_output=True), parts)
    diffs["column stacked, gathered"] = (col(x) - ref).abs().max().item()
    col.gather_output = False
    slices = [(s + tp.rank * (e - s) // tp.size, (e - s) // tp.size) for s, e in shards.values()]
    mine = torch.cat([ref[:, s : s + n] for s, n in slices], dim=-1)
    diffs["column stacked, local slice"] = (col(x) - mine).abs().max().item()
    whole = {("weight", None): full.weight.clone(), ("bias", None): full.bias.clone()}
    fused = _loaded(ColumnParallelLinear(hidden, 64, True, shards, tp, True), whole)
    diffs["column stacked, loaded fused"] = (fused(x) - ref).abs().max().item()

    inter = 40
    up_w, down_w, down_b = rand(inter, hidden), rand(hidden, inter), rand(hidden)
    up = _loaded(Linear(hidden, inter), {("weight", None): up_w})
    down = _loaded(Linear(inter, hidden, True), {("weight", None): down_w, ("bias", None): down_b})
    ref = down(torch.relu(up(x)))
    pup = _loaded(ColumnParallelLinear(hidden, inter, tp=tp), {("weight", None): up_w})
    pdown = _loaded(
        RowParallelLinear(inter, hidden, True, tp),
        {("weight", None): down_w, ("bias", None): down_b},
    )
    diffs["column -> row (one all-reduce)"] = (pdown(torch.relu(pup(x))) - ref).abs().max().item()
    n = inter // tp.size
    xs = rand(rows, inter)
    partial = RowParallelLinear(inter, hidden, True, tp, reduce_output=False)
    _loaded(partial, {("weight", None): down_w, ("bias", None): down_b})
    summed = tp.all_reduce(partial(xs[:, tp.rank * n : (tp.rank + 1) * n]))
    diffs["row, reduced by the caller"] = (summed - down(xs)).abs().max().item()

    vocab = 37  # not divisible by 2: the last rank's range is padded
    table = rand(vocab, hidden)
    ids = torch.tensor([0, 36, 18, 19, 5, 36, 1])
    emb = _loaded(VocabParallelEmbedding(vocab, hidden, tp), {("weight", None): table})
    diffs["vocab embedding"] = (emb(ids) - table[ids]).abs().max().item()
    diffs["vocab embedding, tied logits"] = (emb.logits(x) - x @ table.t()).abs().max().item()
    head = _loaded(ParallelLMHead(vocab, hidden, tp), {("weight", None): table})
    logits = head(x)
    diffs["lm head"] = (logits - x @ table.t()).abs().max().item()
    diffs["lm head, vocab columns"] = float(logits.shape[-1] != vocab)
    return diffs


# The steps every model run takes (page_size 4): a chunked prefill next to a whole one,
# then a step mixing the chunk's rest, a decode and a new prompt, then pure decodes.
PAGE_SIZE = 4
PAGES = {"a": [3, 0, 7, 1], "b": [2, 5, 4], "c": [6, 8]}
PROMPTS = {
    "a": [5, 9, 13, 4, 100, 7, 8, 200, 11, 12, 50],
    "b": [3, 4, 5, 6, 7, 300],
    "c": [17, 18, 19],
}
DECODE_TOKENS = [[41, 42, 43], [61, 62, 63], [81, 82, 83]]


def scheduled_steps() -> list[SchedulerOutput]:
    params = SamplingParams(temperature=0)

    seen = set()

    def req(rid, tokens, start):  # its pages and fixed data with its first step only
        if rid in seen:
            return ScheduledRequest(rid, tokens, start, [], True)
        seen.add(rid)
        new = NewRequest(params, PROMPTS[rid], [])
        return ScheduledRequest(rid, tokens, start, PAGES[rid], True, new=new)

    a, b, c = PROMPTS["a"], PROMPTS["b"], PROMPTS["c"]
    steps = [
        [req("a", a[:7], 0), req("b", b, 0)],
        [req("a", a[7:], 7), req("b", [21], 6), req("c", c, 0)],
    ]
    for i, (ta, tb, tc) in enumerate(DECODE_TOKENS):
        steps.append([req("a", [ta], 11 + i), req("b", [tb], 7 + i), req("c", [tc], 3 + i)])
    return [SchedulerOutput(requests=s) for s in steps]


@torch.inference_mode()
def model_logits(tp: TPGroup | None, path: str) -> list[torch.Tensor]:
    """Logits of every packed row of each scheduled step, through the model's forward
    (torch attention backend) over this rank's own KV pool."""
    source = ModelSource.resolve(path)
    config = source.load_config()
    cpu = torch.device("cpu")
    model = build_model(source, config, torch.float32, cpu, 64, tp=tp)
    layout = KVLayout.of(model.kv_state, config.num_hidden_layers, PAGE_SIZE, torch.float32)
    assert layout.num_kv_heads == model.num_local_kv_heads
    pool = PagePool(layout, 10, cpu)
    runner = ModelRunner(
        model, pool.layer_caches(), PAGE_SIZE, cpu, config.vocab_size, [2], max_pages=16
    )
    out = []
    for sched in scheduled_steps():
        input_ids, positions, meta, _ = runner.prepare(runner.apply(sched))
        with bind_forward_context(ForwardContext(meta, pool.layer_caches(), "torch")):
            hidden = model(input_ids, positions)
        out.append(model.compute_logits(hidden))
    return out


def layers_and_models(tp: TPGroup, paths: dict[str, str]) -> dict:
    """One start for every check (each builds its models): the layers' max diffs
    and, by architecture, each model's logits."""
    import torch.distributed as dist

    return {
        "layers": layer_diffs(tp),
        "logits": {arch: model_logits(tp, path) for arch, path in paths.items()},
        # the host messages' group: its backend, and whether it is not the tensors' group
        "host_group": (dist.get_backend(tp.host_group), tp.host_group is not tp.group),
    }


def count_mirrored(monkeypatch) -> Counter:
    """From now on, the tier copies rank 0 hands its workers (take_mirrored), counted by
    kind in the returned Counter (in this process: rank 0's)."""
    from batchgen.kv.tiered import TieredKVManager

    sent = Counter()
    take = TieredKVManager.take_mirrored

    def counted(tier):
        copies = take(tier)
        sent.update(c.kind for c in copies)
        return copies

    monkeypatch.setattr(TieredKVManager, "take_mirrored", counted)
    return sent


def fail_on_rank_one(tp: TPGroup, stamp: str) -> None:
    """Rank 1 raises before the collective rank 0 waits in, first writing the time it
    gives up (time.time()) to the file `stamp`."""
    if tp.rank == 1:
        Path(stamp).write_text(repr(time.time()))
        raise RuntimeError("rank 1 gives up")
    tp.all_reduce(torch.ones(3))


def worker_main_skipping_tier_copies(*args) -> None:
    """engine.tp_worker.worker_main with a TierMirror that issues none of the copies it
    is sent (the forward then reads whatever its pages held)."""
    from batchgen.engine import tp_worker
    from batchgen.kv.tier_mirror import TierMirror

    TierMirror.issue = lambda self, copies, forward=True: []
    tp_worker.worker_main(*args)


FAILING_POOL_PAGES = 29  # a page count whose pool a worker cannot allocate


def worker_main_failing_a_pool(*args) -> None:
    """engine.tp_worker.worker_main whose device pool of FAILING_POOL_PAGES pages fails
    to allocate, as an out-of-memory would."""
    from batchgen.engine import memory, tp_worker

    make = memory.PagePool

    def pool(layout, num_pages, device):
        if num_pages == FAILING_POOL_PAGES:
            raise RuntimeError("out of memory (simulated)")
        return make(layout, num_pages, device)

    memory.PagePool = pool  # the pools reconfigure() makes
    tp_worker.worker_main(*args)


def kda_layer_runs(tp: TPGroup, path: str) -> dict:
    """One KDA layer with every head (tp None) and this rank's share, loaded from the
    same full checkpoint tensors, through two packed steps over their own state pools:
    a prefill of two fresh requests, then a decode row each continuing from its slot.
    Both layers' outputs and final slots."""
    from kimi_checkpoints import run_kda_step
    from transformers import KimiLinearConfig

    from batchgen.engine.memory import state_layout
    from batchgen.kv.state_pool import StatePool
    from batchgen.layers.kda import KimiDeltaAttention

    data = torch.load(path)
    config = KimiLinearConfig(**data["config"])
    runs = {}
    for name, group in (("full", None), ("part", tp)):
        layer = KimiDeltaAttention(config, 0, 0, chunk_size=4, tp=group)
        for weight, tensor in data["weights"].items():
            layer.load_weight(weight, tensor)
        layout = state_layout(SimpleNamespace(linear_layers=[layer]), torch.float32)
        pool = StatePool(layout, 3, "cpu")
        outs = [torch.cat(run_kda_step(layer, pool, step)) for step in data["steps"]]
        runs[name] = {"outputs": outs, "states": pool.states.clone(), "windows": pool.windows}
    return runs


def _refuse_to_unpickle():
    raise RuntimeError("this worker cannot start")


class DiesWhileStarting:
    """An argument whose unpickling raises: a worker handed it ends in multiprocessing's
    bootstrap, before it runs anything of ours (as one re-running an unguarded script
    does)."""

    def __reduce__(self):
        return (_refuse_to_unpickle, ())


def never_called(tp: TPGroup, *args) -> None:
    raise AssertionError("a worker that died while starting ran its target")


def fails_once_joined(tp: TPGroup) -> None:
    """A worker whose build fails after it joined the group (a bad checkpoint, no memory)."""
    raise RuntimeError(f"rank {tp.rank} could not build its share")


def answer_rank(tp: TPGroup) -> None:
    """A worker that answers each message rank 0 asks with its rank (test_tp_idle.py)."""
    from batchgen.distributed.worker_rank import serve

    serve(tp, lambda message: tp.rank)


def answer_environ(tp: TPGroup, name: str) -> None:
    """A worker that says on stderr it started, then answers each message rank 0 asks
    with its environment's `name`."""
    import sys

    from batchgen.distributed.worker_rank import serve

    print(f"rank {tp.rank} started", file=sys.stderr, flush=True)
    serve(tp, lambda message: os.environ.get(name))

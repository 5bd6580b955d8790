"""W7's host time on the CPU: `batchgen run`'s path over W7's requests, the forward and
the sampler's arithmetic excluded, in milliseconds a step by phase.

    PYTHONPATH=src python3 -m benchmarks.host_overhead --chat 2048            # ~900 rows
    PYTHONPATH=src python3 -m benchmarks.chat_host --requests 2048 --out DIR  # the same
    PYTHONPATH=src python3 -m benchmarks.chat_host --requests 2048 --greedy --out DIR

W7 (chat_job.py) is host-bound on the GPU: the default model's step is a few ms of GPU
work at ~900 rows, the host's bookkeeping tens. This measures that bookkeeping where no
GPU is: the job (`batch_job.run_batch_job`, as `batchgen run` calls it: W7's batch lines,
temperature 1.0, top_p 1.0, a seed per line from the run's seed 0, EOS endings) on an
engine whose model is the default model's architecture shrunk to 2 layers of width 64
(random weights) with its real tokenizer and chat template (read from the default
model's GGUF) and vocabulary, so prompts, detokenization, EOS and output lines are
W7's; pipelined decode as on the GPU; max_num_seqs --rows.

The sampler's arithmetic over [rows, 49152] logits is seconds a step on a CPU (a GPU's
work, left out anyway): the lm_head and the sampler are replaced by a stand-in whose
token for a row is a hash of the row's seed and position (its request's draws depend on
them alone, as the real sampler's: two trees that batch rows differently give the same
answers), EOS (id 2) with probability 1/--eos-every (W7's default-model answers mostly
end by EOS before max_tokens), so a run of ~900 rows takes minutes; everything before
the sampler (its metadata) and after it runs as it is.

--greedy runs the same lines at temperature 0 (as chat_job.py's greedy run: the job's
parameters, seeds included, temperature 0): every row is plain greedy, so the runner
builds no sampling metadata and takes its argmax path, whose logits are a stand-in
(`GreedyLogits`) whose argmax is the same hash of the row's request seed and output index:
the same tokens, steps and output lines as the sampled run, so the two runs' host times
compare step for step.

Timed per step (each call's time added to its phase; `forward` and `sample` are the
model's and the stand-in sampler's, the GPU's work, left out of `host`):

    cycle          one engine.step() start to the next (the job loop's whole turn)
    schedule       Scheduler.schedule             prepare   ModelRunner.prepare
    sampling_meta  SamplingState.build_for        update    Scheduler.update
    detok          Detokenizer.finalize (find_stop is called only for requests with stop
                   strings, none in W7)
    outputs        the job's output lines         journal   Appender.write (OUTPUT, errors)
    admit          reading and adding input lines
    apply          ModelRunner.apply (the runner's record of the step's rows)
    pipelined_ids  the input ids read from the step before's tokens (ModelRunner._pipelined_ids)
    next_decode    step_loop's next_decode (a blind step built while one runs)
    launch         the rest of launch_decode, launch_step and _launch_sample (the step's
                   InFlightDecode, its sample steps, logits, the tokens' copy)
    result         InFlightDecode.result (the step's tokens to the host, its output)
    finish_step    the rest of EngineCore._finish_step (the finished requests handed out)
    eager_forward  the rest of ModelRunner._forward: the eager forward's bookkeeping (its
                   context, the module call), this CPU's alone: a GPU decode step replays
                   a graph (`_replay`: its columns, `graphs.run`) instead, and `prepare`
                   is not called for it either
    host           cycle - forward - sample; other = host - the phases above

A phase's time excludes the calls of other phases made inside it (launch_decode's holds
apply, pipelined_ids, prepare, the forward and the sampling's), so the phases add up to
the host's time less `other`: the engine's and the job's loops between them.

With --clock thread every time above is the CPU time of the thread that runs the job
loop (time.thread_time), not elapsed time: on a CPU other processes share, the time they
take it is not counted, so two trees' figures compare in alternating runs (the job's
other threads, if any, are not counted either).

--work holds the tiny checkpoint (written once, shared by the runs that name it) and a
run-* folder for each run's batch file and output lines (the result's "output": two
trees' answers compare line by line).

Prints a JSON summary (medians over the steps with at least 0.8 x --rows rows, and the
mean over all; `scheduled_steps`: the steps that called Scheduler.schedule, the others
built blind by pipeline.next_decode; `sync_scheduled_steps`: those that called it with no
step in flight, a GPU idle meanwhile) and writes chat_host.json into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from benchmarks.chat_job import batch_lines
from benchmarks.engine_runs import timed_into
from benchmarks.workloads import TINY_SMOLLM2

HOST_PHASES = ("schedule", "prepare", "sampling_meta", "update", "detok", "outputs", "journal")
HOST_PHASES += ("admit", "apply", "pipelined_ids", "next_decode", "launch", "result")
HOST_PHASES += ("finish_step", "eager_forward")
DEVICE_PHASES = ("forward", "sample")
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def tiny_default_model(path: Path) -> Path:
    """A directory with TINY_SMOLLM2's config.json and the default model's tokenizer."""
    if (path / "config.json").is_file():
        return path
    import transformers

    from batchgen.models.default_model import default_model_path

    gguf = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(path)
    cfg = transformers.AutoConfig.for_model(**TINY_SMOLLM2, dtype="float32")
    cfg.save_pretrained(path)  # last: a directory with config.json is complete
    return path


class StandInSampler:
    """Tokens for the rows of `logits` (the hidden states: the lm_head is skipped), each a
    hash of its row's seed and position (`meta.seeds`, `meta.positions`): EOS with
    probability about 1/eos_every, else a token of 3..vocab-1.

    Called with meta None (a greedy run: `GreedyLogits.argmax`), the same hash of each
    row's request seed (`seed` of its fixed data, what the sampled run's `meta.seeds`
    holds) and output index (the step's `steps`): a greedy run's tokens are the sampled
    run's."""

    def __init__(self, vocab: int, eos: int, eos_every: int) -> None:
        self.vocab, self.eos, self.eos_every = vocab, eos, eos_every

    def __call__(self, logits, meta):
        from batchgen.runner.sampler import SamplerOutput

        if meta is None:
            seeds, positions = logits.keys()
        else:
            seeds, positions = meta.seeds.cpu(), meta.positions.cpu()
        # a multiply-xorshift mix in int64 (products wrap), masked to 62 bits
        x = seeds * 0x5851F42D4C957F2D + (positions + 1) * 0x14057B7EF767814F
        x = (x ^ (x >> 31)) * 0x2545F4914F6CDD1D
        x = (x ^ (x >> 29)) & ((1 << 62) - 1)
        tokens = 3 + x % (self.vocab - 3)
        stop = (x >> 20) % self.eos_every == 0
        return SamplerOutput(tokens.masked_fill(stop, self.eos), None, None, None, None)


class GreedyLogits:
    """A greedy step's stand-in logits: the rows that sample (`StepRows` or `StepRow`s,
    each with its fixed data's `seed`) and their output indices; `argmax` is the stand-in
    sampler's draw for them (`sampler()`, read when called: the timed one), what the
    runner's plain-greedy path takes from real logits."""

    def __init__(self, rows, steps, sampler) -> None:
        self.rows, self.steps, self.sampler = rows, steps, sampler

    def keys(self):
        """(seeds [n] int64 as the sampling metadata holds them, positions [n] int64)."""
        import torch

        fixed = getattr(self.rows, "fixed", self.rows)
        seeds = [(f.seed or 0) & (2**64 - 1) for f in fixed]
        seeds = [s - (s >> 63 << 64) for s in seeds]  # two's complement, as `meta.seeds`
        positions = torch.as_tensor(self.steps, dtype=torch.int64).reshape(len(seeds))
        return torch.tensor(seeds, dtype=torch.int64), positions

    def argmax(self, dim: int = -1):
        return self.sampler()(self, None).sampled_token_ids


def greedy_stand_in(runner) -> None:
    """The runner's two sampling calls (`_launch_sample`, `_sample`) given `GreedyLogits`
    for their rows in place of the logits (set on the instance; `del` them after)."""
    launch, sample = runner._launch_sample, runner._sample
    sampler = lambda: runner.sampler  # noqa: E731 (the timed one, read when called)

    def launch_sample(flight, logits, steps):
        return launch(flight, GreedyLogits(flight.sampled, steps, sampler), steps)

    def sample_rows(logits, sampled):
        steps = [r.num_output_tokens for r in sampled]
        return sample(GreedyLogits(sampled, steps, sampler), sampled)

    runner._launch_sample, runner._sample = launch_sample, sample_rows


@contextmanager
def _wrapped(owner, attr: str, spent: dict[str, float], name: str, clock, open_calls: list):
    """owner.attr timed into spent[name] by `clock`, the calls it makes to the other
    phases excluded (`engine_runs.timed_into` with `open_calls`), while the block runs
    (a class or module attribute is put back after it; an instance's own attribute is
    removed)."""
    had = attr in vars(owner)
    original = getattr(owner, attr)
    setattr(owner, attr, timed_into(spent, name, original, clock, open_calls))
    try:
        yield
    finally:
        if had:
            setattr(owner, attr, original)
        else:
            delattr(owner, attr)


@contextmanager
def profiled(path: Path | None):
    """The block under cProfile, its stats written to `path` (its folders made first) as
    it ends; nothing where `path` is None."""
    if path is None:
        yield
        return
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        path.parent.mkdir(parents=True, exist_ok=True)
        profile.dump_stats(path)


def run(args) -> dict:
    from batchgen.api import batch_job, batch_journal
    from batchgen.api.batch_summary import JobOptions
    from batchgen.api.llm import LLM
    from batchgen.engine import engine_core, step_loop
    from batchgen.runner.in_flight import InFlightDecode

    args.work.mkdir(parents=True, exist_ok=True)
    ckpt = tiny_default_model(args.work / "tiny_smollm2")
    # the batch file and the job's output in a folder of this run's own: --work is shared
    # by every run on the machine (the checkpoint is written once, complete or not there)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=args.work))
    path = run_dir / "w7.jsonl"
    out = run_dir / "w7.out.jsonl"
    lines = batch_lines(args.requests)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    llm = LLM(
        model=str(ckpt),
        load_format="dummy",
        dtype="float32",
        device="cpu",
        max_num_seqs=args.rows,
        max_model_len=1024,
        seed=0,
    )
    eng = llm.engine
    opts = JobOptions(
        input=path,
        output=out,
        model_name="tiny",
        defaults={"max_tokens": None, "temperature": 0.0 if args.greedy else 1.0, "top_p": 1.0},
        seed=0,
        max_in_flight=eng.config.read_ahead,
        progress=False,
    )
    spent: dict[str, float] = {}
    open_calls: list = []  # the timed calls under way (timed_into)
    steps: list[dict] = []
    state = {"start": None, "rows": 0, "idle": False}
    step, clock = eng.step, CLOCKS[args.clock]

    def timed_step():
        now = clock()
        if state["start"] is not None:  # the turn that ended now
            row = {k: v * 1e3 for k, v in spent.items()}
            row["cycle"] = (now - state["start"]) * 1e3
            row["rows"] = state["rows"]
            row["idle"] = state["idle"]
            steps.append(row)
        spent.clear()
        state["start"] = now
        state["idle"] = eng._in_flight is None  # nothing queued: the device waits for it
        return step()

    def rows_of(fn):
        def wrapper(sched, *a, **k):
            state["rows"] = max(state["rows"], len(sched.requests))
            return fn(sched, *a, **k)

        return wrapper

    runner, sched, detok = eng.runner, eng.scheduler, eng.detokenizer
    wraps = [
        (runner, "prepare", "prepare"),
        (runner.sampling, "build_for", "sampling_meta"),
        (runner.model, "forward", "forward"),
        (runner, "sampler", "sample"),
        (sched, "schedule", "schedule"),
        (sched, "update", "update"),
        (detok, "finalize", "detok"),
        (batch_job._Job, "_finish", "outputs"),
        (batch_job._Job, "_admit", "admit"),
        (batch_journal.Appender, "write", "journal"),
        (runner, "apply", "apply"),
        (runner, "_pipelined_ids", "pipelined_ids"),
        (step_loop, "next_decode", "next_decode"),
        (runner, "launch_decode", "launch"),
        (runner, "launch_step", "launch"),
        (runner, "_launch_sample", "launch"),
        (InFlightDecode, "result", "result"),
        (engine_core.EngineCore, "_finish_step", "finish_step"),
        (runner, "_forward", "eager_forward"),
    ]
    sched.update = rows_of(sched.update)  # counts each step's rows (inside its timer)
    runner.model.compute_logits = lambda hidden: hidden  # the stand-in reads the rows only
    runner.sampler = StandInSampler(TINY_SMOLLM2["vocab_size"], 2, args.eos_every)
    if args.greedy:
        greedy_stand_in(runner)
    with ExitStack() as stack:
        for owner, attr, name in wraps:
            stack.enter_context(_wrapped(owner, attr, spent, name, clock, open_calls))
        eng.step = timed_step
        try:
            with profiled(args.profile):
                start = time.perf_counter()
                summary = batch_job.run_batch_job(llm, opts)
                wall = time.perf_counter() - start
        finally:
            del eng.step
    del sched.update, runner.model.compute_logits
    if args.greedy:
        del runner._launch_sample, runner._sample
    for row in steps:
        row["host"] = row["cycle"] - sum(row.get(k, 0.0) for k in DEVICE_PHASES)
        row["other"] = row["host"] - sum(row.get(k, 0.0) for k in HOST_PHASES)
    keys = ("host", *HOST_PHASES, "other", *DEVICE_PHASES, "cycle")
    full = [r for r in steps if r["rows"] >= 0.8 * args.rows] or steps

    def median(k):
        vals = sorted(r.get(k, 0.0) for r in full)
        return round(vals[len(vals) // 2], 2)

    return {
        "requests": args.requests,
        "rows": args.rows,
        "overlap": eng.overlap.name,
        "clock": args.clock,
        "greedy": args.greedy,
        "steps": len(steps),
        "full_steps": len(full),
        "scheduled_steps": sum("schedule" in r for r in steps),  # the rest built blind
        # scheduled with no step in flight: a GPU would idle while the host schedules
        "sync_scheduled_steps": sum("schedule" in r and r["idle"] for r in steps),
        "wall_s": round(wall, 2),
        "output": str(out),  # the job's lines, kept: two trees' answers compare
        "succeeded": summary.succeeded,
        "completion_tokens": summary.completion_tokens,
        "median_ms_full_steps": {k: median(k) for k in keys},
        "mean_ms_all_steps": {
            k: round(sum(r.get(k, 0.0) for r in steps) / max(1, len(steps)), 2) for k in keys
        },
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=900, help="max_num_seqs")
    ap.add_argument("--work", type=Path, default=Path("/tmp/batchgen-chat-host"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--eos-every", type=int, default=160, help="1/P(EOS) a token")
    ap.add_argument(
        "--greedy",
        action="store_true",
        help="the same lines at temperature 0 (chat_job's greedy run): the same tokens",
    )
    ap.add_argument("--profile", type=Path, default=None, help="write cProfile stats here")
    ap.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="wall",
        help="wall: elapsed time; thread: the step loop thread's CPU time (on a shared "
        "CPU, not the time other processes took it)",
    )
    args = ap.parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "chat_host.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

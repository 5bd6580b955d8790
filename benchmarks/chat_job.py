"""W7 `chat-job`: a user's job end to end, `batchgen run` beside `LLM.chat` (BENCHMARKS.md).

    PYTHONPATH=src python3 -m benchmarks.chat_job --out DIR                 # 8,192 requests
    PYTHONPATH=src python3 -m benchmarks.chat_job --requests 48 --device cpu --out DIR

The default model (its real weights), N chat requests {"role": "user", "content": "Write
about {topic} in the style of entry {i}."} (12 topics), max_tokens 64 + (i % 8) * 24, no
temperature (OpenAI's default, 1.0) and no seed, written as an OpenAI batch file. Runs, in
one process, each on an engine of its own built with the same settings:

1. `batchgen run FILE -o OUT` (the command's main() in process): wall time from the call
   to its return, the process's first engine build included, and the job's own clock
   (job_s, from its summary line), which compares with run 2's wall_s.
2. `LLM.chat` on the same conversations, each with the SamplingParams the job gives its
   line (batch_requests.prepare_line: the seed derived from the run's seed 0, the
   custom_id and the sample index): how many of the N answers equal the job's line for that custom_id, text
   and finish reason.
3. The same requests greedy (temperature 0) through `LLM.chat`: the sampled job beside
   greedy on the same engine settings.

The job admits a bounded window of lines (4 x max_num_seqs) while LLM.chat adds every
request at once, so with the default prefix-first admission the two may batch rows
differently; a row whose batch differs can round differently and, once sampled or at a
near-tie, take another token. `--admission arrival` makes both admit in input order.

Each run also reports its steps (`StepMeter`): ms a step over the stepping window (the
first step's start to the last one's end), the host's ms a step (the window less the
time the host waited for tokens: `InFlightDecode.result`, a synchronous step's sampling
and read-back) and, on a GPU, the GPU's busy ms a step and busy fraction of the window
(CUDA events around every call that queues a step's GPU work: the runner's forward, the
lm_head, the sampling; time between a call's events counts as busy even where the GPU
waited for the host's launches inside it, so the fraction is an upper bound; a call
made while a CUDA graph is captured, as the sampling tail's lm_head is at the first
sampled step, records no events: events recorded into a capture have no time to read).
Prints a JSON summary and writes chat_job.json into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path

TOPICS = (
    "the sea",
    "a mountain village",
    "trains",
    "the history of bread",
    "honeybees",
    "a rainy city",
    "chess",
    "the moon",
    "old maps",
    "a lighthouse keeper",
    "desert plants",
    "jazz",
)


def batch_lines(n: int) -> list[dict]:
    """W7's requests as OpenAI batch lines."""
    return [
        {
            "custom_id": f"entry-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [
                    {
                        "role": "user",
                        "content": f"Write about {TOPICS[i % len(TOPICS)]} in the style of "
                        f"entry {i}.",
                    }
                ],
                "max_tokens": 64 + (i % 8) * 24,
            },
        }
        for i in range(n)
    ]


def chat_engine_kwargs(args) -> dict:
    kw = dict(device=args.device, admission=args.admission)
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    return kw


class StepMeter:
    """The steps of the engines built while it is entered, measured (module docstring):
    `summary()` after the block."""

    def __init__(self, gpu: bool) -> None:
        self.gpu = gpu
        self.events: list = []  # (step index, start, end): CUDA event pairs by step
        self.steps = 0
        self.first = self.last = None  # the stepping window (perf_counter)
        self.wait_s = 0.0
        self._stack = ExitStack()

    def __enter__(self) -> StepMeter:
        from batchgen.engine.engine_core import EngineCore
        from batchgen.runner.in_flight import InFlightDecode
        from batchgen.runner.model_runner import ModelRunner

        self._patch(EngineCore, "step", self._step)
        self._patch(InFlightDecode, "result", self._waited)
        self._patch(ModelRunner, "_sample", self._waited)
        if self.gpu:
            for name in ("_forward", "_launch_sample", "_sample"):
                self._patch(ModelRunner, name, self._on_gpu)
        self._models: set[int] = set()
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _patch(self, cls: type, attr: str, wrap) -> None:
        """cls.attr (defined by cls itself) wrapped until the block ends."""
        original = vars(cls)[attr]
        setattr(cls, attr, wrap(original))
        self._stack.callback(setattr, cls, attr, original)

    def _step(self, fn):
        def step(engine, *a, **k):
            model = engine.runner.model
            if self.gpu and id(model) not in self._models:  # the lm_head, per instance
                self._models.add(id(model))
                model.compute_logits = self._on_gpu(model.compute_logits)
                self._stack.callback(delattr, model, "compute_logits")
            start = time.perf_counter()
            try:
                return fn(engine, *a, **k)
            finally:
                self.last = time.perf_counter()
                self.first = start if self.first is None else self.first
                self.steps += 1

        return step

    def _waited(self, fn):
        def waited(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.wait_s += time.perf_counter() - start

        return waited

    def _on_gpu(self, fn):
        import torch

        def on_gpu(*a, **k):
            if torch.cuda.is_current_stream_capturing():  # a graph's capture: no events
                return fn(*a, **k)  # (the sampling tail's lm_head is captured mid-step)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return fn(*a, **k)
            finally:
                end.record()
                self.events.append((self.steps, start, end))

        return on_gpu

    def gpu_ms_by_step(self) -> list[float]:
        """GPU busy ms of each step, by its index (on a GPU, after the block)."""
        import torch

        torch.cuda.synchronize()
        busy = [0.0] * self.steps
        for step, s, e in self.events:
            if step < self.steps:
                busy[step] += s.elapsed_time(e)
        return busy

    def summary(self) -> dict:
        if not self.steps:
            return {"steps": 0}
        window = self.last - self.first
        out = {
            "steps": self.steps,
            "ms_per_step": round(window * 1e3 / self.steps, 3),
            "host_ms_per_step": round((window - self.wait_s) * 1e3 / self.steps, 3),
        }
        if self.gpu and self.events:
            busy_ms = sum(self.gpu_ms_by_step())
            out["gpu_busy_ms_per_step"] = round(busy_ms / self.steps, 3)
            out["gpu_busy_fraction"] = round(busy_ms / (window * 1e3), 4)
        return out


def on_gpu(device: str) -> bool:
    import torch

    return device != "cpu" and torch.cuda.is_available()


def run_job(args, path: Path, out: Path) -> dict:
    """`batchgen run` in process: the call's wall (the engine's build included: the
    process's first, so any Triton compile lands here) and the job's own clock from its
    summary line (the run alone, as LLM.chat's wall_s); answers read back from OUTPUT."""
    import logging
    import re

    from batchgen.api import cli

    argv = ["run", str(path), "-o", str(out), "--device", args.device]
    if args.max_num_seqs:
        argv += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.admission != "prefix":
        return {"skipped": "batchgen run has no --admission flag"}
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("batchgen.api.run_command").addHandler(handler)
    try:
        with StepMeter(on_gpu(args.device)) as meter:
            start = time.perf_counter()
            code = cli.main(argv)
            wall = time.perf_counter() - start
    finally:
        logging.getLogger("batchgen.api.run_command").removeHandler(handler)
    done = next((m for m in said if m.startswith("done:")), "")
    clock = re.search(r"; ([\d.]+) s, [\d.]+ output tok/s", done)
    answers = read_answers(out)
    tokens = sum(a["completion_tokens"] for a in answers.values())
    result = {"exit_code": code, "wall_s": round(wall, 2), "lines": len(answers), "tokens": tokens}
    result["steps"] = meter.summary()
    if clock:
        result["job_s"] = float(clock.group(1))
        result["job_tok_s"] = round(tokens / result["job_s"], 1)
    return result


def read_answers(out: Path) -> dict[str, dict]:
    answers = {}
    for raw in out.read_bytes().split(b"\n")[:-1]:  # not splitlines(): U+2028 is text
        line = json.loads(raw)
        body = line["response"]["body"]
        choice = body["choices"][0]
        answers[line["custom_id"]] = {
            "text": choice["message"]["content"],
            "finish_reason": choice["finish_reason"],
            "completion_tokens": body["usage"]["completion_tokens"],
        }
    return answers


def job_params(llm, lines: list[dict]):
    """(conversations, SamplingParams) as `batchgen run` makes them for each line with its
    defaults (--temperature 1.0, --top-p 1.0, --seed 0)."""
    from batchgen.api import batch_file as bf
    from batchgen.api.batch_requests import prepare_line

    defaults = {"max_tokens": None, "temperature": 1.0, "top_p": 1.0}
    conversations, params = [], []
    for number, line in enumerate(lines, start=1):
        item = bf.parse_line(json.dumps(line).encode(), number)
        _, _, (child,) = prepare_line(llm, item, defaults, 0)
        conversations.append(item.body["messages"])
        params.append(child)
    return conversations, params


def run_chat(args, lines: list[dict], greedy: bool) -> tuple[dict, dict[str, dict]]:
    from dataclasses import replace

    from batchgen import LLM

    start = time.perf_counter()
    llm = LLM(**chat_engine_kwargs(args))
    build_s = time.perf_counter() - start
    try:
        conversations, params = job_params(llm, lines)
        if greedy:
            params = [replace(p, temperature=0.0) for p in params]
        with StepMeter(on_gpu(args.device)) as meter:
            start = time.perf_counter()
            outs = llm.chat(conversations, params, use_tqdm=False)
            wall = time.perf_counter() - start
    finally:
        llm.engine.shutdown()
    answers = {
        line["custom_id"]: {
            "text": o.outputs[0].text,
            "finish_reason": o.outputs[0].finish_reason,
            "completion_tokens": len(o.outputs[0].token_ids),
        }
        for line, o in zip(lines, outs, strict=True)
    }
    tokens = sum(a["completion_tokens"] for a in answers.values())
    run = {"build_s": round(build_s, 2), "wall_s": round(wall, 2), "tokens": tokens}
    run["steps"] = meter.summary()
    return {**run, "tok_s": round(tokens / wall, 1)}, answers


def compare(job: dict[str, dict], chat: dict[str, dict]) -> dict:
    same_text = sum(job.get(k, {}).get("text") == v["text"] for k, v in chat.items())
    same = sum(job.get(k) == v for k, v in chat.items())
    return {"requests": len(chat), "same_text": same_text, "same_text_and_finish": same}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8192)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--admission", default="prefix", choices=["prefix", "arrival"])
    ap.add_argument("--skip-greedy", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = batch_lines(args.requests)
    path = args.out / "chat_job.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    out = args.out / "chat_job.out.jsonl"
    for stale in (out, Path(f"{out}.errors.jsonl")):
        stale.unlink(missing_ok=True)
    result: dict = {"requests": args.requests, "admission": args.admission}
    result["batchgen_run"] = run_job(args, path, out)
    result["chat_sampled"], chat = run_chat(args, lines, greedy=False)
    if "skipped" not in result["batchgen_run"]:
        result["batchgen_run"]["tok_s"] = round(
            result["batchgen_run"]["tokens"] / result["batchgen_run"]["wall_s"], 1
        )
        result["run_vs_chat"] = compare(read_answers(out), chat)
    if not args.skip_greedy:
        result["chat_greedy"], _ = run_chat(args, lines, greedy=True)
        result["sampled_vs_greedy"] = round(
            result["chat_sampled"]["tok_s"] / result["chat_greedy"]["tok_s"], 3
        )
    (args.out / "chat_job.json").write_text(json.dumps(result, indent=2) + "\n")
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

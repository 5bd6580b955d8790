"""Steps are plain data: a step that went through pickle (as a tensor-parallel worker gets
it) runs exactly as the step itself, and the runner keeps its own page rows, writing
only the pages a step adds."""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from batchgen.engine.request import Request
from batchgen.engine.scheduler import Scheduler
from batchgen.kv.kv_manager import KVCacheManager
from batchgen.kv.layout import KVLayout
from batchgen.kv.page_allocator import PageAllocator
from batchgen.kv.page_pool import PagePool
from batchgen.models.loader import ModelSource, build_model
from batchgen.runner.model_runner import ModelRunner
from batchgen.sampling_params import SamplingParams

PS = 4
MAX_LEN = 128
EOS = [2]


@pytest.fixture(scope="module")
def model(tiny_llama):
    source = ModelSource.resolve(tiny_llama)
    config = source.load_config()
    return build_model(source, config, torch.float32, torch.device("cpu"), MAX_LEN), config


def runner_and_pool(model, num_pages: int) -> tuple[ModelRunner, PagePool]:
    net, config = model
    layout = KVLayout.of(net.kv_state, config.num_hidden_layers, PS, torch.float32)
    pool = PagePool(layout, num_pages, torch.device("cpu"))
    runner = ModelRunner(
        net,
        pool.layer_caches(),
        PS,
        torch.device("cpu"),
        config.vocab_size,
        EOS,
        max_num_seqs=4,
        max_pages=MAX_LEN // PS,
        seed=7,
    )
    return runner, pool


def scheduler(num_pages: int, budget: int, prompts, params) -> tuple[Scheduler, dict]:
    kv = KVCacheManager(PageAllocator(num_pages, True), PS)
    sched = Scheduler(kv, 4, budget, MAX_LEN, EOS)
    requests = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        req = Request(f"r{i}", prompt, p, p.max_tokens, arrival=i, seed=p.seed)
        requests[req.request_id] = req
        sched.add(req)
    return sched, requests


def test_a_pickled_step_gives_the_same_runner_outputs(model):
    """Chunked prefills, sampling with seeds, penalties, min_tokens, logprobs and
    prompt logprobs, and preemptions (a pool too small for every request: released
    requests come back whole, with their output so far): two runners, one given each
    step and one its pickled copy, sample the same tokens and logprobs and write the
    same KV."""
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(9)]
    prompts = [
        shared + [rng.randrange(3, 500) for _ in range(rng.randrange(3, 30))] for _ in range(6)
    ]
    params = [
        SamplingParams(max_tokens=12, temperature=0),
        SamplingParams(max_tokens=10, temperature=0.9, seed=3, logprobs=2),
        SamplingParams(max_tokens=9, temperature=0.8, presence_penalty=0.5, repetition_penalty=1.2),
        SamplingParams(max_tokens=8, temperature=0, min_tokens=4, prompt_logprobs=1),
        SamplingParams(max_tokens=11, temperature=1.0, top_k=20, frequency_penalty=0.3, seed=5),
        SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9),
    ]
    num_pages = 24
    sched, requests = scheduler(num_pages, 24, prompts, params)
    direct, direct_pool = runner_and_pool(model, num_pages)
    wired, wired_pool = runner_and_pool(model, num_pages)
    steps = new = preempted = 0
    while sched.has_unfinished:
        step = sched.schedule()
        assert not sched.take_copies().wait_for  # no host tier: nothing to wait for
        copy = pickle.loads(pickle.dumps(step))
        assert copy == step
        want = direct.execute(step)
        got = wired.execute(copy)
        assert got == want
        sched.update(step, want, requests)
        steps += 1
        new += sum(r.new is not None for r in step.requests)
        preempted += len(step.preempted_ids)
        assert steps < 400
    assert preempted > 0 and new > len(prompts)  # some requests were sent whole again
    assert torch.equal(direct_pool.kv, wired_pool.kv)


def test_a_worker_writes_only_the_pages_a_step_adds(model):
    """A tensor-parallel worker runs each step from its pickled copy
    (ModelRunner.execute_unsampled): its page rows get the pages each step adds, so a
    decode step writes at most a page a request, however many pages they hold; and the
    rows hold each request's whole page list."""
    prompts = [list(range(10 + 40 * i, 50 + 40 * i)) for i in range(4)]  # 10 pages each
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * 4
    num_pages = 64
    sched, requests = scheduler(num_pages, 256, prompts, params)
    rank0, _ = runner_and_pool(model, num_pages)
    worker, _ = runner_and_pool(model, num_pages)
    rows = worker.batch.page_rows
    write = rows.write
    written = []

    def counted(request_id, row, pages):
        written[-1] += len(pages)
        write(request_id, row, pages)

    rows.write = counted
    decode_steps = []
    while sched.has_unfinished:
        step = sched.schedule()
        written.append(0)
        worker.execute_unsampled(pickle.loads(pickle.dumps(step)))
        out = rank0.execute(step)
        added = sum(len(r.new_pages) for r in step.requests)
        assert written[-1] == added
        held = sum(len(sched.kv.pages[r.request_id]) for r in step.requests)
        if all(len(r.new_token_ids) == 1 for r in step.requests):
            decode_steps.append((written[-1], held))
            assert written[-1] <= len(step.requests)
        for r in step.requests:
            pages = sched.kv.pages[r.request_id]
            row = rows._row_of[r.request_id]
            assert rows.table[row, : len(pages)].tolist() == pages
        sched.update(step, out, requests)
    assert len(decode_steps) >= 20
    assert sum(w for w, _ in decode_steps) < sum(h for _, h in decode_steps) / 10
    assert any(w == 0 for w, _ in decode_steps)  # no request crossed a page boundary

"""The decode graph's sampler (runner/graph_sampling.py) called eagerly on the CPU: from
its static words it must draw exactly the tokens `Sampler` draws for the same rows and
seeds, and add the same tokens to the kept penalty counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchgen.runner.cuda_graphs import DecodeGraphs
from batchgen.runner.graph_sampling import (
    MAX_TOP_K,
    GraphTail,
    StaticColumns,
    Variant,
    pack,
    sample_static,
    variant_of,
    words_per_bucket,
)
from batchgen.runner.penalty_counts import PenaltyCounts
from batchgen.runner.sampler import Sampler, SamplingState
from batchgen.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 300

MIXED = [
    dict(temperature=0.8, top_p=0.95),
    dict(temperature=0.0),
    dict(temperature=1.3, top_k=7),
    dict(temperature=0.7, min_p=0.2, top_p=0.9),
    dict(temperature=1.0),
    dict(temperature=0.6, top_k=40, top_p=0.8),
]
PENALISED = [
    dict(temperature=0.8, top_p=0.95, repetition_penalty=1.3),
    dict(temperature=0.9, frequency_penalty=0.5, top_k=20),
    dict(temperature=0.0, presence_penalty=0.7),
    dict(temperature=1.1, top_p=0.9),  # no penalty, in a penalised batch
]


def _state() -> SamplingState:
    return SamplingState(VOCAB, CPU, [2], None, PenaltyCounts(VOCAB, CPU))


def _steps(configs, bs, kernels, steps=3, seed=0):
    """Tokens per step from Sampler (one state) and sample_static on `pack`'s words for
    bucket bs (another state), and both states' kept counts at the end."""
    n = len(configs)
    gen = torch.Generator().manual_seed(seed)
    params = [SamplingParams(seed=100 + i, **kw) for i, kw in enumerate(configs)]
    ids = [f"r{i}" for i in range(n)]
    prompts = [torch.randint(0, VOCAB, (12,), generator=gen).tolist() for _ in range(n)]
    outputs = [torch.randint(0, VOCAB, (5,), generator=gen).tolist() for _ in range(n)]
    eager, static = _state(), _state()
    sampler = Sampler(kernels=kernels)
    got, want = [], []
    for _ in range(steps):
        logits = torch.randn(bs, VOCAB, generator=gen) * 3
        positions = [len(o) for o in outputs]
        meta = eager.build(ids, params, prompts, outputs, positions)
        tokens = sampler(logits[:n], meta).sampled_token_ids
        meta.record(tokens)
        cols = static.columns(ids, params, prompts, outputs, positions)
        variant = variant_of(cols, VOCAB)
        assert variant is not None
        words = torch.from_numpy(pack(cols, bs))
        view = StaticColumns.view(words, bs)
        drawn = sample_static(logits, view, variant, static.penalty_counts, kernels)
        if variant.penalties:
            static.penalty_counts.counted(cols.pen_ids)
        want.append(tokens.tolist())
        got.append(drawn[:n].tolist())
        outputs = [o + [t] for o, t in zip(outputs, want[-1])]
    return got, want, eager.penalty_counts, static.penalty_counts


@pytest.mark.parametrize("bs", [6, 8])  # bucket = rows, and padding rows after them
def test_static_words_draw_the_samplers_tokens(bs):
    got, want, _, _ = _steps(MIXED, bs, kernels=False)
    assert got == want
    assert len({tuple(t) for t in want}) == 3  # the steps drew different tokens


@pytest.mark.parametrize("bs", [4, 5])
def test_penalised_rows_match_and_count_the_same_tokens(bs):
    got, want, eager, static = _steps(PENALISED, bs, kernels=False, steps=4, seed=3)
    assert got == want
    rows = [f"r{i}" for i in range(3)]
    a = eager.counts[eager.slots(rows, [[]] * 3, [[0] * 9] * 3, [9] * 3)]
    b = static.counts[static.slots(rows, [[]] * 3, [[0] * 9] * 3, [9] * 3)]
    assert int(a.sum()) == 3 * 9  # five from the lists, four sampled
    assert torch.equal(a, b)


def test_kernels_under_the_interpreter_match_the_sampler():
    """The Triton path (interpreted on the CPU): penalty kernel, nucleus draw, top_k."""
    got, want, _, _ = _steps(PENALISED[:2] + MIXED[:3], 8, kernels=True, steps=2, seed=5)
    assert got == want


def test_what_samples_eagerly():
    vocab = 5000
    state = SamplingState(vocab, CPU, [2], None, PenaltyCounts(vocab, CPU))

    def cols(**kw):
        p = [SamplingParams(seed=1, **kw), SamplingParams(seed=2, temperature=0.5)]
        return state.columns(["a", "b"], p, [[1], [1]], [[], []], [0, 0])

    assert variant_of(cols(temperature=0.5, logprobs=2), vocab) is None
    assert variant_of(cols(temperature=0.5, min_tokens=3), vocab) is None
    assert variant_of(cols(temperature=0.5, top_k=MAX_TOP_K + 1), vocab) is None
    assert variant_of(cols(temperature=0.5), vocab) == Variant(False, 0, False)
    assert variant_of(cols(temperature=0.5, top_k=50), vocab) == Variant(False, 64, False)
    assert variant_of(cols(temperature=0.5, top_k=100, min_p=0.1), vocab) == Variant(
        True, 128, False
    )
    assert variant_of(cols(temperature=0.5, top_k=200), 150) == Variant(False, 150, False)
    assert variant_of(cols(temperature=0.5, repetition_penalty=1.2), vocab) == Variant(
        False, 0, True
    )
    state.release(["a", "b"])
    greedy = [SamplingParams(temperature=0), SamplingParams(temperature=0)]
    assert variant_of(state.columns(["c", "d"], greedy, [[1]] * 2, [[]] * 2, [0, 0]), 9) is None


@pytest.mark.parametrize("bs", [1, 2, 3, 5, 6, 24])
def test_each_part_is_16_byte_aligned_and_padding_is_greedy(bs):
    words = torch.from_numpy(pack(None, bs))
    assert words.numel() == words_per_bucket(bs)
    view = StaticColumns.view(words, bs)
    base = words.data_ptr()
    for name, t in vars(view).items():
        assert t.shape == (bs,) and t.is_contiguous(), name
        assert (t.data_ptr() - base) % 16 == 0, name
    assert torch.equal(view.temperature, torch.zeros(bs))
    assert torch.equal(view.repetition, torch.ones(bs)) and torch.equal(view.top_p, torch.ones(bs))
    tail = GraphTail(None, None, Variant(False, 0, False), PenaltyCounts(VOCAB, CPU))
    assert np.array_equal(tail.words(bs, rows=False), words.numpy())


class _Model:
    """compute_logits is the identity: the test's hidden rows are its logits."""

    def __init__(self, tp=None):
        self.tp = tp

    def compute_logits(self, hidden):
        return hidden


class _Graphs(DecodeGraphs):
    """DecodeGraphs on the CPU whose captures are recorded, not made (`oom`: the
    warm-up runs out of memory; `error`: the capture raises it). `tail_room` reads the free bytes `_device` sets."""

    def __init__(self, max_bs: int, oom: bool = False, error: Exception | None = None):
        super().__init__(None, [], "triton", max_bs, 4, 8, CPU, torch.bfloat16, None)
        self.oom, self.error, self.captured = oom, error, []

    def capture_tail(self, tail) -> bool:
        self.captured.append(tail.key)
        if self.oom:
            return False
        if self.error is not None:
            raise self.error
        self._tail_kv = self.kv_caches
        for bs in self.buckets:
            self.tail_graphs[tail.key, bs] = None
        self.tail_bytes = max(self.tail_bytes, tail.pool_bytes(self.max_bs, self.dtype))
        return True


@pytest.fixture
def device_free(monkeypatch):
    """The device's free bytes as `DecodeGraphs.tail_room` reads them (set [0])."""
    free = [2**40]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 2**41))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return free


def _runner(model=None, grammar=None, kernels=None, max_bs=16, graphs=None, pairing=None):
    from types import SimpleNamespace

    kept = PenaltyCounts(VOCAB, CPU)
    return SimpleNamespace(
        model=model or _Model(),
        grammar=grammar,
        graphs=graphs or _Graphs(max_bs),
        sampler=Sampler(kernels=kernels),
        sampling=SamplingState(VOCAB, CPU, [2], None, kept),
        penalties=kept,
        vocab_size=VOCAB,
        pairing=pairing,
    )


def _rows(configs, outputs=3):
    from batchgen.runner.input_batch import StepRow

    return [
        StepRow(
            f"r{i}",
            [-1],
            10,
            True,
            outputs,
            None,
            SamplingParams(**kw),
            [5, 6],
            [7] * outputs,
            100 + i,
            i,
        )  # fmt: skip
        for i, kw in enumerate(configs)
    ]


def test_graph_tail_decides_per_step_and_hands_over_the_tokens(device_free):
    from types import SimpleNamespace

    from batchgen.runner.graph_sampling import graph_tail
    from batchgen.runner.in_flight import InFlightDecode

    configs = [dict(temperature=0.8, repetition_penalty=1.2), dict(temperature=0), dict(top_k=9)]
    runner = _runner()
    reqs = _rows(configs)

    def tail_for(runner, reqs, steps):
        return graph_tail(runner, InFlightDecode(SimpleNamespace(), reqs), steps)

    tail = tail_for(runner, reqs, [3, 3, 3])
    assert tail.variant == Variant(False, 64, True)
    assert runner.penalties.counts.shape[0] == 16  # reserved for the graphs' rows
    bs = 4
    logits = torch.randn(bs, VOCAB, generator=torch.Generator().manual_seed(9)) * 2
    tail.tokens = tail.compute(logits, torch.from_numpy(tail.words(bs)))[:3]
    assert tail.tokens[1] == logits[1].argmax()  # the greedy row
    flight = InFlightDecode(SimpleNamespace(), reqs)
    tail.finish(flight)
    assert flight.tokens is tail.tokens
    slot = runner.penalties.slots(["r0"], [[5, 6]], [[7] * 4], [4])[0]
    # the sampled token was counted in the graph, and the host knows: no refill at step 4
    # (a refill would count 4 sevens from the lists instead)
    want = torch.zeros(VOCAB, dtype=torch.int32)
    want[7] += 3
    want[int(tail.tokens[0])] += 1
    assert torch.equal(runner.penalties.counts[slot], want)

    assert tail_for(runner, _rows([dict(temperature=0)] * 3), [3] * 3) is None  # argmax
    assert tail_for(runner, _rows([dict(logprobs=1)] + configs[1:]), [3] * 3) is None
    following = SimpleNamespace(following=True)
    assert tail_for(_runner(grammar=following), reqs, [3] * 3) is None
    assert tail_for(_runner(model=_Model(SimpleNamespace(size=2))), reqs, [3] * 3) is None
    assert tail_for(_runner(kernels=False), reqs, [3] * 3) is None
    # an attention data-parallel rank: a tail's capture alone would run unpaired forwards
    assert tail_for(_runner(pairing=SimpleNamespace()), reqs, [3] * 3) is None
    assert tail_for(_runner(), _rows([dict(temperature=0.5)]), [0]) is not None


def _tail_for(runner, configs, steps=3):
    from types import SimpleNamespace

    from batchgen.runner.graph_sampling import graph_tail
    from batchgen.runner.in_flight import InFlightDecode

    reqs = _rows(configs, steps)
    return graph_tail(runner, InFlightDecode(SimpleNamespace(), reqs), [steps] * len(reqs))


def test_the_reserve_holds_the_widest_capture_and_grows_with_rows_and_vocab():
    """The memory plan's reserve for the sampling graphs: the logits a graph keeps in
    its pool (~78 MB at 256 rows of Qwen's 151,936-token vocabulary in bfloat16; ~0.9 GB
    at 1,024 rows with penalties' float32 copy), and beside them the kept counts."""
    from batchgen.runner.graph_sampling import (
        counts_bytes,
        sampling_graph_reserve,
        tail_bytes,
    )

    qwen, bf16 = 151936, torch.bfloat16
    plain = tail_bytes(256, qwen, bf16, Variant(False, 0, False))
    assert 77.7e6 < plain < 79e6
    penalised = tail_bytes(1024, qwen, bf16, Variant(False, 64, True))
    assert 0.93e9 < penalised < 0.96e9
    assert counts_bytes(1024, qwen) == 1024 * qwen * (4 + 1)
    reserve = sampling_graph_reserve(1024, qwen, bf16)
    for variant in [Variant(m, k, p) for m in (0, 1) for k in (0, 64, MAX_TOP_K) for p in (0, 1)]:
        assert tail_bytes(1024, qwen, bf16, variant) + counts_bytes(1024, qwen) <= reserve
    assert sampling_graph_reserve(512, qwen, bf16) < reserve  # rows
    assert sampling_graph_reserve(1024, 32000, bf16) < reserve  # vocabulary
    assert sampling_graph_reserve(1024, qwen, torch.float32) > reserve  # logits' dtype


def test_a_tail_is_captured_once_where_it_fits(device_free):
    """Captured at the first step needing it, the counts reserved for every row; later
    steps replay it without asking for room; a narrower variant reuses the pool."""
    graphs = _Graphs(16)
    runner = _runner(graphs=graphs)
    pen = [dict(temperature=0.8, repetition_penalty=1.2), dict(temperature=0.7)]
    device_free[0] = 10 * 2**20
    first = _tail_for(runner, pen)
    assert first is not None and graphs.captured == [first.key]
    assert runner.penalties.counts.shape[0] == 16
    device_free[0] = 0  # captured: no room is needed again, nor for a narrower variant
    assert _tail_for(runner, pen) is not None and len(graphs.captured) == 1
    narrower = _tail_for(runner, [dict(temperature=0.8, top_p=0.9)])
    assert narrower is not None and graphs.captured[1] == narrower.key
    # a wider one than the pool holds (top_k) needs room that is not there
    assert _tail_for(runner, [dict(temperature=0.8, top_k=200)]) is None


def test_a_tail_that_does_not_fit_samples_eagerly_with_one_warning(device_free, caplog):
    """No capture, no counts grown: the step samples after the replay; the warning is
    said once, the variant not tried again until the pool is re-created."""
    graphs = _Graphs(16)
    runner = _runner(graphs=graphs)
    pen = [dict(temperature=0.8, repetition_penalty=1.2)]
    need = tail_bytes_for(Variant(False, 0, True), 16) + 16 * VOCAB * 5
    device_free[0] = 1000  # less than either variant below needs at 16 rows
    with caplog.at_level("WARNING", logger="batchgen.runner.graph_sampling"):
        assert _tail_for(runner, pen) is None
        assert _tail_for(runner, [dict(temperature=0.9, top_k=5)]) is None
        assert _tail_for(runner, pen) is None
    assert graphs.captured == [] and runner.penalties.counts.shape[0] < 16
    assert len([r for r in caplog.records if "do not fit" in r.message]) == 1
    device_free[0] = need  # room now, but the refusal stands until the pool changes
    assert _tail_for(runner, pen) is None
    graphs.clear()
    device_free[0] = need - 1  # the tail and the counts' growth, to the byte
    assert _tail_for(runner, pen) is None
    graphs.clear()
    device_free[0] = need
    assert _tail_for(runner, pen) is not None
    assert runner.penalties.counts.shape[0] == 16


def test_a_warm_up_out_of_memory_samples_eagerly(device_free):
    graphs = _Graphs(16, oom=True)
    runner = _runner(graphs=graphs)
    assert _tail_for(runner, [dict(temperature=0.8)]) is None
    assert _tail_for(runner, [dict(temperature=0.8)]) is None
    assert len(graphs.captured) == 1  # refused: not tried again


def test_a_capture_that_raises_samples_eagerly_and_names_the_error(device_free, caplog):
    """An error in a tail's warm-up or capture (not out of memory) leaves the step to
    the sampler after the replay, the error in the warning; that variant is not tried
    again, another variant still is."""
    graphs = _Graphs(16, error=RuntimeError("operation not permitted when stream is capturing"))
    runner = _runner(graphs=graphs)
    with caplog.at_level("WARNING", logger="batchgen.runner.graph_sampling"):
        assert _tail_for(runner, [dict(temperature=0.8)]) is None
        assert _tail_for(runner, [dict(temperature=0.8)]) is None
    assert len(graphs.captured) == 1
    failed = [r for r in caplog.records if "failed" in r.message]
    assert len(failed) == 1 and "not permitted" in str(failed[0].exc_info[1])
    graphs.error = None
    assert _tail_for(runner, [dict(temperature=0.8, top_k=5)]) is not None


def tail_bytes_for(variant, rows):
    from batchgen.runner.graph_sampling import tail_bytes

    return tail_bytes(rows, VOCAB, torch.bfloat16, variant)

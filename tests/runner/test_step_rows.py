"""StepRows (runner/input_batch.py): a step's rows with their page rows and serials, and
what is gathered by row from them (SamplingState.columns_for, inputs.pipelined_ids),
against the same read by request id."""

from __future__ import annotations

import pickle
import random
from types import SimpleNamespace

import numpy as np
import torch

from batchgen.runner.batch import BlindEntries, NewRequest, ScheduledRequest, SchedulerOutput
from batchgen.runner.in_flight import sample_steps
from batchgen.runner.input_batch import InputBatch, StepRows
from batchgen.runner.inputs import pack_step, pipelined_ids
from batchgen.runner.sampler import SamplingState
from batchgen.runner.staging import HostStaging
from tests.runner.test_sampling_state import CPU, EOS, PARAMS, VOCAB, assert_same


def _steps(num_steps: int = 10, seed: int = 0):
    """Steps of requests joining and leaving a 6-row batch (rows reused, an id reused by
    another request), each continuing row with a -1 placeholder: the runner's steps."""
    gen = random.Random(seed)
    live, made, steps = {}, 0, []
    for _ in range(num_steps):
        done = [rid for rid in live if gen.random() < 0.3]
        for rid in done:
            del live[rid]
        entries = []
        for rid in list(live):
            live[rid] += 1
            entries.append(ScheduledRequest(rid, [-1], 10 + live[rid], (), True, live[rid]))
        while len(live) < 6:
            rid = f"r{made % 9}"  # ids come back once their request is gone
            made += 1
            if rid in live:
                continue
            seed = None if made % 3 == 0 else 500 + made  # None: drawn from the generator
            new = NewRequest(PARAMS[made % len(PARAMS)], [1, 3, 5], [], seed)
            entries.append(ScheduledRequest(rid, [7], 10, [made], True, 0, None, new))
            live[rid] = 0
        gen.shuffle(entries)
        steps.append(SchedulerOutput(entries, released_ids=done))
    return steps


def test_columns_by_row_equal_columns_by_id():
    """Each step's sampling metadata gathered by page row (StepRows) equals the one read
    by request id, seeds drawn for unseeded requests in the same order."""
    batch = InputBatch(6, 4)
    by_row = SamplingState(VOCAB, CPU, EOS, torch.Generator().manual_seed(3))
    by_id = SamplingState(VOCAB, CPU, EOS, torch.Generator().manual_seed(3))
    fresh = 0
    for step in _steps():
        by_row.release(step.released_ids)
        by_id.release(step.released_ids)
        rows = batch.apply(step)
        assert isinstance(rows, StepRows)
        assert rows.rows.tolist() == [r.row for r in rows]
        steps = [r.num_output_tokens for r in rows]
        assert_same(by_row.build_for(rows, steps), by_id.build_for(list(rows), steps))
        fresh += sum(r.num_output_tokens == 0 for r in rows)
    assert fresh > 10 and len(by_row) == len(by_id) == 6


def test_pipelined_ids_by_row_equal_by_id():
    """A step's placeholders read its predecessor's tokens at the same rows whether
    looked up by page row or by request id; a row taken by another request since its
    predecessor is refused."""
    batch, stage = InputBatch(6, 4), HostStaging(CPU)
    prev = None
    for step in _steps(seed=1):
        rows = batch.apply(step)
        if prev is not None and all(r.new_token_ids == [-1] for r in rows):
            got = pipelined_ids(rows, prev, stage)
            plain = SimpleNamespace(sampled=list(prev.sampled), tokens=prev.tokens)
            assert torch.equal(got, pipelined_ids(list(rows), plain, stage))
        tokens = torch.tensor(np.arange(len(rows)) * 11 + 100)
        prev = SimpleNamespace(sampled=rows, tokens=tokens)
    retaken = StepRows(list(rows[:1]), batch.page_rows.serial + 1)
    try:
        pipelined_ids(retaken, prev, stage)
    except KeyError:
        return
    raise AssertionError("a placeholder on a row retaken since was read")


def test_rows_read_as_columns_equal_rows_read_one_by_one():
    """A StepRows reads its rows' fields from the step's entries and fixed data: each row
    indexed before any iteration, its token columns, pack_step's inputs and pipelined_ids
    after a mixed step equal those read from the StepRow objects themselves."""
    batch, stage = InputBatch(6, 4), HostStaging(CPU)
    prev, fixed = None, {}
    mixed = 0
    for step in _steps(seed=2):
        rows = batch.apply(step)
        one_by_one = [rows[i] for i in range(len(rows))]  # before any iteration
        items = list(rows)
        assert [vars_of(r) for r in one_by_one] == [vars_of(r) for r in items]
        for r, e, row in zip(items, step.requests, rows.rows.tolist()):
            if e.new is not None:
                fixed[e.request_id] = e.new
            n = fixed[e.request_id]
            assert (r.request_id, r.new_token_ids, r.start, r.sample) == (
                e.request_id,
                e.new_token_ids,
                e.start,
                e.sample,
            )
            assert (r.num_output_tokens, r.state_slot, r.row) == (
                e.num_output_tokens,
                e.state_slot,
                row,
            )
            assert (r.params, r.prompt_token_ids, r.output_token_ids, r.seed) == (
                n.params,
                n.prompt_token_ids,
                n.output_token_ids,
                n.seed,
            )
        lens, ids = rows.token_columns()
        assert lens.tolist() == [len(r.new_token_ids) for r in items]
        assert ids.tolist() == [t for r in items for t in r.new_token_ids]
        by_cols = pack_step(rows, batch.page_rows.table, 8, stage)
        by_rows = pack_step(items, batch.page_rows.table, 8, stage)
        assert torch.equal(by_cols[0], by_rows[0]) and torch.equal(by_cols[1], by_rows[1])
        assert torch.equal(by_cols[2].slot_mapping, by_rows[2].slot_mapping)
        if prev is not None and any(r.new is not None for r in step.requests):
            # a placeholder beside new rows: pipelined_ids' per-row path
            got = pipelined_ids(rows, prev, stage)
            plain = SimpleNamespace(sampled=list(prev.sampled), tokens=prev.tokens)
            placeholders = [r for r in step.requests if r.new_token_ids == [-1]]
            assert torch.equal(got, pipelined_ids(items, plain, stage))
            mixed += bool(placeholders)
        tokens = torch.tensor(np.arange(len(rows)) * 11 + 100)
        prev = SimpleNamespace(sampled=rows, tokens=tokens)
    assert mixed > 3


def test_blind_step_columns_equal_its_rows_read():
    """A blind decode step (SchedulerOutput.blind: every row one placeholder, sampling)
    takes its token columns, samples and steps without reading its entries: they equal
    those of the same entries read (not marked blind, and as StepRow objects), as do
    pack_step's inputs."""
    batch, stage = InputBatch(6, 4), HostStaging(CPU)
    blind = 0
    for before in _steps(seed=3):
        assert not batch.apply(before).blind
        # the decode step after it, built blind: every row one more placeholder
        entries = [
            ScheduledRequest(r.request_id, [-1], r.start + len(r.new_token_ids), (), True, n)
            for r, n in zip(before.requests, range(len(before.requests)))
        ]
        step = SchedulerOutput(entries, blind=True)
        rows = batch.apply(step)
        assert rows.blind
        blind += 1
        held = [(rows.fixed[i], int(rows.rows[i])) for i in range(len(rows))]
        read = StepRows.of(step.requests, held, batch.page_rows.serial)
        items = list(rows)
        for got, want in zip(rows.token_columns(), read.token_columns()):
            assert got.tolist() == want.tolist()
        assert rows.samples().tolist() == read.samples().tolist() == [True] * len(rows)
        want_steps = [r.num_output_tokens + 1 for r in items]
        assert rows.steps().tolist() == read.steps().tolist() == want_steps
        assert sample_steps(rows).tolist() == sample_steps(items).tolist() == want_steps
        by_cols = pack_step(rows, batch.page_rows.table, 8, stage)
        by_rows = pack_step(items, batch.page_rows.table, 8, stage)
        for got, want in zip(by_cols[:2] + by_cols[3:], by_rows[:2] + by_rows[3:]):
            assert torch.equal(got, want)
        assert torch.equal(by_cols[2].slot_mapping, by_rows[2].slot_mapping)
    assert blind >= 2


def test_blind_entries_apply_as_the_entries_they_stand_for():
    """A blind step's entries as columns (BlindEntries: rows with new pages or a request
    new to the runner among them) read, pickle and apply as the list of the entries
    they stand for: the same rows, page table, columns and packed inputs."""
    as_columns, as_list = InputBatch(6, 16), InputBatch(6, 16)
    stage = HostStaging(CPU)
    applied = 0
    for before in _steps(seed=4):
        as_columns.apply(before)
        as_list.apply(before)
        ids, starts, outputs, general = [], [], [], {}
        for i, r in enumerate(before.requests):
            ids.append(r.request_id)
            starts.append(r.start + len(r.new_token_ids))
            outputs.append(r.num_output_tokens + 1)
            if i % 3 == 1:  # a page added since the last step
                general[i] = ScheduledRequest(
                    ids[-1], [-1], starts[-1], [30 + i], True, outputs[-1]
                )
        if len(ids) > 2:  # one the runner never saw (its row released, then sent again)
            new = NewRequest(PARAMS[0], [2, 4], [9], 77)
            general[2] = ScheduledRequest(
                ids[2], [-1], starts[2], [40], True, outputs[2], None, new
            )
        entries = BlindEntries(ids, starts, outputs, general)
        listed = list(entries)
        assert [e.request_id for e in listed] == ids and listed[-1] == entries[-1]
        assert [e.new_pages for e in listed[1::3]] == [[30 + i] for i in range(1, len(ids), 3)]
        assert entries == listed and entries[1:3] == listed[1:3]
        assert pickle.loads(pickle.dumps(entries)) == listed
        step = SchedulerOutput(entries, released_ids=[ids[2]] if len(ids) > 2 else [], blind=True)
        got = as_columns.apply(pickle.loads(pickle.dumps(step)))
        want = as_list.apply(SchedulerOutput(listed, released_ids=step.released_ids, blind=True))
        assert got.rows.tolist() == want.rows.tolist()
        assert got.serials.tolist() == want.serials.tolist()
        assert np.array_equal(as_columns.page_rows.table, as_list.page_rows.table)
        assert list(got.fixed) == list(want.fixed)
        assert got.request_ids() == want.request_ids() == ids
        assert got.starts().tolist() == want.starts().tolist() == starts
        assert got.steps().tolist() == want.steps().tolist() == [n + 1 for n in outputs]
        by_cols = pack_step(got, as_columns.page_rows.table, 8, stage)
        by_list = pack_step(want, as_list.page_rows.table, 8, stage)
        assert torch.equal(by_cols[1], by_list[1]) and torch.equal(by_cols[3], by_list[3])
        assert torch.equal(by_cols[2].slot_mapping, by_list[2].slot_mapping)
        applied += bool(general)
    assert applied >= 5


def test_sampled_rows_are_the_rows_that_sample():
    """StepRows.sampled(): the rows that sample, in order, with their page rows and
    serials (a step with prompt chunks that sample nothing beside decode rows), the
    step's own StepRows where every row samples; placeholders after it read its rows."""
    batch, stage = InputBatch(6, 16), HostStaging(CPU)
    cut = 0
    for k, step in enumerate(_steps(seed=5)):
        # a new request's row: a prompt chunk that samples nothing in every other step
        entries = [
            ScheduledRequest(
                r.request_id, r.new_token_ids, r.start, r.new_pages, False, 0, None, r.new
            )
            if r.new is not None and k % 2
            else r
            for r in step.requests
        ]
        rows = batch.apply(SchedulerOutput(entries, released_ids=step.released_ids))
        sampled = rows.sampled()
        want = [r for r in rows if r.sample]
        assert [vars_of(r) for r in sampled] == [vars_of(r) for r in want]
        assert sampled.rows.tolist() == [r.row for r in want]
        assert sampled.serials.tolist() == rows.serials[[r.sample for r in rows]].tolist()
        assert sampled.request_ids() == [r.request_id for r in want]
        assert sampled.steps().tolist() == sample_steps(want).tolist()
        if len(want) == len(rows):
            assert sampled is rows
        else:
            cut += 1
            after = [ScheduledRequest(r.request_id, [-1], r.start + 1, (), True, 1) for r in want]
            nxt = StepRows.of(after, [(r, r.row) for r in want], batch.page_rows.serial)
            tokens = torch.arange(len(want)) + 100
            got = pipelined_ids(nxt, SimpleNamespace(sampled=sampled, tokens=tokens), stage)
            plain = pipelined_ids(after, SimpleNamespace(sampled=want, tokens=tokens), stage)
            assert torch.equal(got, plain) and got.tolist() == tokens.tolist()
    assert cut >= 3


def vars_of(row) -> tuple:
    return tuple(getattr(row, f) for f in row.__slots__)

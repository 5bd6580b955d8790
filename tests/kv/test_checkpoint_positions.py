"""StateCheckpoints' choice of positions under the default policy (shared_only): a
position is wanted only while two or more tracked requests reach it, so chunks are cut
and states stored only there. No tier is needed to decide (the copies are tested with
the engine in tests/models/test_kimi_linear_prefix.py)."""

from __future__ import annotations

from batchgen.kv.state_checkpoints import StateCheckpoints

PAGE, INTERVAL = 4, 8  # a position every two pages


def _hashes(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


def test_a_position_is_wanted_while_two_requests_reach_it():
    cps = StateCheckpoints(None, INTERVAL, PAGE, max_slots=4)
    a = _hashes("p0", "p1", "a2", "a3", "a4")  # 20 tokens: positions 8 and 16
    b = _hashes("p0", "p1", "b2", "b3")  # 17 tokens: position 8 only (16 is not < 16)
    cps.track("a", a, 20)
    assert not cps.wanted(a[1]) and not cps.wanted(a[3])  # nobody else reaches them yet
    cps.track("b", b, 17)
    assert cps.wanted(a[1])  # both reach position 8, the end of the shared page p1
    assert not cps.wanted(a[3]) and not cps.wanted(b[3])
    # a's prefill: cut at 8 (wanted), not at 16 (only a reaches it)
    assert cps.cut(0, 20, 20, a) == 8
    assert cps.cut(8, 12, 20, a) == 12
    cps.track("b", b, 17)  # tracked again under the same id: still counted once
    cps.untrack("b")
    assert not cps.wanted(a[1])
    cps.untrack("a")
    cps.untrack("a")  # untracking twice is harmless
    assert not cps._holders and not cps._tracked


def test_every_position_is_wanted_without_shared_only():
    cps = StateCheckpoints(None, INTERVAL, PAGE, max_slots=4, shared_only=False)
    a = _hashes("p0", "p1", "a2", "a3", "a4")
    cps.track("a", a, 20)
    assert cps.wanted(a[1]) and cps.wanted(a[3])
    assert cps.cut(0, 20, 20, a) == 8 and cps.cut(8, 12, 20, a) == 8


class _States:
    """The state tier's part a checkpoint uses: host slots, and a copy that is only
    recorded."""

    host_room = 4

    def __init__(self):
        self.copies = []

    def take_host_slot(self) -> int:
        return len(self.copies)

    def checkpoint_out(self, dev_slot, host_slot, tag):
        self.copies.append((dev_slot, host_slot))
        return object()


def test_a_chunk_is_cut_at_the_first_missing_position_inside_it():
    """Position 8 already stored, 16 missing and wanted: a chunk from 0 runs through 8
    and ends at 16, so the state there can be stored too."""
    cps = StateCheckpoints(_States(), INTERVAL, PAGE, max_slots=4, shared_only=False)
    a = _hashes("p0", "p1", "a2", "a3", "a4", "a5")  # 24 tokens: positions 8 and 16
    cps.track("a", a, 24)
    assert cps.take(0, 8, a, "request a") is not None and cps.has(a[1])
    assert cps.cut(0, 24, 24, a) == 16
    assert cps.cut(0, 12, 24, a) == 12  # 16 lies past this chunk
    assert cps.take(0, 16, a, "request a") is not None
    assert cps.cut(0, 24, 24, a) == 24  # every position inside is stored

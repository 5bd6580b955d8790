"""PageAllocator: ref counts, the LRU free queue, the prefix cache and eviction."""

import pytest

from batchgen.kv.page_allocator import PageAllocator


def h(i: int) -> bytes:
    return f"hash-{i}".encode()


def free_order(alloc: PageAllocator) -> list[int]:
    """The pages allocation would hand out next, first to last (without allocating)."""
    return list(alloc._free) + list(alloc._kept)


def test_allocate_takes_pages_in_order_with_one_reference():
    alloc = PageAllocator(8)
    assert alloc.num_free == 8
    pages = alloc.allocate(3)
    assert pages == [0, 1, 2]
    assert [alloc.ref_count[p] for p in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert alloc.num_free == 5
    assert alloc.allocate(0) == []
    assert alloc.num_free == 5


def test_allocate_more_than_free_raises_and_changes_nothing():
    alloc = PageAllocator(4)
    alloc.allocate(3)
    with pytest.raises(RuntimeError, match="2 pages, 1 free"):
        alloc.allocate(2)
    assert alloc.num_free == 1
    assert alloc.ref_count == [1, 1, 1, 0]


def test_free_returns_pages_and_touch_adds_references():
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.touch(pages)
    assert [alloc.ref_count[p] for p in pages] == [2, 2]
    alloc.free(pages)
    assert [alloc.ref_count[p] for p in pages] == [1, 1]
    assert alloc.num_free == 2  # still held once
    alloc.free(pages)
    assert [alloc.ref_count[p] for p in pages] == [0, 0]
    assert alloc.num_free == 4
    assert sorted(free_order(alloc)) == [0, 1, 2, 3]


def test_double_free_asserts():
    alloc = PageAllocator(4)
    pages = alloc.allocate(1)
    alloc.free(pages)
    with pytest.raises(AssertionError, match="freed twice"):
        alloc.free(pages)


def test_unhashed_freed_pages_are_reused_before_cached_ones():
    alloc = PageAllocator(6)
    pages = alloc.allocate(6)
    alloc.register(pages[0], h(0))
    alloc.register(pages[1], h(1))
    alloc.free([pages[0], pages[1]])  # cached: to the back
    alloc.free([pages[4]])  # unhashed: to the front
    alloc.free([pages[5]])
    # Unhashed pages come out first, then the cached ones.
    got = alloc.allocate(2)
    assert sorted(got) == [4, 5]
    assert alloc.lookup([h(0), h(1)]) == [0, 1]  # no cached page evicted yet
    assert alloc.evictions == 0


def test_cached_pages_are_evicted_oldest_first():
    alloc = PageAllocator(4)
    pages = alloc.allocate(4)
    for i, p in enumerate(pages):
        alloc.register(p, h(i))
    # Free in an order unrelated to page ids: 2, then 0, then 3, then 1.
    for p in (2, 0, 3, 1):
        alloc.free([p])
    assert free_order(alloc) == [2, 0, 3, 1]
    assert alloc.allocate(1) == [2]
    assert alloc.allocate(2) == [0, 3]
    assert alloc.evictions == 3


def test_a_sequence_tail_is_evicted_before_its_head():
    alloc = PageAllocator(4)
    seq = alloc.allocate(4)
    for i, p in enumerate(seq):
        alloc.register(p, h(i))
    alloc.free(seq)
    # The tail is freed first, so it is the oldest free page and goes first.
    assert alloc.allocate(1) == [seq[-1]]
    # The head survives longest: the cached prefix shrinks from the end.
    assert alloc.lookup([h(0), h(1), h(2), h(3)]) == seq[:3]
    assert alloc.allocate(2) == [seq[2], seq[1]]
    assert alloc.lookup([h(0), h(1)]) == [seq[0]]


def test_a_later_freed_unhashed_page_goes_before_older_free_pages():
    alloc = PageAllocator(4)
    a = alloc.allocate(2)
    alloc.register(a[0], h(0))
    alloc.free([a[0]])  # cached, at the back: [2, 3, 0]
    alloc.free([a[1]])  # unhashed: to the front
    assert free_order(alloc)[0] == a[1]
    assert free_order(alloc)[-1] == a[0]


def test_touch_revives_a_free_cached_page():
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.register(pages[0], h(0))
    alloc.register(pages[1], h(1))
    alloc.free(pages)
    assert alloc.num_free == 4
    hits = alloc.lookup([h(0), h(1)])
    assert hits == pages
    alloc.touch(hits)
    assert [alloc.ref_count[p] for p in hits] == [1, 1]
    assert alloc.num_free == 2
    assert not set(hits) & set(free_order(alloc))
    # Allocation can no longer hand them out (nor evict their hashes).
    other = alloc.allocate(2)
    assert not set(other) & set(hits)
    assert alloc.lookup([h(0), h(1)]) == hits
    assert alloc.evictions == 0
    with pytest.raises(RuntimeError):
        alloc.allocate(1)


def test_touch_of_a_held_page_only_adds_a_reference():
    alloc = PageAllocator(3)
    pages = alloc.allocate(1)
    alloc.register(pages[0], h(0))
    alloc.touch(pages)
    assert alloc.ref_count[pages[0]] == 2
    assert alloc.num_free == 2
    alloc.free(pages)
    assert alloc.num_free == 2  # still held by the first owner
    alloc.free(pages)
    assert alloc.num_free == 3


def test_lookup_returns_only_the_longest_cached_prefix():
    alloc = PageAllocator(6)
    pages = alloc.allocate(4)
    alloc.register(pages[0], h(0))
    alloc.register(pages[1], h(1))
    alloc.register(pages[3], h(3))  # cached, but after a gap
    assert alloc.lookup([h(0), h(1), h(2), h(3)]) == [pages[0], pages[1]]
    assert alloc.lookup([h(9), h(0)]) == []
    assert alloc.lookup([]) == []
    # lookup takes no reference.
    assert [alloc.ref_count[p] for p in pages] == [1, 1, 1, 1]


def test_allocate_evicts_hashes():
    alloc = PageAllocator(2)
    pages = alloc.allocate(2)
    alloc.register(pages[0], h(0))
    alloc.register(pages[1], h(1))
    alloc.free(pages)
    assert alloc.lookup([h(0)]) == [pages[0]]
    got = alloc.allocate(2)
    assert sorted(got) == sorted(pages)
    assert alloc.lookup([h(0)]) == []
    assert alloc.lookup([h(1)]) == []
    assert alloc.page_hash(pages[0]) is None
    assert alloc.evictions == 2
    # The evicted hash can be registered again, on another page.
    alloc.register(got[1], h(0))
    assert alloc.lookup([h(0)]) == [got[1]]


def test_register_keeps_the_first_page_for_a_hash_and_the_first_hash_for_a_page():
    alloc = PageAllocator(3)
    a, b = alloc.allocate(2)
    alloc.register(a, h(0))
    alloc.register(b, h(0))  # duplicate content: the first page stays the cached one
    assert alloc.lookup([h(0)]) == [a]
    assert alloc.page_hash(b) is None
    alloc.register(a, h(5))
    assert alloc.page_hash(a) == h(0)
    assert alloc.lookup([h(5)]) == []


def test_caching_disabled_never_hits():
    alloc = PageAllocator(3, enable_caching=False)
    pages = alloc.allocate(1)
    alloc.register(pages[0], h(0))
    assert alloc.lookup([h(0)]) == []
    assert alloc.page_hash(pages[0]) is None


def test_num_free_after_touch_counts_only_free_pages():
    alloc = PageAllocator(6)
    pages = alloc.allocate(3)
    for i, p in enumerate(pages):
        alloc.register(p, h(i))
    alloc.free([pages[1], pages[2]])  # pages[0] still held
    assert alloc.num_free == 5
    # Touching the held page costs nothing; the two free cached ones leave the queue.
    assert alloc.num_free_after_touch(pages) == 3
    assert alloc.num_free_after_touch([]) == 5
    assert alloc.num_free_after_touch([pages[0]]) == 5
    alloc.touch(pages)
    assert alloc.num_free == 3


def test_reset_forgets_hashes_and_refuses_when_held():
    alloc = PageAllocator(3)
    pages = alloc.allocate(2)
    alloc.register(pages[0], h(0))
    with pytest.raises(AssertionError):
        alloc.reset()
    alloc.free(pages)
    alloc.reset()
    assert alloc.lookup([h(0)]) == []
    assert alloc.num_free == 3
    assert free_order(alloc) == [0, 1, 2]


def test_wanted_pages_are_evicted_after_every_unwanted_one():
    alloc = PageAllocator(4)
    alloc.want(h(0))  # not cached yet: only noted
    alloc.want(h(1))
    pages = alloc.allocate(4)
    for i, p in enumerate(pages):
        alloc.register(p, h(i))
    alloc.free(pages[:2])  # wanted: kept
    alloc.free(pages[2:])  # nobody wants them
    assert free_order(alloc) == [pages[3], pages[2], pages[1], pages[0]]
    assert alloc.allocate(2) == [pages[3], pages[2]]
    assert alloc.lookup([h(0), h(1)]) == pages[:2]
    alloc.unwant(h(1))  # back to the LRU queue, taken before the kept page
    alloc.want(h(5))  # not cached: nothing to keep
    assert free_order(alloc) == [pages[1], pages[0]] and alloc.num_free == 2
    alloc.touch([pages[0]])  # a hit revives a kept page
    assert free_order(alloc) == [pages[1]] and alloc.ref_count[pages[0]] == 1
    alloc.free([pages[0]])
    alloc.want(h(1))  # wanted again while free: kept, after the page kept before it
    assert free_order(alloc) == [pages[0], pages[1]]
    assert alloc.allocate(2) == [pages[0], pages[1]] and alloc.evictions == 4


def test_is_cached_answers_lookup_of_one_hash_held_or_free():
    alloc = PageAllocator(2)
    (page,) = alloc.allocate(1)
    alloc.register(page, h(0))
    assert alloc.is_cached(h(0)) and not alloc.is_cached(h(1))
    alloc.free([page])  # free but cached: still found
    assert alloc.is_cached(h(0)) == bool(alloc.lookup([h(0)]))
    alloc.allocate(2)  # evicted
    assert not alloc.is_cached(h(0))
    assert not PageAllocator(2, enable_caching=False).is_cached(h(0))


def test_allocate_tells_its_caller_of_each_cached_page_as_it_is_taken():
    alloc = PageAllocator(3)
    pages = alloc.allocate(3)
    alloc.register(pages[1], h(1))
    alloc.register(pages[2], h(2))
    alloc.free(pages)  # the tail first: 2, 1 cached at the back, 0 (no hash) in front
    seen = []
    got = alloc.allocate(2, lambda page, page_hash: seen.append((page, page_hash)))
    assert got == [pages[0], pages[2]]
    assert seen == [(pages[2], h(2))]  # an unhashed page is no eviction
    alloc.allocate(1)  # no one to tell: evicted all the same
    assert alloc.lookup([h(1)]) == [] and alloc.evictions == 2


def test_resize_empties_the_pool_and_keeps_what_is_wanted():
    alloc = PageAllocator(2)
    alloc.want(h(0))
    pages = alloc.allocate(2)
    alloc.register(pages[0], h(0))
    alloc.resize(4)
    assert alloc.num_pages == 4 and alloc.num_free == 4 and alloc.ref_count == [0] * 4
    assert alloc.lookup([h(0)]) == [] and alloc.evictions == 0
    wanted, other = alloc.allocate(2)
    alloc.register(wanted, h(0))
    alloc.register(other, h(9))
    alloc.free([wanted])  # still wanted after the resize: taken after `other`
    alloc.free([other])
    assert free_order(alloc)[-2:] == [other, wanted]

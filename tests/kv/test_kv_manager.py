"""KVCacheManager: page tables, all-or-nothing allocation, prefix lookups and sharing."""

import pytest

from batchgen.kv.kv_manager import KVCacheManager
from batchgen.kv.page_allocator import PageAllocator
from batchgen.kv.prefix_hash import hash_full_pages

PS = 4


def make(num_pages: int = 16, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(PageAllocator(num_pages, caching), PS)


def run_prompt(kv: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    """Admit a request as the scheduler does (lookup, allocate), compute it all, cache it."""
    hits = kv.lookup_prefix(rid, tokens)
    assert kv.allocate(rid, len(tokens), hits)
    kv.note_admission(len(tokens))
    kv.cache_computed(rid, tokens, len(tokens))
    return hits


@pytest.mark.parametrize("num_tokens", [1, 3, 4, 5, 8, 9, 16])
def test_page_table_covers_num_tokens(num_tokens):
    kv = make()
    assert kv.allocate("r", num_tokens)
    assert len(kv.pages["r"]) == -(-num_tokens // PS)
    assert len(set(kv.pages["r"])) == len(kv.pages["r"])
    assert kv.num_free_pages == 16 - len(kv.pages["r"])


def test_allocate_grows_the_table_and_keeps_its_pages():
    kv = make()
    assert kv.allocate("r", 3)
    first = list(kv.pages["r"])
    assert kv.allocate("r", 4)  # same page
    assert kv.pages["r"] == first
    assert kv.allocate("r", 5)  # one more
    second = list(kv.pages["r"])
    assert len(second) == 2 and second[:1] == first and second[1] != first[0]
    assert kv.allocate("r", 13)
    pages = kv.pages["r"]
    assert len(pages) == 4 and pages[:2] == second  # earlier pages kept, in order
    assert len(set(pages)) == 4  # the two new pages are fresh, not repeats
    assert all(kv.allocator.ref_count[p] == 1 for p in pages)
    assert kv.num_free_pages == 12


def test_allocate_returns_false_and_changes_nothing_when_short():
    kv = make(num_pages=4)
    assert kv.allocate("a", 8)
    assert kv.allocate("b", 4)

    def snapshot():  # by value: allocate grows a request's page list in place
        return (
            {r: list(p) for r, p in kv.pages.items()},
            list(kv.allocator.ref_count),
            kv.num_free_pages,
        )

    before = snapshot()
    assert not kv.allocate("c", 8)  # needs 2, 1 free
    assert not kv.allocate("b", 12)  # grow by 2, 1 free
    assert "c" not in kv.pages
    assert snapshot() == before
    assert kv.allocate("b", 8)  # exactly the last page
    assert kv.num_free_pages == 0


def test_allocate_with_hits_short_changes_nothing():
    kv = make(num_pages=4)
    prompt = list(range(9))
    run_prompt(kv, "a", prompt)
    kv.free("a")  # 2 cached pages (free) + 2 plain
    assert kv.allocate("x", 4)  # one plain page taken: 3 free, 2 of them cached
    hits = kv.lookup_prefix("b", prompt + [100, 101, 102])
    assert len(hits) == 2
    # 12 tokens: 3 pages, 2 hits -> 1 new, but the hits themselves use 2 of 3 free: ok.
    # 16 tokens: 4 pages -> 2 new, only 1 left after the touch: refused.
    before = (list(kv.allocator.ref_count), kv.num_free_pages, kv.prefix_hit_tokens)
    assert not kv.allocate("b", 16, hits)
    assert (list(kv.allocator.ref_count), kv.num_free_pages, kv.prefix_hit_tokens) == before
    assert "b" not in kv.pages
    assert kv.allocate("b", 12, hits)
    assert kv.pages["b"][:2] == hits
    assert kv.num_free_pages == 0


@pytest.mark.parametrize("n", [1, 3, 4, 5, 7, 8, 9, 12])
def test_prefix_lookup_never_covers_the_last_token(n):
    kv = make()
    prompt = list(range(100, 100 + n))
    run_prompt(kv, "a", prompt)
    hits = kv.lookup_prefix("b", prompt)
    # At least one token must stay to compute (its logits pick the next token), so a
    # prompt that is an exact multiple of the page size recomputes its last page.
    assert len(hits) == (n - 1) // PS
    assert len(hits) * PS < n
    assert hits == kv.pages["a"][: len(hits)]


def test_prefix_lookup_of_a_longer_prompt_hits_every_full_cached_page():
    kv = make()
    prompt = list(range(8))
    run_prompt(kv, "a", prompt)
    hits = kv.lookup_prefix("b", prompt + [50])
    assert hits == kv.pages["a"]
    assert kv.lookup_prefix("c", [999] + prompt[1:] + [50]) == []  # first page differs
    diverge = prompt[:4] + [77, 5, 6, 7, 50]
    assert kv.lookup_prefix("d", diverge) == kv.pages["a"][:1]


def test_cache_computed_registers_only_full_computed_pages():
    kv = make()
    tokens = list(range(10))
    assert kv.allocate("a", 10)
    pages = kv.pages["a"]
    alloc = kv.allocator
    kv.cache_computed("a", tokens, 3)  # no full page computed
    assert [alloc.page_hash(p) for p in pages] == [None, None, None]
    kv.cache_computed("a", tokens, 7)  # page 0 full; page 1 half computed
    hashes = hash_full_pages(tokens, PS)
    assert alloc.page_hash(pages[0]) == hashes[0]
    assert alloc.page_hash(pages[1]) is None
    kv.cache_computed("a", tokens, 10)  # page 1 full; page 2 (2 tokens) partial
    assert alloc.page_hash(pages[1]) == hashes[1]
    assert alloc.page_hash(pages[2]) is None
    assert alloc.lookup(hashes) == pages[:2]


def test_cache_computed_hashes_depend_on_the_whole_prefix():
    kv = make()
    run_prompt(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    run_prompt(kv, "b", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    # Same second page content, different first page: no sharing.
    assert not set(kv.pages["a"]) & set(kv.pages["b"])
    assert kv.allocator.page_hash(kv.pages["a"][1]) != kv.allocator.page_hash(kv.pages["b"][1])


def test_cache_computed_with_caching_disabled_registers_nothing():
    kv = make(caching=False)
    run_prompt(kv, "a", list(range(9)))
    assert all(kv.allocator.page_hash(p) is None for p in kv.pages["a"])
    assert kv.lookup_prefix("b", list(range(9))) == []


def test_cache_computed_registers_decoded_tokens_as_pages_fill():
    kv = make()
    tokens = list(range(6))
    run_prompt(kv, "a", tokens)
    for t in (50, 51):  # decode: the 2nd page fills at 8 tokens
        tokens.append(t)
        assert kv.allocate("a", len(tokens))
        kv.cache_computed("a", tokens, len(tokens))
    assert kv.allocator.page_hash(kv.pages["a"][1]) == hash_full_pages(tokens, PS)[1]
    assert kv.lookup_prefix("b", tokens + [1]) == kv.pages["a"]


def test_shared_prefix_shares_pages_and_freeing_one_keeps_the_other():
    kv = make(num_pages=8)
    prefix = list(range(8))
    a = prefix + [20, 21, 22]
    b = prefix + [30, 31]
    run_prompt(kv, "a", a)
    hits = run_prompt(kv, "b", b)
    assert hits == kv.pages["a"][:2]
    assert kv.pages["b"][:2] == kv.pages["a"][:2]
    assert kv.pages["b"][2] != kv.pages["a"][2]
    alloc = kv.allocator
    assert [alloc.ref_count[p] for p in kv.pages["a"][:2]] == [2, 2]
    assert alloc.ref_count[kv.pages["a"][2]] == 1
    assert kv.num_free_pages == 8 - 4
    shared = kv.pages["a"][:2]
    kv.free("a")
    assert [alloc.ref_count[p] for p in shared] == [1, 1]
    assert kv.pages["b"][:2] == shared
    assert kv.num_free_pages == 8 - 3
    # The freed page must not be one b still uses, even under allocation pressure.
    assert kv.allocate("c", 5 * PS)
    assert not set(kv.pages["c"]) & set(kv.pages["b"])
    assert kv.lookup_prefix("d", prefix + [1]) == shared


def test_freed_prefix_stays_findable_until_evicted():
    kv = make(num_pages=3)
    prompt = list(range(9))
    run_prompt(kv, "a", prompt)
    cached = kv.pages["a"][:2]
    kv.forget("a")
    assert kv.lookup_prefix("b", prompt) == cached
    assert kv.allocate("x", 3 * PS)  # takes every page: evicts both hashes
    assert kv.lookup_prefix("c", prompt) == []


def test_prefix_hit_tokens_counter():
    kv = make()
    prompt = list(range(10))
    run_prompt(kv, "a", prompt)
    assert kv.prefix_hit_tokens == 0
    assert kv.prefix_query_tokens == 10
    run_prompt(kv, "b", prompt)  # 2 full pages hit
    assert kv.prefix_hit_tokens == 2 * PS
    run_prompt(kv, "c", prompt[:6])  # 1 full page
    assert kv.prefix_hit_tokens == 3 * PS
    assert kv.prefix_query_tokens == 26


def test_free_and_forget_of_unknown_request_are_harmless():
    kv = make()
    kv.free("nobody")
    kv.forget("nobody")
    assert kv.num_free_pages == 16


def test_free_then_realloc_after_preemption_reuses_cached_pages():
    kv = make(num_pages=6)
    tokens = list(range(10))
    run_prompt(kv, "a", tokens)
    old = list(kv.pages["a"])
    kv.free("a")  # preemption: pages dropped, hashes kept
    assert "a" not in kv.pages
    hits = kv.lookup_prefix("a", tokens)
    assert hits == old[:2]
    assert kv.allocate("a", len(tokens), hits)
    assert kv.pages["a"][:2] == old[:2]
    assert len(kv.pages["a"]) == 3
    kv.cache_computed("a", tokens, len(tokens))
    assert [kv.allocator.ref_count[p] for p in kv.pages["a"]] == [1, 1, 1]


def test_is_cached_sees_device_then_host_pages_and_counts_nothing():
    from types import SimpleNamespace

    other = hash_full_pages(list(range(100, 104)), PS)[0]
    host = PageAllocator(2)
    host.register(host.allocate(1)[0], other)
    tier = SimpleNamespace(host_alloc=host, loads_pay=False)
    kv = KVCacheManager(PageAllocator(16, True), PS, tier)
    prompt = list(range(9))
    run_prompt(kv, "a", prompt)
    h0, h1 = kv.page_hashes("a", prompt)
    assert kv.is_cached(h0) and kv.is_cached(h1)
    assert not kv.is_cached(other)  # the cost rule idles the tier: host pages are not hits
    tier.loads_pay = True
    assert kv.is_cached(other)
    assert kv.prefix_hit_tokens == 0 and kv.prefix_query_tokens == 9
    assert not make(caching=False).is_cached(h0)


def test_free_pages_to_admit_counts_held_prefix_pages_as_free():
    kv = make()
    prefix = list(range(8))
    run_prompt(kv, "a", prefix + [1, 2])
    b = prefix + [3, 4, 5, 6, 7]  # 4 pages, 2 of them held by a
    assert kv.free_pages_to_admit("b", b) == 2
    kv.forget("a")  # cached but free: reviving them takes free pages
    assert kv.free_pages_to_admit("b", b) == 4
    assert kv.prefix_hit_tokens == 0


def test_cache_computed_for_registers_as_cache_computed_row_by_row():
    """A step's rows in one call: each request's full computed pages registered as its own
    cache_computed call registers them (a token in flight counts no page), in row order."""
    from types import SimpleNamespace

    rows = [  # (tokens known, computed): pages fill, one of two, a token in flight, three
        (list(range(8)), 8),
        (list(range(100, 106)), 6),
        (list(range(200, 208)), 9),
        (list(range(300, 312)), 12),
    ]
    one, many = make(32), make(32)
    reqs = []
    for i, (tokens, computed) in enumerate(rows):
        for kv in (one, many):
            assert kv.allocate(f"r{i}", computed)
        one.cache_computed(f"r{i}", tokens, computed)
        reqs.append(
            SimpleNamespace(request_id=f"r{i}", token_ids=tokens, num_computed_tokens=computed)
        )
    many.cache_computed_for(reqs)
    for i in range(len(rows)):
        want = [one.allocator.page_hash(p) for p in one.pages[f"r{i}"]]
        assert [many.allocator.page_hash(p) for p in many.pages[f"r{i}"]] == want
    hashed = [many.allocator.page_hash(p) for pages in many.pages.values() for p in pages]
    assert sum(h is not None for h in hashed) == 2 + 1 + 2 + 3


def test_cache_computed_for_keeps_the_requests_behind():
    """A request whose computed count fills a page with a token still unknown (in flight)
    is `behind` after the check, and leaves it once the check registers that page."""
    from types import SimpleNamespace

    kv = make(32)
    tokens = list(range(2 * PS - 1))  # the last token of page 2 in flight
    req = SimpleNamespace(request_id="a", token_ids=tokens, num_computed_tokens=2 * PS)
    assert kv.allocate("a", 2 * PS)
    kv.cache_computed_for([req])
    assert kv.behind == {"a"}
    tokens.append(99)
    kv.cache_computed_for([req])
    assert not kv.behind
    assert all(kv.allocator.page_hash(p) is not None for p in kv.pages["a"])
    req.num_computed_tokens += PS - 1  # computed past the page: nothing full is unknown
    tokens += [100] * (PS - 1)
    kv.cache_computed_for([req])
    assert not kv.behind
    kv.behind.add("a")
    kv.free("a")
    assert not kv.behind

"""GPU regression tests for the copy-ordering contract, one per copy path.

Each scenario delays one side with a spin kernel, issues the write the copy depends on,
then the copy (or the compute that depends on the copy). With the ordering in place the
right value is read. In the unordered variant one piece of the ordering is removed (the
producer wait, rule 2 of kv/copy_rules.py: UnorderedCopyEngine below; a consumer wait,
rule 3: patched out) and the test must fail on its assertion that the stale value was read — a strict
xfail limited to AssertionError, so any other error still fails the test.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import save_tiny_model

from batchgen.kv import page_copies
from batchgen.kv.copy_engine import CopyEngine, CopyHandle
from batchgen.kv.host_pool import HostPool
from batchgen.kv.kv_manager import KVCacheManager
from batchgen.kv.layout import KVLayout
from batchgen.kv.page_allocator import PageAllocator
from batchgen.kv.page_pool import PagePool
from batchgen.kv.state_pool import HostStatePool, StateLayout, StatePool, StateSlots
from batchgen.kv.state_tier import StateTier
from batchgen.kv.tier_metrics import TierMetrics
from batchgen.kv.tiered import TieredKVManager
from batchgen.layers.attention_torch import store_kv

pytestmark = pytest.mark.gpu

LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
SPIN = 200_000_000  # cycles a stream spins (~0.1 s)
STALE = pytest.mark.xfail(strict=True, raises=AssertionError, reason="ordering removed")
ORDERING = [pytest.param(True, id="ordered"), pytest.param(False, id="unordered", marks=STALE)]
# a value no earlier test wrote: staging the caching allocator hands out again may hold
# an earlier test's values, which an unordered copy reading it too early must not find
FRESH = itertools.count(100)


ISSUE = "worker"


class UnorderedCopyEngine(CopyEngine):
    """A CopyEngine without rule 2: its copy stream waits on an event nobody recorded (a
    wait that returns at once) instead of the task's producer."""

    def _issue(self, task: tuple, inline: bool = False) -> None:
        handle, _, copy, stream = task
        super()._issue((handle, torch.cuda.Event(), copy, stream), inline)


def copy_engine(ordered: bool, **kwargs) -> CopyEngine:
    return (CopyEngine if ordered else UnorderedCopyEngine)(torch.device("cuda"), **kwargs)


@pytest.fixture(autouse=True, params=["worker", "inline"])
def issue(request):
    """Every test with the copies issued by the copy worker and by the asking thread."""
    global ISSUE
    ISSUE = request.param
    yield request.param
    ISSUE = "worker"


def make(ordered: bool = True, load_scatter: str = "copy"):
    device = torch.device("cuda")
    assert torch.cuda.current_stream().cuda_stream == 0, "runs on the default stream"
    pool = PagePool(LAYOUT, 64, device)
    alloc = PageAllocator(64)
    host = HostPool(LAYOUT, 16, pin=True)
    host.kv.fill_(-1)
    copies = copy_engine(ordered, issue=ISSUE)
    tier = TieredKVManager(pool, host, alloc, copies, load_scatter=load_scatter)
    return tier, alloc


def host_page(tier, page_hash):
    (page,) = tier.lookup([page_hash])
    return tier.host_pool.page(page)


def no_wait(monkeypatch, *names):
    for name in names:
        monkeypatch.setattr(CopyHandle, name, lambda self, *a: None)


@pytest.mark.parametrize("ordered", ORDERING)
def test_write_through_right_after_the_kernel_that_writes_its_source(ordered):
    tier, alloc = make(ordered)
    page = alloc.allocate(1)
    torch.cuda._sleep(SPIN)
    tier.device_pool.kv[:, :, page[0]].fill_(7.0)  # the producer, on the default stream
    tier.queue_store(page, [b"wt"], "write_through", "r")
    tier.flush()
    tier.drain()
    assert bool((host_page(tier, b"wt") == 7.0).all())


@pytest.mark.parametrize("ordered", ORDERING)
def test_write_back_reads_the_evicted_page_after_its_last_write(ordered):
    """flush() gathers the evicted page into staging on the default stream, behind the
    old owner's last write; the copy stream's transfer must wait for that gather."""
    tier, alloc = make(ordered)
    page = alloc.allocate(1)[0]
    value = float(next(FRESH))
    torch.cuda._sleep(SPIN)
    tier.device_pool.kv[:, :, page].fill_(value)  # the old owner's last write
    tier.queue_write_back(page, b"wb", "write_back", "r")
    assert tier.flush() == []  # the step's forward waits on nothing
    tier.device_pool.kv[:, :, page].fill_(9.0)  # the new owner writes at once
    tier.drain()
    assert bool((host_page(tier, b"wb") == value).all())


def test_new_owner_writes_an_evicted_page_at_once_while_the_write_back_starts_late():
    """The write-back's copy stream starts late; the new owner's write right after the
    flush still leaves the old contents to the host: the flush read them, in order, on
    the stream the write comes after."""
    tier, alloc = make()
    page = alloc.allocate(1)[0]
    tier.device_pool.kv[:, :, page].fill_(7.0)
    torch.cuda.synchronize()
    for stream in tier.copies.streams:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SPIN)
    tier.queue_write_back(page, b"wb", "write_back", "r")
    assert tier.flush() == []
    tier.device_pool.kv[:, :, page].fill_(9.0)  # the new owner's K/V write
    tier.drain()
    assert bool((host_page(tier, b"wb") == 7.0).all())


def swapped(ordered: bool = True, value: float = 7.0) -> tuple[KVCacheManager, list[int]]:
    """A KV manager with the tier (the engine's background stream too) and request "a"
    computed on two full pages and a partial one, its full pages' last write (`value`)
    queued behind a spin on the default stream, then swapped out."""
    device = torch.device("cuda")
    allocator = PageAllocator(8, True)
    pool = PagePool(LAYOUT, 8, device)
    host = HostPool(LAYOUT, 16, pin=True)
    host.kv.fill_(-1)
    copies = copy_engine(ordered, issue=ISSUE, background=True)
    kv = KVCacheManager(allocator, LAYOUT.page_size, TieredKVManager(pool, host, allocator, copies))
    tokens = list(range(2 * LAYOUT.page_size + 1))
    kv.want("a", tokens)
    assert kv.allocate("a", len(tokens))
    kv.cache_computed("a", tokens, len(tokens))
    pages = list(kv.pages["a"][:2])
    torch.cuda._sleep(SPIN)
    for p in pages:
        pool.kv[:, :, p].fill_(value)  # the request's last write, on the default stream
    assert kv.swap_out("a", len(tokens))
    return kv, pages


def swapped_on_host(kv: KVCacheManager) -> torch.Tensor:
    hashes = kv.page_hashes("a", [])[:2]
    return torch.stack([kv.tier.host_pool.page(h) for h in kv.tier.lookup(hashes)])


@pytest.mark.parametrize("ordered", ORDERING)
def test_store_ahead_reads_a_swapped_request_pages_after_their_last_write(ordered):
    value = float(next(FRESH))
    kv, _ = swapped(ordered, value)
    assert kv.take_step_copies() == []  # gathered by the flush, not waited on
    kv.tier.drain()
    assert bool((swapped_on_host(kv) == value).all())


def test_new_owner_of_a_swapped_page_writes_it_at_once_while_its_store_ahead_is_late():
    kv, pages = swapped()
    torch.cuda.synchronize()
    background = kv.tier.copies.streams[-1]  # the store ahead's transfer starts late
    with torch.cuda.stream(background):
        torch.cuda._sleep(SPIN)
    assert kv.take_step_copies() == []
    assert kv.allocate("b", kv.num_free_pages * LAYOUT.page_size)  # a later step evicts
    assert set(pages) <= set(kv.pages["b"])
    assert kv.take_step_copies() == []  # read at the swap-out's flush: nothing to wait on
    for p in kv.pages["b"]:
        kv.tier.device_pool.kv[:, :, p].fill_(9.0)  # the new owner's K/V write
    kv.tier.drain()
    assert bool((swapped_on_host(kv) == 7.0).all())


def test_a_load_into_a_swapped_page_runs_while_its_store_ahead_is_late():
    kv, pages = swapped()
    torch.cuda.synchronize()
    with torch.cuda.stream(kv.tier.copies.streams[-1]):  # the transfer starts late
        torch.cuda._sleep(SPIN)
    assert kv.take_step_copies() == []
    tier = kv.tier
    host = tier.host_alloc.allocate(1)
    tier.host_pool.kv[:, host[0]].fill_(5.0)
    taken = kv.allocator.allocate(kv.allocator.num_free)  # a later step takes them all
    page = pages[0]  # and loads a host prefix hit into one of the swapped pages
    assert page in taken
    tier.queue_load(host, [page], "prefix_load", "r")
    (load,) = tier.flush()
    load.wait_gates()
    got = tier.device_pool.kv[:, :, page].clone()
    tier.drain()
    assert bool((got == 5.0).all())
    assert bool((swapped_on_host(kv) == 7.0).all())


@pytest.mark.parametrize("ordered", ORDERING)
def test_layer_store_right_after_the_token_kv_write(ordered):
    tier, alloc = make(ordered)
    page = alloc.allocate(1)[0]
    host = tier.host_alloc.allocate(1)
    s = LAYOUT.page_size
    k = torch.randn(s, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.arange(page * s, page * s + s, device="cuda")
    torch.cuda._sleep(SPIN)
    for layer in range(LAYOUT.num_layers):
        k_cache, v_cache = tier.device_pool.layer_caches()[layer]
        store_kv(k_cache, v_cache, k, v, slots)  # the tokens' K/V write
        tier.store_layer([page], host, layer, [b"ls"], ["r"])
    tier.drain()
    got = host_page(tier, b"ls")
    assert torch.equal(got[:, 0], k.cpu().expand(LAYOUT.num_layers, *k.shape))
    assert torch.equal(got[:, 1], v.cpu().expand(LAYOUT.num_layers, *v.shape))


@pytest.mark.parametrize("wait", [True, pytest.param(False, id="no-wait", marks=STALE)])
def test_load_of_a_host_page_waits_for_the_store_writing_it(wait, monkeypatch):
    tier, alloc = make()
    src = alloc.allocate(1)
    tier.device_pool.kv[:, :, src[0]].fill_(7.0)
    torch.cuda.synchronize()
    with torch.cuda.stream(tier.copies.streams[0]):  # the store's stream starts late
        torch.cuda._sleep(SPIN)
    tier.queue_store(src, [b"sl"], "write_through", "r")
    tier.flush()
    (host,) = list(tier.ledger.writing)  # in flight: not in the host cache yet
    if not wait:
        no_wait(monkeypatch, "wait_on_current_stream")  # the store-before-load wait
    dst = alloc.allocate(1)
    tier.queue_load([host], dst, "prefix_load", "r")
    (load,) = tier.flush()
    load.wait_gates()
    got = tier.device_pool.kv[:, :, dst[0]].clone()
    tier.drain()
    assert bool((got == 7.0).all())


@pytest.mark.parametrize("ordered", ORDERING)
def test_load_after_the_pool_is_recreated_with_torch_zeros(ordered):
    tier, alloc = make(ordered)
    host = tier.host_alloc.allocate(1)
    tier.host_pool.kv[:, host[0]].fill_(5.0)
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)
    tier.attach_device(PagePool(LAYOUT, 64, torch.device("cuda")), alloc)  # memset after spin
    page = alloc.allocate(1)
    tier.queue_load(host, page, "prefix_load", "r")
    (load,) = tier.flush()
    load.wait_gates()
    got = tier.device_pool.kv[:, :, page[0]].clone()
    tier.drain()
    assert bool((got == 5.0).all())


@pytest.mark.parametrize("ordered", ORDERING)
def test_a_deferred_scatter_waits_for_its_blocks_to_land(ordered, monkeypatch):
    """tier_load_scatter="compute": the load's scatter runs on the compute stream; its
    blocks cross on a copy stream held back by a spin, so only the scatter's wait for
    them (page_copies._on_consumer) keeps it from reading the staging too early."""
    if ISSUE != "inline":
        pytest.skip("a load defers its scatter only when its copies are issued inline")
    tier, alloc = make(load_scatter="compute")
    value = float(next(FRESH))
    host = tier.host_alloc.allocate(1)
    tier.host_pool.kv[:, host[0]].fill_(value)
    if not ordered:  # the scatter without its wait for the blocks

        def unordered(consumer, landed, finish):
            with torch.cuda.stream(consumer):
                finish()

        monkeypatch.setattr(page_copies, "_on_consumer", unordered)
    page = alloc.allocate(1)
    torch.cuda.synchronize()
    for stream in tier.copies.streams:  # the blocks land late
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SPIN)
    tier.queue_load(host, page, "prefix_load", "r")
    (load,) = tier.flush()
    assert load.has_deferred  # nothing scattered on the copy stream
    load.wait_gates()
    got = tier.device_pool.kv[:, :, page[0]].clone()
    tier.drain()
    assert bool((got == value).all())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ordering-llama")
    save_tiny_model(path, "LlamaForCausalLM")
    return str(path)


@pytest.mark.parametrize("scatter", ["copy", "compute"])
@pytest.mark.parametrize("wait", [True, pytest.param(False, id="no-wait", marks=STALE)])
def test_forward_waits_layer_by_layer_for_a_host_prefix_load(wait, scatter, model_dir, monkeypatch):
    """A prefix evicted to host comes back through the engine; its load is held back by
    a spin on the copy streams, so only the runner's per-layer wait makes the forward
    read the loaded pages instead of the zeros of a re-created pool (with the scatter
    on the compute stream, that wait is also what queues the scatter)."""
    from batchgen import LLM, SamplingParams

    llm = LLM(
        model=model_dir,
        device="cuda",
        dtype="float32",
        page_size=16,
        num_kv_pages=64,
        host_kv_size_gib=0.05,
        tier_policy="always",
        tier_copy_issue=ISSUE,
        tier_load_scatter=scatter,
        enforce_eager=True,
    )
    assert llm.engine.tier.copies.inline == (ISSUE == "inline")
    prompt = [[(7 * i) % 500 + 3 for i in range(80)]]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == ref
    llm.engine.reconfigure(64)  # the prefix (shared: hit once) goes to host; zeros after
    torch.cuda.synchronize()
    for stream in llm.engine.tier.copies.streams:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SPIN)
    if not wait:
        no_wait(monkeypatch, "wait_layer", "wait_gates")
    again = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.metrics()["host_prefix_hit_pages"] > 0
    assert again == ref


# ---- a hybrid model's state checkpoints (kv/state_tier.py) ----------------------------

STATE_LAYOUT = StateLayout(
    num_layers=3,
    num_heads=4,
    head_k_dim=64,
    head_v_dim=64,
    conv_dim=3 * 4 * 64,
    conv_kernel=4,
    conv_dtype=torch.bfloat16,
)


def state_tier(ordered: bool = True) -> tuple[StateTier, StateSlots]:
    device = torch.device("cuda")
    pool = StatePool(STATE_LAYOUT, 4, device)
    host = HostStatePool(STATE_LAYOUT, 4, pin=True)
    host.states.fill_(-1.0)
    host.windows.fill_(-1.0)
    slots = StateSlots(4)
    copies = copy_engine(ordered, issue=ISSUE)
    return StateTier(pool, host, slots, copies, TierMetrics()), slots


def state_filled(tier: StateTier, host_slot: int, value: float) -> bool:
    host = tier.host_pool
    return bool((host.states[:, host_slot] == value).all()) and bool(
        (host.windows[:, host_slot] == value).all()
    )


@pytest.mark.parametrize("ordered", ORDERING)
def test_a_checkpoint_reads_its_slot_after_the_step_that_wrote_it(ordered):
    tier, slots = state_tier(ordered)
    slot, host_slot = slots.take("r"), tier.take_host_slot()
    torch.cuda._sleep(SPIN)
    tier.device_pool.states[:, slot].fill_(7.0)  # the step's write, on the default stream
    tier.device_pool.windows[:, slot].fill_(7.0)
    tier.checkpoint_out(slot, host_slot, "request r")
    tier.drain()
    assert state_filled(tier, host_slot, 7.0)


@pytest.mark.parametrize("wait", [True, pytest.param(False, id="no-wait", marks=STALE)])
def test_the_step_after_a_checkpoint_writes_the_slot_only_after_its_gather(wait):
    """The next step waits on the checkpoint's gate (the slot gathered into staging),
    not on its transfer to host; without the wait it overwrites the slot first."""
    tier, slots = state_tier()
    slot, host_slot = slots.take("r"), tier.take_host_slot()
    tier.device_pool.states[:, slot].fill_(7.0)
    tier.device_pool.windows[:, slot].fill_(7.0)
    torch.cuda.synchronize()
    with torch.cuda.stream(tier.copies.streams[0]):  # the checkpoint's stream starts late
        torch.cuda._sleep(SPIN)
    handle = tier.checkpoint_out(slot, host_slot, "request r")
    if wait:
        handle.wait_layer(0)  # what the next step's forward does before its KDA layers
    tier.device_pool.states[:, slot].fill_(9.0)  # the next step writes the slot
    tier.device_pool.windows[:, slot].fill_(9.0)
    tier.drain()
    assert state_filled(tier, host_slot, 7.0)

"""KV events: the block manager's events, numbered by the engine-side source, keep the router's index
equal to the cache's reuse tree, level by level, through store / evict (drop) / offload / onboard /
take-over; a lost batch (a gap in the numbers) makes the feed resynchronise from a snapshot.

tpb 4, one layer, window 64 unless said otherwise (the managers of kv_factories.make_manager)."""

from __future__ import annotations

import random

from kv_factories import make_manager
from test_kvcache_support import run_prefill

from kvcache import Level, block_hashes
from kvcache.events import MOVED, REMOVED, STORED
from server.router.kv_feed import KvFeed
from server.router.kv_index import KvIndex
from server.telemetry.kv_events import KvEventBatch, KvEventSource, message_batches

P, S = int(Level.PRIMARY), int(Level.SECONDARY)


def tree_state(m) -> dict[int, dict[bytes, int]]:
    """window -> hash -> level, straight from the managers' reuse trees."""
    return {w: {h: int(level) for level, hashes in levels.items() for h in hashes}
            for w, levels in m.cached_blocks().items()}


def h(tokens: list[int], salt: str = "") -> list[bytes]:
    return block_hashes(tokens, 4, salt)


class Recorder:
    """The publisher as the source sees it: records every (first_seq, events) handed over."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, list]] = []
        self.endpoint = "tcp://127.0.0.1:1"

    def publish(self, first_seq: int, events: list) -> None:
        self.batches.append((first_seq, list(events)))


class Core:
    def __init__(self, kv) -> None:
        self.kv = kv


def drained(m) -> list[tuple[int, int, bytes, int]]:
    return m.drain_events()


def test_events_follow_store_offload_onboard_and_drop_exactly():
    m = make_manager("cpu", host_blocks=4)
    m.enable_events()
    index = KvIndex()
    index.reset({"windows": {}, "salt": "", "tokens_per_block": 4})

    def step(expected: list[tuple[int, bytes, int]]) -> None:
        events = drained(m)
        assert events == [(64, kind, block_hash, level) for kind, block_hash, level in expected]
        for event in events:
            index.apply(*event)
        assert index.windows.get(64, {}) == tree_state(m)[64]

    a, b = list(range(8)), list(range(100, 116))
    ha, hb = h(a), h(b)
    run_prefill(m, "a", a)
    step([(STORED, ha[0], P), (STORED, ha[1], P)])
    m.release("a")
    step([])  # released blocks stay cached: no change to the tree
    run_prefill(m, "b", b)  # 4 blocks: 2 free, then a's leaf and root are offloaded to the host tier
    step([(MOVED, ha[1], S), (MOVED, ha[0], S)] + [(STORED, x, P) for x in hb])
    m.release("b")
    assert m.admit("a2", a) == 7  # a's root onboarded (b's leaf offloaded for room), block 1 copied
    step([(MOVED, hb[3], S), (MOVED, ha[0], P), (MOVED, hb[2], S)])
    assert index.match(ha) == [P, S] and index.match(hb) == [P, P, S, S]
    assert (index.counts[64, P], index.counts[64, S]) == (3, 3)
    m.release("a2")
    # a request of 4 new blocks: the host tier is full, so primary leaves go there and host leaves
    # (with their whole subtree) are dropped
    run_prefill(m, "c", list(range(200, 216)))
    events = drained(m)
    assert {kind for _, kind, _, _ in events} == {STORED, MOVED, REMOVED}
    for event in events:
        index.apply(*event)
    assert index.windows[64] == tree_state(m)[64]
    m.check_integrity()


def test_take_over_and_low_priority_drops_are_removals():
    m = make_manager("cpu", primary_blocks=4, copy_on_partial_reuse=False)
    m.enable_events()
    run_prefill(m, "p", list(range(8)))
    m.release("p")
    hp = h(list(range(8)))
    drained(m)
    m.admit("q", list(range(6)) + [50, 51, 52])  # block 1 matches 2 tokens: taken over, leaves the tree
    assert drained(m) == [(64, REMOVED, hp[1], P)]
    m.release("q")
    lo = make_manager("cpu", primary_blocks=2, host_blocks=2, secondary_offload_min_priority=50)
    lo.enable_events()
    run_prefill(lo, "lo", [1] * 8, priority=49)
    lo.release("lo")
    drained(lo)
    run_prefill(lo, "x", [2] * 4)  # evicts lo's leaf: below the offload priority, so dropped
    assert drained(lo) == [(64, REMOVED, h([1] * 8)[1], P), (64, STORED, h([2] * 4)[0], P)]


def test_events_keep_an_index_exact_through_random_traffic_and_sliding_windows():
    rng = random.Random(7)
    for windows in ((64,), (8, 64)):
        m = make_manager("cpu", primary_blocks=12, host_blocks=6, windows=windows)
        m.enable_events()
        index, live = KvIndex(), []
        index.reset({"windows": {}, "salt": "", "tokens_per_block": 4})
        prefixes = [[rng.randrange(1000) for _ in range(12)] for _ in range(4)]
        for i in range(150):
            if live and (len(live) > 2 or rng.random() < 0.5):
                m.release(live.pop(rng.randrange(len(live))))
            else:
                tail = [rng.randrange(1000) for _ in range(rng.randrange(6))]
                tokens = rng.choice(prefixes)[:rng.randrange(4, 13)] + tail
                run_prefill(m, f"r{i}", tokens, priority=rng.choice((20, 35, 60)))
                live.append(f"r{i}")
            for event in drained(m):
                index.apply(*event)
            assert index.windows == {w: blocks for w, blocks in tree_state(m).items() if blocks or w in index.windows}
        m.check_integrity()


def _snapshot(source: KvEventSource, core: Core) -> dict:
    future = source.request_snapshot()
    assert not future.done()
    source.on_tick(core)  # the engine thread's next tick answers it
    return future.result(timeout=0)


def test_feed_follows_numbered_batches_and_resyncs_after_a_gap():
    m = make_manager("cpu", primary_blocks=8, host_blocks=4)
    recorder, core = Recorder(), Core(m)
    source = KvEventSource(recorder, "epoch-1")
    source.attach(m)
    feed = KvFeed()

    def deliver(skip: set[int] = frozenset()) -> bool:
        again = False
        for n, (first_seq, events) in enumerate(recorder.batches):
            if n not in skip:
                for batch in message_batches(first_seq, events):
                    again |= feed.on_batch("epoch-1", batch)
        recorder.batches.clear()
        return again

    run_prefill(m, "a", list(range(12)))
    source.on_tick(core)  # seq 1..3 published before the router subscribed: only the snapshot has them
    recorder.batches.clear()
    feed.subscribed()
    assert feed.on_batch("epoch-1", KvEventBatch(source.seq + 1, []))  # the welcome heartbeat: sync now
    run_prefill(m, "b", list(range(50, 58)))
    source.on_tick(core)  # seq 4, 5: kept while the snapshot is on its way
    assert not deliver()
    snapshot = _snapshot(source, core)
    assert snapshot["seq"] == 5 and snapshot["epoch"] == "epoch-1"
    assert not feed.on_snapshot(snapshot)
    assert (feed.state, feed.next_seq, feed.index.windows) == ("live", 6, tree_state(m))
    m.release("a")
    m.release("b")
    run_prefill(m, "c", list(range(100, 124)))  # 6 blocks: evicts and offloads
    source.on_tick(core)
    m.release("c")
    run_prefill(m, "d", list(range(8)))  # onboards a's root
    source.on_tick(core)
    assert len(recorder.batches) == 2
    assert deliver(skip={0})  # the first of the two batches is lost: the second shows a gap
    assert (feed.state, feed.resyncs) == ("syncing", {"gap": 1})
    assert feed.index.windows != tree_state(m)  # stale until the snapshot
    run_prefill(m, "e", list(range(300, 308)))
    source.on_tick(core)
    assert not deliver()  # kept: syncing
    assert not feed.on_snapshot(_snapshot(source, core))
    assert (feed.state, feed.next_seq - 1, feed.index.windows) == ("live", source.seq, tree_state(m))
    m.release("e")
    run_prefill(m, "f", list(range(400, 404)))
    source.on_tick(core)
    assert not deliver()
    assert feed.index.windows == tree_state(m)
    assert not feed.on_batch("epoch-1", KvEventBatch(source.seq + 1, []))  # a heartbeat: nothing missed
    assert feed.on_batch("epoch-2", KvEventBatch(1, []))  # the server restarted
    assert feed.resyncs == {"gap": 1, "epoch": 1}

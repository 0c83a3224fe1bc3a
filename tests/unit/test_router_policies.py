from kvcache import Level, block_hashes
from kvcache.events import REMOVED
from server.config.router import KvWeights
from server.router.backends import Backend
from server.router.policies import (
    KvCacheAware,
    LoadBalancing,
    Prompt,
    RoundRobin,
    hit_tiers,
)

TOKENS = list(range(100, 196))  # 3 full blocks of 32


def _backends(n: int) -> list[Backend]:
    return [Backend(f"http://127.0.0.1:{9000 + i}", "context", healthy=True) for i in range(n)]


def _no_prompt():
    return None


def test_round_robin_cycles_and_skips_fenced_and_excluded():
    a, b, c = _backends(3)
    policy = RoundRobin()
    assert [policy.pick([a, b, c], _no_prompt, set()) for _ in range(4)] == [a, b, c, a]
    b.fence("connection refused")
    assert {policy.pick([a, b, c], _no_prompt, set()) for _ in range(4)} == {a, c}
    assert policy.pick([a, b, c], _no_prompt, {a, c}) is None


def test_load_balancing_prefers_fewest_active():
    a, b, c = _backends(3)
    a.active, b.active, c.active = 3, 1, 2
    assert LoadBalancing().pick([a, b, c], _no_prompt, set()) is b
    b.active = 5
    assert LoadBalancing().pick([a, b, c], _no_prompt, set()) is c


def _index(backend: Backend, primary: list[bytes], secondary: list[bytes] = (), salt: str = "fp") -> None:
    backend.kv_index.reset({"salt": salt, "tokens_per_block": 32, "windows": {"2048": {
        "primary": [h.hex() for h in primary], "secondary": [h.hex() for h in secondary]}}})


def test_kv_cache_aware_weights_disk_tier_hits_below_host_ones():
    a, b = _backends(2)
    hashes = block_hashes(TOKENS, 32, "fp")
    _index(a, hashes[:1])  # 1 device block: 32
    b.kv_index.reset({"salt": "fp", "tokens_per_block": 32, "windows": {"2048": {  # 32 x 0.25 x 3 = 24
        "primary": [], "secondary": [], "disk": [h.hex() for h in hashes]}}})
    prompt = Prompt(lambda: TOKENS)
    assert hit_tiers(b, prompt) == [Level.DISK] * 3
    assert [KvCacheAware().score(x, prompt) for x in (a, b)] == [32.0, 24.0]
    assert KvCacheAware().pick([a, b], prompt, set()) is a
    assert KvCacheAware(KvWeights(disk=0.5)).pick([a, b], prompt, set()) is b  # 48 > 32


def test_kv_cache_aware_weights_host_tier_hits_and_subtracts_load():
    a, b, c = _backends(3)
    hashes = block_hashes(TOKENS, 32, "fp")
    _index(a, hashes[:2])  # 2 blocks on the device pool: 64
    _index(b, hashes[:1], hashes[1:])  # 1 device + 2 host blocks: 32 + 64 x 0.75 = 80
    prompt = Prompt(lambda: TOKENS)
    policy = KvCacheAware()
    assert [policy.score(x, prompt) for x in (a, b, c)] == [64.0, 80.0, 0.0]
    assert policy.pick([a, b, c], prompt, set()) is b
    assert hit_tiers(b, prompt) == [Level.PRIMARY, Level.SECONDARY, Level.SECONDARY]
    assert KvCacheAware(KvWeights(secondary=0.25)).pick([a, b, c], prompt, set()) is a  # 32 + 16 < 64
    b.load_tokens = 20  # 80 - 20 = 60 < 64
    assert policy.pick([a, b, c], prompt, set()) is a
    a.load_tokens = 100  # -36: an idle server without the prefix is better
    assert policy.pick([a, b, c], prompt, set()) is b
    assert KvCacheAware(load_weight=0.0).pick([a, b, c], prompt, set()) is b  # load ignored: 80
    assert policy.pick([a, b, c], Prompt(lambda: TOKENS, "tenant-x"), set()) is c  # another salt: no hit


def test_kv_cache_aware_needs_every_window_group_and_spreads_ties():
    a, b = _backends(2)
    hashes = block_hashes(TOKENS, 32, "fp")
    a.kv_index.reset({"salt": "fp", "tokens_per_block": 32, "windows": {
        "2048": {"primary": [h.hex() for h in hashes], "secondary": []},
        "64": {"primary": [hashes[0].hex(), hashes[2].hex()], "secondary": [hashes[1].hex()]}}})
    assert hit_tiers(a, Prompt(lambda: TOKENS)) == [Level.PRIMARY, Level.SECONDARY, Level.PRIMARY]
    a.kv_index.apply(64, REMOVED, hashes[1], Level.SECONDARY)  # a chain with a hole ends there
    assert hit_tiers(a, Prompt(lambda: TOKENS)) == [Level.PRIMARY]
    policy = KvCacheAware()
    fresh = [Prompt(lambda i=i: [i] * 64) for i in range(4)]
    assert [policy.pick([a, b], p, set()) for p in fresh] == [a, b, a, b]  # no hit anywhere: round robin
    assert policy.pick([a, b], Prompt(lambda: TOKENS), set()) is a
    assert policy.pick([a, b], fresh[0], set()) is a  # a's turn again: the pick by score took no turn
    a.active = 1
    assert policy.pick([a, b], fresh[1], set()) is b  # equal scores: fewest legs in flight first
    assert policy.pick([a, b], fresh[2], set()) is b  # ... whatever the turn

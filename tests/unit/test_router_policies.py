from kvcache import block_hashes, request_salt
from server.router.backends import Backend
from server.router.policies import KvCacheSnapshot, LoadBalancing, Prompt, RoundRobin, matched_blocks

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


def _report(backend: Backend, tokens: list[int], salt: str = "fp") -> None:
    backend.tokens_per_block, backend.hash_salt = 32, salt
    backend.cached_hashes = frozenset(h.hex() for h in block_hashes(tokens, 32, salt))


def test_kv_cache_snapshot_picks_longest_cached_prefix_then_load():
    a, b, c = _backends(3)
    _report(a, TOKENS[:32])
    _report(b, TOKENS[:64] + [1] * 32)
    assert matched_blocks(a, TOKENS) == 1 and matched_blocks(b, TOKENS) == 2 and matched_blocks(c, TOKENS) == 0
    policy = KvCacheSnapshot()
    assert policy.pick([a, b, c], lambda: TOKENS, set()) is b
    b.fence("health check failed")
    assert policy.pick([a, b, c], lambda: TOKENS, set()) is a
    a.active = 4
    assert policy.pick([a, c], lambda: [7] * 64, set()) is c  # no prefix anywhere: fewest active


def test_kv_cache_snapshot_hashes_the_prompt_under_the_request_salt():
    a, b = _backends(2)
    a.tokens_per_block, a.hash_salt = 32, "fp"  # the server's salt; the request's refines it
    a.cached_hashes = frozenset(h.hex() for h in block_hashes(TOKENS, 32, request_salt("fp", "tenant-a")))
    assert matched_blocks(a, TOKENS, "tenant-a") == 3
    assert matched_blocks(a, TOKENS, "tenant-b") == matched_blocks(a, TOKENS) == 0
    a.active = 2  # busier: only a cached prefix makes it the choice
    calls = []
    prompt = Prompt(lambda: calls.append(1) or TOKENS, "tenant-a")
    policy = KvCacheSnapshot()
    assert policy.pick([a, b], prompt, set()) is a and policy.pick([a, b], prompt, set()) is a
    assert calls == [1]  # tokenised once
    assert policy.pick([a, b], Prompt(lambda: TOKENS, "tenant-b"), set()) is b
    assert policy.pick([a, b], Prompt(lambda: TOKENS), set()) is b

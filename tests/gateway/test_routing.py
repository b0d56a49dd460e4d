"""The route cache: bounded, expiring, and droppable."""

from __future__ import annotations

from services.gateway.routing import RouteCache, WorkerChoice

W1 = WorkerChoice(worker_id="w1", address="127.0.0.1:1")
W2 = WorkerChoice(worker_id="w2", address="127.0.0.1:2")


def test_route_cache_returns_what_was_put_per_digest_and_model() -> None:
    cache = RouteCache(ttl_s=60, max_entries=10)
    cache.put("d", "m1", W1)
    cache.put("d", "m2", W2)
    assert cache.get("d", "m1") == W1
    assert cache.get("d", "m2") == W2
    assert cache.get("other", "m1") is None


def test_route_cache_entries_expire() -> None:
    cache = RouteCache(ttl_s=0.0, max_entries=10)
    cache.put("d", "m", W1)
    assert cache.get("d", "m") is None
    assert len(cache) == 0


def test_route_cache_evicts_the_least_recently_used_entry() -> None:
    cache = RouteCache(ttl_s=60, max_entries=2)
    cache.put("a", "m", W1)
    cache.put("b", "m", W1)
    assert cache.get("a", "m") == W1  # a is now more recent than b
    cache.put("c", "m", W2)
    assert len(cache) == 2
    assert cache.get("b", "m") is None
    assert cache.get("a", "m") == W1


def test_route_cache_drop_forgets_the_entry() -> None:
    cache = RouteCache(ttl_s=60, max_entries=2)
    cache.put("a", "m", W1)
    cache.drop("a", "m")
    cache.drop("a", "m")
    assert cache.get("a", "m") is None

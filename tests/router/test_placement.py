"""Placement: which worker a new session gets, as pure functions."""

from __future__ import annotations

import pytest

from services.router.placement import (
    WorkerState,
    available_models,
    choose,
    is_live,
    keeps_affinity,
)
from services.runtime.errors import NotFound, Unavailable


def worker(
    worker_id: str,
    *,
    live: bool = True,
    models: tuple[str, ...] = ("m",),
    in_flight: int = 0,
    sessions: int = 0,
) -> WorkerState:
    return WorkerState(
        worker_id=worker_id,
        address=f"{worker_id}:1",
        models=models,
        live=live,
        in_flight=in_flight,
        sessions=sessions,
        last_heartbeat_age_s=0.0,
    )


def test_chooses_the_worker_with_fewest_in_flight_turns() -> None:
    workers = [worker("a", in_flight=3), worker("b", in_flight=1), worker("c", in_flight=2)]
    assert choose(workers, model="m").worker_id == "b"


def test_in_flight_ties_are_broken_by_fewer_sessions() -> None:
    workers = [worker("a", in_flight=1, sessions=5), worker("b", in_flight=1, sessions=2)]
    assert choose(workers, model="m").worker_id == "b"


def test_full_ties_are_broken_by_worker_id_whatever_the_order() -> None:
    workers = [worker("w2"), worker("w3"), worker("w1")]
    assert choose(workers, model="m").worker_id == "w1"
    assert choose(list(reversed(workers)), model="m").worker_id == "w1"


def test_workers_that_do_not_serve_the_model_are_skipped_even_when_idle() -> None:
    workers = [worker("a", models=("other",)), worker("b", models=("m",), in_flight=9)]
    assert choose(workers, model="m").worker_id == "b"


def test_a_worker_with_no_model_list_serves_any_model() -> None:
    workers = [worker("a", models=("other",)), worker("b", models=(), in_flight=4)]
    assert choose(workers, model="anything").worker_id == "b"


def test_dead_workers_are_never_chosen() -> None:
    workers = [worker("a", live=False), worker("b", in_flight=7)]
    assert choose(workers, model="m").worker_id == "b"


def test_the_avoided_worker_is_skipped_when_another_can_serve() -> None:
    workers = [worker("a"), worker("b", in_flight=5)]
    assert choose(workers, model="m", avoid_worker_id="a").worker_id == "b"


def test_the_avoided_worker_is_still_chosen_when_it_is_the_only_one() -> None:
    workers = [worker("a"), worker("b", models=("other",))]
    assert choose(workers, model="m", avoid_worker_id="a").worker_id == "a"


def test_no_live_worker_is_unavailable_with_a_retry_hint() -> None:
    with pytest.raises(Unavailable) as caught:
        choose([worker("a", live=False)], model="m")
    assert caught.value.retry_after_s == 1
    assert "no live worker" in caught.value.message


def test_an_unserved_model_is_not_found_and_names_the_available_models() -> None:
    workers = [worker("a", models=("b-model", "a-model")), worker("c", models=("a-model",))]
    with pytest.raises(NotFound) as caught:
        choose(workers, model="gpt-9")
    assert caught.value.code == "model_not_found"
    assert caught.value.message == (
        "model 'gpt-9' is not served here; available models: a-model, b-model"
    )


def test_available_models_ignore_dead_workers() -> None:
    workers = [worker("a", models=("x",)), worker("b", models=("y",), live=False)]
    assert available_models(workers) == ["x"]


def test_affinity_is_kept_only_for_a_live_serving_not_avoided_worker() -> None:
    assert keeps_affinity(worker("a"), model="m", avoid_worker_id="")
    assert not keeps_affinity(None, model="m", avoid_worker_id="")
    assert not keeps_affinity(worker("a", live=False), model="m", avoid_worker_id="")
    assert not keeps_affinity(worker("a", models=("x",)), model="m", avoid_worker_id="")
    assert not keeps_affinity(worker("a"), model="m", avoid_worker_id="a")


def test_liveness_is_a_heartbeat_within_the_lease() -> None:
    assert is_live(100.0, now=105.9, lease_s=6.0)
    assert not is_live(100.0, now=106.1, lease_s=6.0)
    assert not is_live(None, now=100.0, lease_s=6.0)

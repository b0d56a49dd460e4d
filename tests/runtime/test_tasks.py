"""services/runtime/tasks.py: DeadlineSweep, the one timer the gateway's ledger client and the
dataproxy's ledger streams end their ops' deadlines with."""

from __future__ import annotations

import asyncio

from services.runtime.tasks import DeadlineSweep, PerLoopTurn


async def test_the_sweep_runs_while_ops_are_under_way_and_stops_after() -> None:
    loop = asyncio.get_running_loop()
    due = {"a": loop.time() + 0.02, "b": loop.time() + 0.08}
    ended: list[tuple[str, float]] = []
    idle = asyncio.Event()

    def sweep(now: float) -> bool:
        for name, at in list(due.items()):
            if at <= now:
                ended.append((name, now - at))
                del due[name]
        if not due:
            idle.set()
        return bool(due)

    sweeper = DeadlineSweep(sweep, interval_s=0.01)
    sweeper.arm()
    sweeper.arm()  # a second op while armed: still one timer
    async with asyncio.timeout(5):
        await idle.wait()
    assert [name for name, _ in ended] == ["a", "b"]
    assert all(0 <= late < 0.5 for _, late in ended)
    assert sweeper._timer is None  # nothing under way: no timer left running

    # Armed again for a new op, it sweeps again.
    idle.clear()
    due["c"] = loop.time()
    sweeper.arm()
    async with asyncio.timeout(5):
        await idle.wait()
    assert [name for name, _ in ended] == ["a", "b", "c"]


async def test_items_put_in_one_loop_turn_are_flushed_together() -> None:
    flushed: list[list[int]] = []
    turn = PerLoopTurn[int](flushed.append)
    for item in range(3):
        turn.put(item)
    assert flushed == []  # not before the loop's other callbacks ran
    await asyncio.sleep(0)  # one turn of the loop: the scheduled flush runs
    assert flushed == [[0, 1, 2]]
    turn.put(3)
    turn.flush_now()
    assert flushed == [[0, 1, 2], [3]]

"""grpc.aio's poller thread never blocks on its wake-up writes (grpcio 1.85, grpc/grpc#40989).

grpc.aio hands completions to the event loop through a socketpair: a poller thread queues each
completion and writes one byte; the loop's reader reads one byte per call and runs everything
queued. When completions come faster than the loop turns (a burst while it is busy), unread
bytes pile up until the socket's buffer is full (≈ 200 one-byte writes) and the poller blocks
in write(). From then on one completion passes per turn of the loop; and when grpc.aio shuts
down meanwhile (its last channel or server of the process gone: every test's teardown) it
removes the reader first, then joins the blocked poller forever — inside a dealloc, where
neither pytest-timeout's signal nor anything else breaks in. A non-blocking write drops a byte
only when the buffer is full, that is when hundreds of wake-ups are pending, each of which runs
the whole queue: no completion waits for a dropped byte. Newer grpcio writes non-blocking
itself; this does the same from outside, through the poller thread's target (its owner) and
the sockets it holds.

A shared package (docs/internals.md, *Layout*): the services' channels and servers need it, and
so does the TrainerClient in a trainer's process (a trainer computing while trajectories
stream in is the burst; a training script that never exits, the hang).
"""

from __future__ import annotations

import gc
import socket
import threading


def unblock_grpc_poller() -> bool:
    """Makes the current grpc.aio poller's wake-up socket non-blocking (call after creating a
    channel or server: grpc.aio starts a new poller after each full shutdown); False when no
    poller runs."""
    for thread in threading.enumerate():
        poller = getattr(getattr(thread, "_target", None), "__self__", None)
        if type(poller).__name__ != "PollerCompletionQueue":
            continue
        for held in gc.get_referents(poller):
            # The read end is non-blocking already; the write end is the other one.
            if (
                isinstance(held, socket.socket)
                and held.family == socket.AF_UNIX
                and held.getblocking()
            ):
                held.setblocking(False)
        return True
    return False

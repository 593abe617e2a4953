"""Turns at serving: a thread that serves requests in turn with a few others
gives its turn up when it is about to wait on the store, so that a few
threads serve cached reads while any number wait on the network.

Every thread that runs Python takes the GIL at each of its system calls;
the more threads serve at once, the more of the daemon's CPU goes to
handing the GIL between them. The FUSE session lets only a few of its
workers serve at a time; a worker whose request waits on a GET (or on
another request's GET, or a listing) calls ``give_up`` first, which hands
its turn to a parked worker. Threads that hold no turn (prefetch,
stage, the event loop) are not affected.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_local = threading.local()


def take(hand_over: Callable[[], None]) -> None:
    """The calling thread serves in turn from now on; ``hand_over`` gives
    its turn to another, once, when it waits or stops serving."""
    _local.hand_over = hand_over


def holds() -> bool:
    """Whether the calling thread still holds its turn."""
    return getattr(_local, "hand_over", None) is not None


def give_up() -> None:
    """The calling thread gives up its turn, if it holds one: before it
    waits on the network, and when it stops serving."""
    hand_over = getattr(_local, "hand_over", None)
    if hand_over is not None:
        _local.hand_over = None
        hand_over()

"""The one way tests wait: poll a condition, bounded, never a bare sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

# Short enough for in-process conditions, long enough not to spin on a mount.
POLL_INTERVAL_SECONDS = 0.01

T = TypeVar("T")


def wait_until(condition: Callable[[], bool], what: str, timeout: float) -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:g}s: {what}")
        time.sleep(POLL_INTERVAL_SECONDS)


def timed(call: Callable[[], T]) -> tuple[T, float]:
    """``call``'s result and the seconds it took."""
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started

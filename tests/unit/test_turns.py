"""Turns at serving: a thread hands its turn over once, and only its own."""

from __future__ import annotations

import threading

from cachefsd import turns


def test_a_turn_is_handed_over_once_by_the_thread_that_holds_it() -> None:
    handed: list[str] = []
    turns.take(lambda: handed.append("mine"))
    assert turns.holds()

    other: list[bool] = []
    thread = threading.Thread(target=lambda: (turns.give_up(), other.append(turns.holds())))
    thread.start()
    thread.join()
    assert other == [False]
    assert handed == [], "another thread gave up a turn it never held"

    turns.give_up()
    turns.give_up()
    assert handed == ["mine"]
    assert not turns.holds()

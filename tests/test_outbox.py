"""mmserve.serving.outbox: calls leave the caller's thread and run in order, none lost."""

from __future__ import annotations

import functools
import threading
import time

from mmserve.serving.outbox import Outbox


def test_calls_run_in_order_on_one_other_thread():
    outbox = Outbox("test-outbox")
    seen: list[tuple[int, str]] = []
    for i in range(500):

        def record(i: int = i) -> None:
            seen.append((i, threading.current_thread().name))

        assert outbox.put(record)
    assert outbox.flush(10)
    assert [i for i, _ in seen] == list(range(500))
    assert {name for _, name in seen} == {"test-outbox"}
    outbox.close()


def test_a_failing_call_does_not_stop_the_others():
    outbox = Outbox("test-outbox")
    seen: list[int] = []
    outbox.put(lambda: 1 / 0)
    outbox.put(lambda: seen.append(1))
    assert outbox.flush(10) and seen == [1]
    outbox.close()


def test_put_returns_while_a_slow_call_runs_and_close_drains():
    outbox = Outbox("test-outbox")
    release = threading.Event()
    seen: list[int] = []
    outbox.put(release.wait)
    start = time.monotonic()
    for i in range(100):
        outbox.put(functools.partial(seen.append, i))
    assert time.monotonic() - start < 1.0  # the caller never waits for the calls
    assert not outbox.flush(0.05) and seen == []
    release.set()
    outbox.close()
    assert seen == list(range(100))
    assert outbox.put(lambda: seen.append(-1)) is False  # closed: dropped, never run
    assert seen[-1] == 99

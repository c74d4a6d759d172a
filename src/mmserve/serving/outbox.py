"""Work that must leave the engine's event loop: Triton calls, which block.

Every call into Triton from a Python model (``response_sender.send``, ``is_cancelled``, a metric's
``increment``) is a blocking round trip to the tritonserver process. Made on the asyncio loop that
also runs vLLM's output handler, each one delays every other request's next token. An ``Outbox``
takes them off the loop: the loop appends a call (microseconds) and one thread runs the calls, in
order, draining everything queued at each wake-up.

Not ``ThreadPoolExecutor(max_workers=1)``: its shutdown has no timeout, and the interpreter joins its
worker at exit, so a call stuck in a dead tritonserver would hold the stub's exit; here ``close``
waits a bounded time and the thread is a daemon.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Outbox:
    """A FIFO of calls run by one daemon thread, in the order they were put.

    Args:
        name: the thread's name (in logs and ``py-spy`` dumps).
    """

    def __init__(self, name: str) -> None:
        self._calls: collections.deque[Callable[[], object]] = collections.deque()
        self._wake = threading.Condition()
        self._pending = 0  # calls put and not yet finished
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, call: Callable[[], object]) -> bool:
        """Run ``call()`` on the outbox's thread, after every call put before it; False (and
        dropped) once the outbox is closed."""
        with self._wake:
            if self._closed:
                logger.debug("%s: closed, a call is dropped", self._thread.name)
                return False
            self._calls.append(call)
            self._pending += 1
            self._wake.notify()
            return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every call put so far has run; False on timeout."""
        with self._wake:
            return self._wake.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        """Run what is queued, then stop the thread (later ``put`` calls are dropped)."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("%s: %d call(s) still queued after %s s", self._thread.name, self._pending, timeout)

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._calls or self._closed)
                if not self._calls:  # closed and drained
                    return
                batch, self._calls = self._calls, collections.deque()
            for call in batch:
                try:
                    call()
                except Exception:
                    logger.exception("%s: a queued call failed", self._thread.name)
            with self._wake:
                self._pending -= len(batch)
                self._wake.notify_all()

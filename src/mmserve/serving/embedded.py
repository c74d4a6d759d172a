"""What a Triton Python-backend stub lacks: a UTF-8 locale in its embedded interpreter (the adapters,
``model_repository/*/1/model.py``, call ``use_utf8_locale`` first, before torch or vLLM are imported),
processes it starts that end with it and with its server (``exit_with_server``,
``die_with_triton_stub``), Python logging in the server's log, a stack dump on demand
(``prepare_stub``), and a garbage collector that skips the startup heap (``freeze_startup_heap``)."""

from __future__ import annotations

import contextlib
import gc
import locale
import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

_ASCII = ("ascii", "ansi_x3.4-1968")


def use_utf8_locale() -> bool:
    """Switch LC_CTYPE to C.UTF-8 when the process's preferred encoding is ASCII; True if switched.

    The stub embeds an interpreter that never applies the environment's locale (a ``python``
    executable does, and coerces the C locale to UTF-8), so files opened without an encoding would be
    read as ASCII there: torch reads its UTF-8 kernel templates that way and fails. Processes the
    models start (vLLM's engine core) inherit the switch when forked, and apply their own otherwise.
    """
    if locale.getpreferredencoding(False).lower() not in _ASCII:
        return False
    try:
        locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
    except locale.Error:
        return False
    return True


STUB_EXECUTABLE = "triton_python_backend_stub"


def die_with_triton_stub() -> bool:
    """In a process a Triton stub started (vLLM's engine core, through the plugin): have the kernel
    SIGKILL this process when the stub dies; True if set.

    A stub whose tritonserver is killed or crashes exits by itself ("Non-graceful termination"),
    without shutting its engine down: vLLM's engine core (and, under it, its workers, which watch
    their parent) would run on as orphans holding the model's memory. The signal is tied to the stub's
    thread that started the engine (``mmserve.engine.EngineRunner``'s loop thread, alive as long as
    the engine). Elsewhere (vLLM in any other program) nothing changes.
    """
    import ctypes
    import os
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        if os.path.basename(os.readlink(f"/proc/{parent}/exe")) != STUB_EXECUTABLE:
            return False
    except OSError:
        return False
    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the stub died before the call: too late for the signal
        os.kill(os.getpid(), signal.SIGKILL)
    server = _parent_of(parent)
    if server is not None:
        threading.Thread(
            target=_end_a_stub_that_outlives_its_server, args=(parent, server), name="mmserve-stub-guard", daemon=True
        ).start()
    return True


STUB_OUTLIVES_SERVER_S = 5.0
"""How long a stub may outlive its tritonserver before its engine core ends it (``die_with_triton_stub``)."""


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
        return int(data[data.rfind(")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _end_a_stub_that_outlives_its_server(stub: int, server: int, interval_s: float = 1.0) -> None:
    """In the engine core: once the stub's tritonserver is gone, give the stub
    ``STUB_OUTLIVES_SERVER_S`` to clean up and exit (``exit_with_server``); if it is still there,
    remove the shared memory it and this process mapped and SIGKILL it (this process then dies by
    its parent-death signal, its workers after it). A stub can't always do it itself: a thread of
    it blocked in a call into the dead server can hold its GIL for good (``mmserve.triton_seam``:
    STUB_EXITS_WITH_SERVER; seen: a metric update), and its engine would then run on, holding the
    model's memory. This process has a GIL of its own."""
    import os
    import signal
    import time

    while _parent_of(stub) == server:
        time.sleep(interval_s)
    deadline = time.monotonic() + STUB_OUTLIVES_SERVER_S
    while time.monotonic() < deadline:
        if _parent_of(stub) is None:
            return  # the stub exited (and this process goes with it)
        time.sleep(0.1)
    for path in _shm_files_mapped_by((stub, os.getpid(), *_children_of(os.getpid()))) | _stub_region(stub):
        with contextlib.suppress(OSError):
            os.unlink(path)
    with contextlib.suppress(OSError):
        os.kill(stub, signal.SIGKILL)


def _children_of(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except (OSError, ValueError):
        return []


def _shm_files_mapped_by(pids: tuple[int, ...]) -> set[str]:
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    path = line.rstrip("\n").split(maxsplit=5)[-1]
                    if path.startswith("/dev/shm/"):
                        found.add(path.removesuffix(" (deleted)"))
        except OSError:
            continue
    return found


def _stub_region(stub: int) -> set[str]:
    """The stub's Python-backend region (its second argument), as ``remove_own_shm_region`` reads it."""
    try:
        with open(f"/proc/{stub}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        name = argv[2].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return set()
    return {f"/dev/shm/{name}"} if name and "/" not in name else set()


STACK_DUMP_SIGNAL = "SIGUSR1"
"""On this signal a stub writes every thread's stack to the server log (``prepare_stub``); the
launcher sends it to the stubs of a stop that nears its exit timeout (``mmserve_dev.triton``)."""


def prepare_stub(pb_utils: object, *, on_server_exit: Callable[[], None] = lambda: None) -> None:
    """Call first in a model's ``initialize``: Python ``logging`` (INFO and up, every logger that
    propagates to the root) goes to the server's log through the Python backend's logger
    (``pb_utils.Logger``; nothing configures logging in a stub, and only warnings would reach
    stderr); ``STACK_DUMP_SIGNAL`` dumps every thread's stack to the log; and the stub exits once
    tritonserver is gone (``exit_with_server``, after ``on_server_exit``)."""
    import faulthandler
    import signal
    import sys

    forward_logging_to_triton(pb_utils)
    faulthandler.register(getattr(signal, STACK_DUMP_SIGNAL), file=sys.stderr, all_threads=True)
    exit_with_server(on_server_exit)


class _TritonLogHandler(logging.Handler):
    """Writes records through ``pb_utils.Logger`` (a call into the server: on the listener's thread)."""

    def __init__(self, pb_utils: object) -> None:
        super().__init__()
        log = pb_utils.Logger  # type: ignore[attr-defined]
        self._by_level = (
            (logging.ERROR, log.log_error),
            (logging.WARNING, log.log_warn),
            (logging.INFO, log.log_info),
            (logging.NOTSET, log.log_verbose),
        )

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            write = next(write for level, write in self._by_level if record.levelno >= level)
            write(message)
        except Exception:  # noqa: BLE001 - logging must never break the model
            self.handleError(record)


_listener = None


def forward_logging_to_triton(pb_utils: object, level: int = logging.INFO) -> None:
    """Route the root logger to the server's log, through a queue: a log call anywhere (the engine's
    loop included) only enqueues; one thread makes the calls into the server. Idempotent."""
    global _listener
    import logging.handlers
    import queue

    if _listener is not None:
        return
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    handler = _TritonLogHandler(pb_utils)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    _listener = logging.handlers.QueueListener(records, handler)
    _listener.start()
    root = logging.getLogger()
    root.addHandler(logging.handlers.QueueHandler(records))
    root.setLevel(level)


CLEANUP_DEADLINE_S = 3.0
"""Once its server is gone, the longest a stub spends on its cleanup before it exits regardless."""
_server_gone = False


def server_gone() -> bool:
    """True once this stub's tritonserver is known to be gone (``exit_with_server``): make no call
    into it any more (such a call never returns, and may hold the GIL while it waits)."""
    return _server_gone


def exit_with_server(cleanup: Callable[[], None], interval_s: float = 1.0) -> threading.Thread:
    """In a Triton stub: once tritonserver is gone (this process was re-parented), run ``cleanup``
    (``mm_llm``: SIGKILL the engine's processes, remove their shared memory) and exit at once.

    A stub notices its server's death late or never (``mmserve.triton_seam``: STUB_EXITS_WITH_SERVER),
    and the engine it started would run on with it, holding the model's memory. Returns the watching
    thread (a daemon).
    """
    import faulthandler
    import os
    import sys
    import time

    server = os.getppid()

    def watch() -> None:
        global _server_gone
        while True:
            time.sleep(interval_s)
            with _watchdog_lock:
                if _deadman_armed and not _finalizing:  # see arm_deadman_switch
                    faulthandler.dump_traceback_later(DEADMAN_S, exit=True, file=sys.stderr)
            if os.getppid() != server:
                _server_gone = True
                # A thread blocked in a call into the dead server may hold the GIL for good (the
                # Python backend's unload_model and metric calls wait for an answer without
                # releasing it): faulthandler's watchdog, a C thread, ends the process regardless.
                faulthandler.dump_traceback_later(CLEANUP_DEADLINE_S, exit=True, file=sys.stderr)
                try:
                    cleanup()
                    remove_own_shm_region()
                finally:
                    os._exit(1)

    thread = threading.Thread(target=watch, name="mmserve-server-watch", daemon=True)
    thread.start()
    return thread


DEADMAN_S = 30.0
"""A serving stub whose watcher thread could not run for this long exits (``arm_deadman_switch``)."""
_watchdog_lock = threading.Lock()
_deadman_armed = False
_finalizing = False


def arm_deadman_switch() -> None:
    """Call last in a model's ``initialize``: from now on, a stub whose watcher thread
    (``exit_with_server``) gets no turn for ``DEADMAN_S`` -- a thread holds the GIL in a call that
    never returns, as the Python backend's calls into a dead or wedged server do -- writes every
    thread's stack to the server log and exits (``faulthandler``'s watchdog, a C thread, needs no
    GIL). Its engine processes die with it. Not during ``initialize``, whose imports and engine
    start may hold the GIL in long C calls; ``finish_stub`` disarms it."""
    import faulthandler
    import sys

    global _deadman_armed
    with _watchdog_lock:
        _deadman_armed = True
        if not _finalizing:
            faulthandler.dump_traceback_later(DEADMAN_S, exit=True, file=sys.stderr)


def finish_stub(exit_after_s: float = 5.0) -> None:
    """Call last in a model's ``finalize``: stop forwarding logs (no call into the server after its
    model is finalized), free garbage cycles while the stub still can (a response sender freed at
    interpreter exit crashed the stub on 2.51: ``mmserve.triton_seam`` FREE_SENDERS_BEFORE_EXIT),
    and ``exit_soon_after_finalize``."""
    global _listener
    import logging.handlers

    if _listener is not None:
        _listener.stop()  # what was logged so far goes out first
        _listener = None
        root = logging.getLogger()
        for handler in [h for h in root.handlers if isinstance(h, logging.handlers.QueueHandler)]:
            root.removeHandler(handler)
    gc.collect()
    exit_soon_after_finalize(exit_after_s)


def remove_own_shm_region() -> bool:
    """Remove this stub's Python-backend shared-memory region (``/dev/shm/<its name>``, the stub's
    second argument), which its server, gone, can't remove any more; True if removed."""
    import os

    try:
        with open("/proc/self/cmdline", "rb") as cmdline:
            argv = cmdline.read().split(b"\0")
        if os.path.basename(argv[0].decode()) != STUB_EXECUTABLE or len(argv) < 3:
            return False
        name = argv[2].decode()
        if "/" in name or not name:
            return False
        os.unlink(os.path.join("/dev/shm", name))
        return True
    except (OSError, UnicodeDecodeError):
        return False


def exit_soon_after_finalize(seconds: float = 5.0) -> None:
    """Call last in a model's ``finalize``: if the stub has not exited ``seconds`` later, write every
    thread's stack to stderr (the server log) and end the process.

    The stub sends "finalized" and then tears its interpreter down; one that hangs there keeps
    tritonserver from finishing its unload until ``--exit-timeout-secs`` runs out (exit code 1, seen
    in CI). ``faulthandler``'s watchdog is a C thread: it works while the interpreter finalizes.
    """
    import faulthandler
    import sys

    global _finalizing
    with _watchdog_lock:  # the dead man's switch is re-armed no more: this deadline replaces it
        _finalizing = True
        faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)


def never_free(*objects: object) -> None:
    """Keep ``objects`` alive for the rest of the process, interpreter teardown included (an extra
    reference nothing ever drops), so that their destructors never run.

    For the Python backend's ``MetricFamily`` and ``Metric`` objects (``mmserve.triton_seam``
    SHARED_METRIC_FAMILIES): Triton shares a family, and a metric of the same labels, between every
    instance of a model, and one instance's destructor deletes them for all. When a new instance
    loads while the old one still unloads (the keeper's load beside an instance a client holds; any
    reload), the old one's deleted the new one's: measured on 2.51, tritonserver then aborted, or
    the new instance's responses hung."""
    import ctypes

    for item in objects:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(item))


def freeze_startup_heap() -> int:
    """Call last in a model's ``initialize``: move every object alive now (torch, transformers,
    vLLM, the model's own state: millions of objects) out of the garbage collector's reach, as
    vLLM's own API server does (``freeze_gc_heap``); returns how many were frozen.

    Without it every full collection walks them all with the GIL held: in ``mm_llm``'s stub such
    a collection took up to 0.5 s (730,000 objects tracked, measured at its start); with the
    startup heap frozen, no collection took over 20 ms while it streamed 6,000 tokens.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

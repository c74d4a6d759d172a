"""What a Triton Python-backend stub lacks: a UTF-8 locale in its embedded interpreter (the adapters,
``model_repository/*/1/model.py``, call ``use_utf8_locale`` first, before torch or vLLM are imported),
processes it starts that end with it and with its server (``exit_with_server``,
``die_with_triton_stub``), and a garbage collector that skips the startup heap (``freeze_startup_heap``)."""

from __future__ import annotations

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
    return True


def exit_with_server(cleanup: Callable[[], None], interval_s: float = 1.0) -> threading.Thread:
    """In a Triton stub: once tritonserver is gone (this process was re-parented), run ``cleanup``
    (``mm_llm``: SIGKILL the engine's processes, remove their shared memory) and exit at once.

    A stub notices its server's death late or never (measured on 2.51: a stub still running 40 s
    after tritonserver's SIGKILL), and the engine it started would run on with it, holding the
    model's memory. Returns the watching thread (a daemon).
    """
    import os
    import time

    server = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != server:
                try:
                    cleanup()
                finally:
                    os._exit(1)

    thread = threading.Thread(target=watch, name="mmserve-server-watch", daemon=True)
    thread.start()
    return thread


def exit_soon_after_finalize(seconds: float = 5.0) -> None:
    """Call last in a model's ``finalize``: if the stub has not exited ``seconds`` later, write every
    thread's stack to stderr (the server log) and end the process.

    The stub sends "finalized" and then tears its interpreter down; one that hangs there keeps
    tritonserver from finishing its unload until ``--exit-timeout-secs`` runs out (exit code 1, seen
    in CI). ``faulthandler``'s watchdog is a C thread: it works while the interpreter finalizes.
    """
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)


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

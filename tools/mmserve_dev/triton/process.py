"""A real tritonserver process on 127.0.0.1: start, readiness, and a complete stop.

It launches the server of ``mmserve_dev.triton.install`` bound to 127.0.0.1 (or another address given
as ``host``), waits for readiness, and
always tears it down completely: the whole process group (server, Python-backend stubs and anything
they spawned) and the server's ``/dev/shm`` regions.

Library use (tests, benchmarks)::

    with TritonServer("model_repository") as server:
        client = tritonclient.grpc.InferenceServerClient(server.grpc_url)
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import importlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

from mmserve import operator, settings, triton_seam
from mmserve_dev.triton.connections import end_connections
from mmserve_dev.triton.http_guard import HttpGuard
from mmserve_dev.triton.install import (
    TritonServerError,
    find_tritonserver,
    prepare_backend_dir,
    python_libdir,
    venv_bin,
)

if TYPE_CHECKING:  # imported where it is used: only a server that keeps models loaded needs it
    from mmserve.serving.keeper import ModelKeeper

__all__ = ["TritonServer", "free_ports", "remove_stale_shm", "shm_files_mapped"]

SHM_DIR = Path("/dev/shm")


def free_ports(count: int = 3, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that are free on ``host`` right now (held open together while choosing)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# --------------------------------------------------------------------------------------------------
# Processes

_SHM_PREFIX_RE = re.compile(r"^mmserve_(\d+)_\d+_")


ORPHAN_GLOBS = ("sem.mp-*", "psm_*")
"""What vLLM's engine processes leave in /dev/shm when they are SIGKILLed with nobody to clean up
after them: Python multiprocessing's named semaphores (their resource tracker removes them at a
normal exit) and vLLM's message queues (``psm_*``, 160-250 MB each, which its processes or the
launcher's stop remove otherwise)."""
ORPHAN_MIN_AGE_S = 60.0


def remove_stale_shm() -> list[str]:
    """Remove /dev/shm regions named by the default prefix (``mmserve_<pid>_<n>_``) whose process
    is gone, and the engine's leftovers (``ORPHAN_GLOBS``) that no live process has open (mapped)
    and that are older than a minute."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(SHM_DIR):
            match = _SHM_PREFIX_RE.match(name)
            if not match or _pid_alive(int(match.group(1))):
                continue
            with contextlib.suppress(OSError):
                (SHM_DIR / name).unlink()
                removed.append(name)
    for path in _orphans():
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path.name)
    return removed


def _orphans() -> list[Path]:
    now = time.time()
    candidates = []
    for path in (path for pattern in ORPHAN_GLOBS for path in SHM_DIR.glob(pattern)):
        with contextlib.suppress(OSError):
            if now - path.stat().st_mtime > ORPHAN_MIN_AGE_S:
                candidates.append(path)
    if not candidates:  # the usual case: no /proc scan
        return []
    mapped = shm_files_mapped(int(p.name) for p in Path("/proc").glob("[0-9]*"))
    return [path for path in candidates if path not in mapped]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid`` (Linux /proc)."""
    members = []
    for stat_path in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat_path) as f:
                data = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may contain spaces/parentheses.
        rest = data[data.rfind(")") + 2 :].split()
        if len(rest) >= 3 and rest[0] != "Z" and int(rest[2]) == pgid:
            members.append(int(data.split(" ", 1)[0]))
    return members


def _describe(pids: Iterable[int]) -> str:
    """``pid (name, state)`` of each of ``pids`` (Linux /proc), for logs."""
    described = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                data = f.read()
            described.append(f"{pid} ({data[data.find('(') + 1 : data.rfind(')')]}, {data[data.rfind(')') + 2]})")
        except OSError:
            described.append(f"{pid} (gone)")
    return ", ".join(described)


def shm_files_mapped(pids: Iterable[int]) -> set[Path]:
    """The /dev/shm files that processes ``pids`` have mapped (Linux /proc/<pid>/maps)."""
    found: set[Path] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    path = line.rstrip("\n").split(maxsplit=5)[-1]
                    if path.startswith(f"{SHM_DIR}/"):
                        found.add(Path(path.removesuffix(" (deleted)")))
        except OSError:
            continue
    return found


HELD_CONNECTIONS_AFTER_S = 2.0
"""After SIGINT, how long a stop waits for tritonserver to exit before it ends the client connections
the server still holds (``mmserve_dev.triton.connections``): a stop that only unloads takes less."""


_LIVE_SERVERS: set[TritonServer] = set()
_LIVE_LOCK = threading.Lock()
_SERVER_COUNTER = itertools.count()


NEW_PROCESS_GROUP = 0
"""``subprocess.Popen(..., process_group=NEW_PROCESS_GROUP)`` for a server: a process group of its own
(it and its children are signalled and killed together) in the launcher's session. Not a new
session: Linux schedules each session as one group (``sched_autogroup``), and a CPU engine's
processes spin on ``sched_yield`` while they wait for each other (vLLM's shared-memory queues); on a
2-core machine (kernel 6.18) a process of another session was then left runnable but unscheduled for
up to 11 s at a time: a client read a 3,000-token stream in one burst at its end, and a cancel or a
drain sent meanwhile reached the engine seconds late. In one session every process gets its share
(docs/PERFORMANCE.md, "One scheduling group")."""


def die_with_this_process(cmd: list[str]) -> list[str]:
    """``cmd`` run under ``setpriv --pdeathsig KILL``: the kernel SIGKILLs it when this process dies
    without stopping it (SIGKILLed, the OOM killer, a test timeout). The signal fires when the
    *thread* that started the child ends, so only from the main thread; elsewhere (or without
    util-linux's ``setpriv``) ``cmd`` is returned as it is."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or threading.current_thread() is not threading.main_thread():
        return list(cmd)
    return [setpriv, "--pdeathsig", "KILL", "--", *cmd]


def dump_stacks(pids: Iterable[int]) -> list[int]:
    """Send ``STACK_DUMP_SIGNAL`` to every process of ``pids`` that catches it (the project's stubs:
    ``mmserve.serving.embedded.prepare_stub``; its default action would end any other), so that
    each writes its threads' stacks to the server log; returns the pids signalled."""
    from mmserve.serving.embedded import STACK_DUMP_SIGNAL

    number = getattr(signal, STACK_DUMP_SIGNAL)
    sent = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as status:
                caught = next(int(line.split()[1], 16) for line in status if line.startswith("SigCgt:"))
            if caught & (1 << (number - 1)):
                os.kill(pid, number)
                sent.append(pid)
        except (OSError, StopIteration, ValueError):
            continue
    return sent


NATIVE_STACK_MARKERS = (
    "triton::backend::python",
    "ModelLifeCycle",
    "TritonModel",
    "ModelInstanceState",
    "TerminateStub",
    "thread_pool",
    "ResponseFactory",
    "Ensemble",
    "Unload",
)
"""Native frames that make a tritonserver thread worth showing in ``native_stacks``."""


def native_stacks(pid: int, timeout: float = 20.0) -> str:
    """The native stacks of ``pid``'s threads that are in Triton's model lifecycle, its Python
    backend or its ensemble (``NATIVE_STACK_MARKERS``), through gdb where it is installed; for a stop
    that does not end: what tritonserver waits for, which the stubs' Python stacks cannot show."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(no gdb: no native stacks)"
    try:
        done = subprocess.run(
            [gdb, "-p", str(pid), "-batch", "-nx", "-ex", "set pagination off", "-ex", "thread apply all bt 16"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(gdb failed: {exc})"
    threads = re.split(r"\n(?=Thread \d+ )", done.stdout)
    shown = [
        thread.strip()
        for thread in threads
        if thread.startswith("Thread ") and any(m in thread for m in NATIVE_STACK_MARKERS)
    ]
    return (
        f"native stacks of {pid}: {len(shown)} of {len(threads)} threads in Triton's lifecycle, backend or ensemble\n"
        + "\n\n".join(shown)
    )


def _stop_all_at_exit() -> None:
    with _LIVE_LOCK:
        servers = list(_LIVE_SERVERS)
    for server in servers:
        with contextlib.suppress(Exception):
            server.stop(timeout=10.0)


atexit.register(_stop_all_at_exit)


_NANOBIND_LEAK_REPORT = re.compile(r"nanobind: (leaked|this is likely)| - leaked | - \.\.\. skipped remainder")
_NANOBIND_LEAK_LINK = re.compile(r"^See https://nanobind\S*?refleaks\.html")  # no newline: the next line follows


STALL_S = 180.0
"""A starting server whose log stays silent this long while not ready has stalled (no model load here
is quiet for a minute, even on two busy cores)."""
STALLED_LOAD = "a model's load stalled"
"""The Python backend of tritonserver 2.51 waits for a stub's answer to its initialize without a
timeout: twice in ~8 clean CI runs here a model (``preprocess`` once, ``encode`` once) never finished
loading, every stub idle outside Python (their stacks: ``<no Python frame>``), the server waiting for
good. python_backend#408 (in Triton 25.08) puts a timeout on that wait. ``start`` launches such a
server once more, as a user would restart it."""


class TritonServer:
    """A tritonserver process on 127.0.0.1 serving ``model_repository`` with the Python backend.

    Args:
        model_repository: one path or several (each becomes a ``--model-repository``).
        http_port, grpc_port, metrics_port: fixed ports; any left ``None`` get free ports chosen at start.
        log_verbose: ``--log-verbose`` level.
        log_file: where the server's stdout/stderr go (default: a temporary file, kept after stop).
        backend_config: extra ``--backend-config`` settings, ``{"python": {"key": "value"}}`` or
            ``["python,key=value", ...]``.
        model_control_mode: ``explicit`` (default: the models load at start, ``load_models``, and may
            reload themselves, as ``mm_llm`` does after an engine failure), ``none`` or ``poll``.
        load_models: names for ``--load-model`` in explicit mode (default ``*``: all).
        extra_args: further command-line arguments, appended last.
        env: environment overrides for the server (applied after the computed variables; a value of
            ``None`` removes a variable).
        shm_default_byte_size: the Python backend's ``shm-default-byte-size`` (its default is 1 MiB);
            its ``shm-growth-byte-size`` can be set through ``backend_config``.
        shm_prefix: the Python backend's ``shm-region-prefix-name`` (default ``mmserve_<pid>_<n>_``,
            unique per server so that parallel servers don't collide and cleanup finds them).
        cache_dir: where ``prepare_backend_dir`` lays out the backend folder.
        host: the address the three endpoints bind: 127.0.0.1 (the default) or, in a container,
            0.0.0.0. The URLs (``http_url``, ...) always connect through 127.0.0.1.
        numpy2_compat: install the NumPy 2 fix into the Python backend (``mmserve_dev.triton.numpy2_compat``); keep it on.
        exit_timeout_s: the server's ``--exit-timeout-secs``: how long, after SIGINT, it waits for
            in-flight requests and open HTTP connections (a client that keeps its connection open
            delays the shutdown by this much) and then for the models to unload, all together;
            short, so that a stop takes at most 15 s in any state (Triton's default is 30).
        die_with_parent: have the kernel SIGKILL the server when this process dies without stopping
            it (via ``setpriv --pdeathsig``; only when started from the main thread). Its stubs then
            exit by themselves; its /dev/shm regions are removed by the next server started here.
        keep_loaded: models a ``mmserve.serving.keeper.ModelKeeper`` loads back once the first of
            them unloads itself after a fault (``("mm_llm", "mm_ensemble")`` for this project's
            repository); it runs from the server's readiness until ``stop``.
        drain: the model ``stop`` drains first (``mmserve.drain``: ``mm_llm`` for this project's
            repository; None: none), giving the generations in flight ``drain_grace_s`` before they
            are ended UNAVAILABLE, so that the unload that follows has the whole exit timeout.
        operator_key: the operator's key (``mmserve.operator``): Triton's repository,
            shared-memory, logging and trace APIs and ``mm_llm``'s drain take only requests that
            carry it; the server, its stubs, the keeper and the drain get it. Default: the
            environment's (``MMSERVE_OPERATOR_KEY``, ``MMSERVE_OPERATOR_KEY_FILE``), else a new
            one per server (written to ``MMSERVE_OPERATOR_KEY_FILE`` when that names a file not
            there yet).
        restrict_apis: put those APIs behind the key (on by default; off: every client may call
            them, as Triton's own default).
        http_guard: put ``mmserve_dev.triton.http_guard.HttpGuard`` on the HTTP port, with
            tritonserver's own HTTP endpoint on 127.0.0.1 behind it (``mmserve.triton_seam``
            HTTP_FRONT_GUARD). Default: where the release the launcher runs needs it.
    """

    def __init__(
        self,
        model_repository: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        log_verbose: int = 0,
        log_file: str | os.PathLike[str] | None = None,
        backend_config: Mapping[str, Mapping[str, object]] | Iterable[str] | None = None,
        model_control_mode: str | None = "explicit",
        load_models: Iterable[str] = ("*",),
        extra_args: Iterable[str] = (),
        env: Mapping[str, str | None] | None = None,
        shm_default_byte_size: int | None = None,
        shm_prefix: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        numpy2_compat: bool = True,
        exit_timeout_s: int = 12,
        die_with_parent: bool = True,
        keep_loaded: Sequence[str] = (),
        host: str = "127.0.0.1",
        drain: str | None = None,
        drain_grace_s: float = 2.0,
        operator_key: str | None = None,
        restrict_apis: bool = True,
        http_guard: bool | None = None,
    ) -> None:
        if isinstance(model_repository, (str, os.PathLike)):
            model_repository = [model_repository]
        self.model_repositories = [Path(p).resolve() for p in model_repository]
        self._fixed_ports = (http_port, grpc_port, metrics_port)
        self.http_port, self.grpc_port, self.metrics_port = self._fixed_ports
        self.log_verbose = log_verbose
        n = next(_SERVER_COUNTER)
        self.shm_prefix = shm_prefix or f"mmserve_{os.getpid()}_{n}_"
        if log_file is None:
            fd, log_name = tempfile.mkstemp(prefix=f"tritonserver-{os.getpid()}-{n}-", suffix=".log")
            os.close(fd)
            log_file = log_name
        self.log_path: Path | None = None if str(log_file) == "-" else Path(log_file)  # None: our stdout
        if isinstance(backend_config, Mapping):
            self.backend_config = [f"{b},{k}={v}" for b, kv in backend_config.items() for k, v in kv.items()]
        else:
            self.backend_config = list(backend_config or ())
        self.model_control_mode = model_control_mode
        self.load_models = list(load_models)
        self.extra_args = list(extra_args)
        self.env_overrides = dict(env or {})
        self.shm_default_byte_size = shm_default_byte_size
        self.cache_dir = cache_dir
        self.numpy2_compat = numpy2_compat
        self.die_with_parent = die_with_parent
        self.exit_timeout_s = exit_timeout_s
        self.keep_loaded = list(keep_loaded)
        self.host = host
        self.drain, self.drain_grace_s = drain, drain_grace_s
        self.operator_key = operator.check_key(operator_key) if operator_key else operator.key_for_this_start()[0]
        self.restrict_apis = restrict_apis
        if http_guard is None:  # the release this launcher runs (the tests assert it is the one served)
            http_guard = any(w.key == "HTTP_FRONT_GUARD" for w in triton_seam.active(triton_seam.TRITON_TESTED))
        self.http_guard = http_guard
        self._guard: HttpGuard | None = None
        self._http_backend_port: int | None = None  # tritonserver's own HTTP port (behind the guard)
        self.keeper: ModelKeeper | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self._pgid: int | None = None
        self._log_handle: IO[bytes] | None = None
        self._stop_lock = threading.Lock()
        self._drained = self._drain_answered = False
        self.version: str | None = None
        """The server's release (its ``/v2`` metadata), read once at start (``mmserve.triton_seam``)."""
        self.stop_timeline: list[tuple[float, str]] = []
        """The last stop's phases: (seconds since it began, what ended then), for a slow stop's report."""

    # ---------------------------------------------------------------------------------- endpoints
    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def _backend_http_url(self) -> str:
        """tritonserver's own HTTP endpoint (behind the guard, when there is one)."""
        return f"127.0.0.1:{self._http_backend_port or self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def ports(self) -> tuple[int | None, int | None, int | None]:
        """(http, grpc, metrics); chosen at start() for those not given."""
        return (self.http_port, self.grpc_port, self.metrics_port)

    def operator_headers(self, protocol: str = "http") -> dict[str, str]:
        """The headers (``http``) or metadata (``grpc``) of an operator's call to this server."""
        return (
            operator.http_headers(self.operator_key) if protocol == "http" else operator.grpc_headers(self.operator_key)
        )

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # ------------------------------------------------------------------------------- environment
    def command(self) -> list[str]:
        """The full command line (ports must have been assigned)."""
        install = find_tritonserver()
        backends = prepare_backend_dir(self.cache_dir, install, numpy2_compat=self.numpy2_compat)
        cmd = [str(install.binary)]
        cmd += [f"--model-repository={p}" for p in self.model_repositories]
        cmd += [
            f"--backend-directory={backends}",
            f"--http-address={'127.0.0.1' if self.http_guard else self.host}",
            f"--http-port={self._http_backend_port or self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            "--allow-metrics=true",
            "--allow-gpu-metrics=false",
            "--allow-cpu-metrics=true",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            f"--log-verbose={self.log_verbose}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            "--pinned-memory-pool-byte-size=0",  # no CUDA here: don't try to pin host memory
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]
        if self.shm_default_byte_size is not None:
            cmd.append(f"--backend-config=python,shm-default-byte-size={self.shm_default_byte_size}")
        cmd += [f"--backend-config={c}" for c in self.backend_config]
        if self.model_control_mode:
            cmd.append(f"--model-control-mode={self.model_control_mode}")
        if self.model_control_mode == "explicit":
            cmd += [f"--load-model={m}" for m in self.load_models]
        if self.restrict_apis:
            cmd += operator.triton_args(self.operator_key)
        cmd += self.extra_args
        return cmd

    def environment(self) -> dict[str, str]:
        """The server's environment: libpython and the bundled libs on LD_LIBRARY_PATH, the venv on PATH."""
        install = find_tritonserver()
        env = dict(os.environ)
        ld = [str(python_libdir()), str(install.libs_dir)]
        if env.get("LD_LIBRARY_PATH"):
            ld.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = os.pathsep.join(ld)
        # The stub's embedded interpreter takes its prefix (and so site-packages) from the first
        # python3 on PATH; PYTHONPATH is ignored by it.
        path = [str(venv_bin())]
        if env.get("PATH"):
            path.append(env["PATH"])
        env["PATH"] = os.pathsep.join(path)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env[settings.OPERATOR_KEY.name] = self.operator_key  # mm_llm's drain checks it
        for key, value in self.env_overrides.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    # ------------------------------------------------------------------------------- start / stop
    def start(self, timeout: float = 600.0) -> TritonServer:
        """Launch the server and wait until /v2/health/ready answers 200.

        Raises TritonServerError (with the tail of the server log) if the process exits or ``timeout``
        seconds pass first; the server is stopped in that case. Free ports are re-chosen and the launch
        retried (twice) when a chosen port was taken in the meantime.
        """
        if self.is_running():
            return self
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log_path.write_bytes(b"")  # this start's log only (retries append)
        attempts = 3
        for attempt in range(attempts):
            try:
                self._launch()
                self._wait_ready(timeout)
                self.version = self._read_version()
                if self.http_guard:
                    assert self.http_port is not None and self._http_backend_port is not None
                    try:
                        self._guard = HttpGuard(self.host, self.http_port, self._http_backend_port).start()
                    except OSError as exc:
                        raise TritonServerError(
                            f"the HTTP front on '{self.host}:{self.http_port}' already in use ({exc})"
                        ) from None
                if self.drain:  # now, not at the stop: an import can take seconds on a busy machine
                    for module in ("tritonclient.grpc", "mmserve.drain"):
                        importlib.import_module(module)
                if self.keep_loaded:
                    from mmserve.serving.keeper import ModelKeeper

                    self.keeper = ModelKeeper(self.http_url, self.keep_loaded, operator_key=self.operator_key).start()
                return self
            except TritonServerError as exc:
                self.stop()
                picked = [
                    port
                    for port, fixed in zip(self.ports, self._fixed_ports, strict=True)
                    if fixed is None and f":{port}' already in use" in str(exc)
                ]
                if attempt + 1 >= attempts or not (picked or STALLED_LOAD in str(exc)):
                    raise
        raise AssertionError("unreachable")

    def _launch(self) -> None:
        self._drained = self._drain_answered = False
        auto = free_ports(4)
        self.http_port, self.grpc_port, self.metrics_port = (
            fixed if fixed is not None else picked for fixed, picked in zip(self._fixed_ports, auto, strict=False)
        )
        self._http_backend_port = auto[3] if self.http_guard else self.http_port
        cmd = self.command()
        env = self.environment()
        remove_stale_shm()
        if self.die_with_parent:
            cmd = die_with_this_process(cmd)
        if self.log_path is None:
            print(f"$ {self._shown(cmd)}", flush=True)
        else:
            self._log_handle = log = open(self.log_path, "ab")  # noqa: SIM115 - open while the server runs
            log.write(f"$ {self._shown(cmd)}\n".encode())
            log.flush()
        self.process = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log_handle,  # None: inherited
            stderr=subprocess.STDOUT,
            process_group=NEW_PROCESS_GROUP,
        )
        self._pgid = self.process.pid
        with _LIVE_LOCK:
            _LIVE_SERVERS.add(self)

    def _read_version(self) -> str | None:
        try:
            with urllib.request.urlopen(f"http://{self._backend_http_url}/v2", timeout=5) as resp:
                return str(json.loads(resp.read())["version"])
        except (OSError, ValueError, KeyError):
            return None

    def workarounds(self) -> tuple[triton_seam.Workaround, ...]:
        """The ``mmserve.triton_seam`` workarounds this server's release needs (all: release unknown)."""
        return triton_seam.active(self.version) if self.version else triton_seam.WORKAROUNDS

    def _shown(self, cmd: list[str]) -> str:
        """``cmd`` as the log shows it: the operator's key left out (logs travel further than keys may)."""
        return " ".join(cmd).replace(self.operator_key, "<operator key>")

    def _wait_ready(self, timeout: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        logged, quiet_since = -1, time.monotonic()  # the log's size, and since when it has not grown
        url = f"http://{self._backend_http_url}/v2/health/ready"
        while True:
            code = self.process.poll()
            if code is not None:
                raise TritonServerError(
                    f"tritonserver exited with code {code} before becoming ready; log {self.log_path}:\n"
                    + self.log_tail()
                )
            try:
                # The endpoints start in the order gRPC, HTTP, metrics, and the server exits when one of
                # them fails (a port taken, say): ready means HTTP says ready *and* metrics answer.
                with urllib.request.urlopen(url, timeout=2) as resp:
                    ready = resp.status == 200
                if ready and "--allow-metrics=false" in self.extra_args:
                    return
                if ready:
                    with urllib.request.urlopen(self.metrics_url, timeout=2) as resp:
                        if resp.status == 200 and self.process.poll() is None:
                            return
            except (urllib.error.URLError, OSError):
                pass
            size = self.log_path.stat().st_size if self.log_path is not None and self.log_path.exists() else None
            if size is not None and size != logged:
                logged, quiet_since = size, time.monotonic()
            stalled = size is not None and time.monotonic() - quiet_since > STALL_S
            if stalled or time.monotonic() > deadline:
                # What it waits for, into its log: every stub's Python threads.
                if self.dump_stacks():
                    time.sleep(1.0)
                if stalled:
                    raise TritonServerError(
                        f"tritonserver not ready and its log silent for {STALL_S:.0f} s: {STALLED_LOAD} (its "
                        f"processes' stacks at the log's end); log {self.log_path}:\n" + self.log_tail()
                    )
                raise TritonServerError(
                    f"tritonserver not ready after {timeout:.0f} s (its processes' stacks at the log's end); "
                    f"log {self.log_path}:\n" + self.log_tail()
                )
            time.sleep(0.1)

    def stop(self, timeout: float | None = None) -> int | None:
        """Stop the server: drain ``drain`` (up to ``drain_grace_s``), SIGINT, wait up to ``timeout``
        s (default: exit_timeout_s + 3, the time it may spend on in-flight requests and the models'
        finalize(), and a little; 2 s before its exit timeout, every stub that can is asked for its
        threads' stacks, into the log), then SIGKILL the whole process group.

        Afterwards no process of the group is left and the server's /dev/shm regions are removed.
        Idempotent. Returns the server's exit code (None if it was never started).
        """
        with self._stop_lock:
            began = time.monotonic()
            timeline = self.stop_timeline = []

            def phase(what: str) -> None:
                timeline.append((round(time.monotonic() - began, 2), what))

            keeper, self.keeper = self.keeper, None
            if keeper is not None:  # told first (it would load back what the stop unloads), joined below
                keeper.stop(timeout=0)
            proc, pgid = self.process, self._pgid
            code = None
            if timeout is None:
                timeout = self.exit_timeout_s + 3.0
            # First the drain: requests in flight end now, and the work below (reading /proc of busy
            # engine processes among it) runs on an idle server.
            if self.drain and self.is_running() and not self._drained:
                phase("drained" if self.drain_now(on_sent=lambda: phase("drain sent")) else "drain not answered")
            if keeper is not None:
                keeper.stop()
                phase("keeper stopped")
            if self._guard is not None:  # its clients' connections go with it: none can hold the exit
                guard, self._guard = self._guard, None
                guard.stop()
                phase("HTTP front stopped")
            # Shared memory of the server's processes (vLLM's engine and workers among them): what a
            # process that is killed, or crashes, can't remove itself is removed below.
            mapped = shm_files_mapped(_group_members(pgid)) if pgid is not None else set()
            phase("shared memory listed")
            if proc is not None:
                if proc.poll() is None:
                    signalled = time.monotonic()
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGINT)
                    # What still holds a model once nothing is in flight is a client's connection
                    # (mmserve.triton_seam HELD_STREAMS): ended HELD_CONNECTIONS_AFTER_S after the
                    # signal when the drain answered (every request ended), else half-way to the
                    # exit timeout, by when the models' finalize has answered every request.
                    # Never earlier: a connection cut while a request's last responses are on
                    # their way loses them (and on 2.51 can leak the request: server#8078).
                    cut_after = (
                        HELD_CONNECTIONS_AFTER_S
                        if self._drain_answered
                        else max(HELD_CONNECTIONS_AFTER_S, self.exit_timeout_s / 2)
                    )
                    try:
                        try:
                            proc.wait(timeout=cut_after)
                        except subprocess.TimeoutExpired:
                            if any(w.key == "HELD_STREAMS" for w in self.workarounds()):
                                ports = (port for port in (self.grpc_port, self._http_backend_port) if port)
                                ended = sum(end_connections(proc.pid, port) for port in ports)
                                phase(f"client connections ended: {ended}")
                            proc.wait(timeout=max(self.exit_timeout_s - 2.0 - cut_after, 0.0))
                    except subprocess.TimeoutExpired:
                        if pgid is not None:
                            phase("no exit yet: stacks dumped into the log")
                            dump_stacks(_group_members(pgid))
                            self._log_native_stacks(proc.pid)
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            proc.wait(timeout=max(timeout - (time.monotonic() - signalled), 0.0))
                code = proc.poll()
                phase(f"tritonserver exited ({code})" if code is not None else "tritonserver still running")
            if pgid is not None:
                mapped |= shm_files_mapped(_group_members(pgid))
                self._kill_group(pgid, grace=2.0 if code is not None else 0.0, phase=phase)
                phase("process group gone")
                for path in mapped:
                    with contextlib.suppress(OSError):
                        path.unlink()
                if proc is not None:
                    code = proc.wait()
            if self._log_handle is not None:
                with contextlib.suppress(OSError):
                    self._log_handle.close()
                self._log_handle = None
            self._remove_shm()
            self._pgid = None
            with _LIVE_LOCK:
                _LIVE_SERVERS.discard(self)
            return code

    def dump_stacks(self, *, native: bool = False) -> list[int]:
        """Have the server's processes write their stacks to its log (the project's stubs their
        Python threads; with ``native``, tritonserver its native ones too): a diagnosis of something
        that waits. Returns the pids signalled."""
        if self._pgid is None:
            return []
        sent = dump_stacks(_group_members(self._pgid))
        if native and self.process is not None and self.process.poll() is None:
            self._log_native_stacks(self.process.pid)
        return sent

    def _log_native_stacks(self, pid: int) -> None:
        """Append tritonserver's native stacks (``native_stacks``) to its log."""
        if self._log_handle is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self._log_handle.write(("\n" + native_stacks(pid) + "\n").encode(errors="replace"))
            self._log_handle.flush()

    def drain_now(self, on_sent: Callable[[], object] | None = None) -> bool:
        """Drain ``drain`` (``mmserve.drain``) if it is set and the server runs; True if it answered.
        ``on_sent``: ``mmserve.drain.drain``'s."""
        if not (self.drain and self.is_running() and self.grpc_port is not None) or self._drained:
            return False
        self._drained = True  # once per start: what a drain ends is not served again
        from mmserve.drain import drain

        # A stop has 15 s: past the grace period the drain's answer is awaited 1 s at most (the
        # models' finalize ends whatever is left).
        self._drain_answered = drain(
            self.grpc_url,
            self.drain_grace_s,
            llm=self.drain,
            answer_margin_s=1.0,
            on_sent=on_sent,
            operator_key=self.operator_key,
        )
        return self._drain_answered

    @staticmethod
    def _kill_group(pgid: int, grace: float, phase: Callable[[str], None] = lambda what: None) -> None:
        # Stubs exit by themselves shortly after the server finalizes their models; give them
        # ``grace`` seconds, then kill what is left of the group and wait until it is gone.
        deadline = time.monotonic() + grace
        while _group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not (left := _group_members(pgid)):
            return
        phase(f"SIGKILL for what was left: {_describe(left)}")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while _group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def shm_files(self) -> list[Path]:
        """This server's shared-memory files under /dev/shm."""
        return sorted(SHM_DIR.glob(glob.escape(self.shm_prefix) + "*"))

    def _remove_shm(self) -> None:
        for path in self.shm_files():
            with contextlib.suppress(OSError):
                path.unlink()

    def log_tail(self, lines: int = 60) -> str:
        """The log's last ``lines`` lines, without the reference-leak reports that triton-lang's
        nanobind module prints when a process that imported it exits (dozens of lines each, no
        news: they would push a stack dump out of a failure message)."""
        if self.log_path is None:
            return "(the log went to stdout)"
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        lines_ = (_NANOBIND_LEAK_LINK.sub("", line) for line in text.splitlines())
        kept = [line for line in lines_ if line and not _NANOBIND_LEAK_REPORT.match(line)]
        return "\n".join(kept[-lines:])

    # ---------------------------------------------------------------------------- context manager
    def __enter__(self) -> TritonServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.stop()
        except BaseException:
            # Last resort: never leave the process group behind, whatever went wrong above.
            pgid = self._pgid
            if pgid is not None:
                with contextlib.suppress(OSError):
                    os.killpg(pgid, signal.SIGKILL)
            self._remove_shm()
            raise

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        repos = [str(p) for p in self.model_repositories]
        return f"TritonServer({repos}, http={self.http_url}, grpc={self.grpc_url}, {state})"

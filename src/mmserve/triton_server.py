"""Start and stop a real Triton Inference Server (CPU) on this machine.

The ``tritonserver`` 2.51.0 binary, its Python backend and the per-Python backend stubs come from the
``nvidia-pytriton`` 0.7.0 wheel (installed without its dependencies by ``scripts/setup_env.sh``).
This module lays out a ``backends/python/`` folder for it once, launches it bound to 127.0.0.1 with
an environment under which the Python-backend stub runs this virtual env's interpreter and packages,
waits for readiness, and always tears it down completely: the whole process group (server,
Python-backend stubs and anything they spawned) and the server's ``/dev/shm`` regions.

NumPy 2: the stub's pybind11 predates NumPy 2 and misreads dtype sizes, so tensors that go through
numpy arrive wrong (inputs repeat their first element; TYPE_STRING inputs crash the stub; outputs
made with ``pb_utils.Tensor(name, array)`` are empty). ``prepare_backend_dir`` appends
``NUMPY2_COMPAT_PATCH`` to its copy of ``triton_python_backend_utils.py``, which fixes all three;
model code keeps using ``as_numpy()`` and ``pb_utils.Tensor(name, array)`` as usual.

Library use (tests, benchmarks)::

    with TritonServer("model_repository") as server:
        client = tritonclient.grpc.InferenceServerClient(server.grpc_url)

Command line (foreground; Ctrl-C or SIGTERM stops it cleanly)::

    python -m mmserve.triton_server --model-repository model_repository \
        [--http-port 8000 --grpc-port 8001 --metrics-port 8002] [--log-verbose 1]
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import glob
import hashlib
import importlib.util
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

__all__ = [
    "TritonInstall",
    "TritonServer",
    "TritonServerError",
    "find_tritonserver",
    "free_ports",
    "main",
    "prepare_backend_dir",
    "python_libdir",
    "remove_stale_shm",
]

SHM_DIR = Path("/dev/shm")
_PYTHON_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
_STUB_NAME = "triton_python_backend_stub"


# Appended to the copy of triton_python_backend_utils.py that prepare_backend_dir lays out (the stub
# imports that module before it first touches NumPy, and sets pb_utils.Tensor on it afterwards).
NUMPY2_COMPAT_PATCH = r"""

# ---- mmserve: NumPy 2 compatibility for the Python-backend stub (appended by mmserve.triton_server) ----
# The stub in nvidia-pytriton 0.7.0 (Triton 2.51) is built with a pybind11 older than 2.12, which reads
# a dtype's itemsize at NumPy 1's offset in PyArray_Descr. Under NumPy 2 that field holds the dtype's
# flags (0 for numeric dtypes), so without this patch (1) every input tensor's as_numpy() repeats its
# first element (and a TYPE_STRING input crashes the stub), and (2) an output built with
# pb_utils.Tensor(name, numpy_array) carries 0 bytes. The patch (a) hands pybind11 a copy of NumPy's
# C-API table whose PyArray_NewFromDescr recomputes the strides pybind11 got wrong, (b) builds numeric
# output tensors through DLPack, whose byte size the stub computes itself, and (c) serializes TYPE_STRING
# outputs into an array whose dtype pybind11 reads as 1 byte wide while the stub copies them.
def _mmserve_numpy2_compat():
    import ctypes
    import sys as _sys

    if int(np.__version__.split(".")[0]) < 2:
        return
    _i32 = np.dtype(np.int32)
    if (ctypes.c_int64.from_address(id(_i32) + 40).value != 4
            or ctypes.c_uint64.from_address(id(_i32) + 32).value != 0):
        print("mmserve numpy2 compat: unexpected PyArray_Descr layout; not patching", file=_sys.stderr)
        return

    import numpy.core.multiarray as _legacy_multiarray  # the module pybind11 < 2.12 takes the C-API from
    from numpy._core import _multiarray_umath

    # A private handle on the C API: ctypes.pythonapi's function objects are shared, and other
    # libraries (dill, tritonclient) set their argtypes to what suits them.
    pythonapi = ctypes.PyDLL(None)
    get_pointer = pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    new_capsule = pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

    n_slots = 300  # pybind11 uses slots up to 282 (PyArray_SetBaseObject)
    original = (ctypes.c_void_p * n_slots).from_address(get_pointer(_multiarray_umath._ARRAY_API, None))
    table = (ctypes.c_void_p * n_slots)(*original)
    ssize_p = ctypes.POINTER(ctypes.c_ssize_t)
    proto = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ssize_p, ssize_p,
             ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
    new_from_descr = ctypes.PYFUNCTYPE(*proto)(original[94])  # PyArray_NewFromDescr; keeps the GIL

    def patched_new_from_descr(subtype, descr, nd, dims, strides, data, flags, obj):
        if strides and nd > 0 and descr:
            real = ctypes.c_int64.from_address(descr + 40).value
            seen = ctypes.c_int32.from_address(descr + 32).value  # what pybind11 took for the itemsize
            if real != seen:
                expected, fixed, step_seen, step_real = [], [], seen, real
                for axis in range(nd - 1, -1, -1):
                    expected.append(step_seen)
                    fixed.append(step_real)
                    step_seen *= dims[axis]
                    step_real *= dims[axis]
                if [strides[axis] for axis in range(nd - 1, -1, -1)] == expected:
                    strides = (ctypes.c_ssize_t * nd)(*reversed(fixed))
        return new_from_descr(subtype, descr, nd, dims, strides, data, flags, obj)

    hook = ctypes.CFUNCTYPE(*proto)(patched_new_from_descr)
    table[94] = ctypes.cast(hook, ctypes.c_void_p).value
    _legacy_multiarray._ARRAY_API = new_capsule(ctypes.addressof(table), None, None)
    _mmserve_numpy2_compat.keep = (table, hook, new_from_descr)  # the table and the hook must live on

    # (c) TYPE_STRING outputs: the stub takes size * "itemsize" of what serialize_byte_tensor returns.
    import threading

    original_serialize = serialize_byte_tensor
    pending = threading.local()

    def serialize_byte_tensor_numpy2(input_tensor):
        flat = original_serialize(input_tensor)
        if not isinstance(flat, bytes):
            return flat
        dtype = np.dtype([("b", np.uint8)])  # a fresh descriptor object, private to this array
        arr = np.frombuffer(flat, dtype=np.uint8).copy().view(dtype)
        # pybind11 reads the low 32 bits of flags as the itemsize: make them 1 (NPY_ITEM_REFCOUNT, which a
        # structured dtype with one uint8 field tolerates); Tensor() resets them once the stub has copied.
        ctypes.c_uint64.from_address(id(dtype) + 32).value = 1
        if getattr(pending, "dtypes", None) is not None:
            pending.dtypes.append(dtype)
        return arr

    globals()["serialize_byte_tensor"] = serialize_byte_tensor_numpy2

    # The stub marks a consumed capsule "used_dlpack"; the producer's destructor expects the standard
    # "used_dltensor" and otherwise prints "PyCapsule_GetPointer called with incorrect name" per tensor.
    capsule_is_valid = pythonapi.PyCapsule_IsValid
    capsule_is_valid.restype = ctypes.c_int
    capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
    capsule_set_name = pythonapi.PyCapsule_SetName
    capsule_set_name.restype = ctypes.c_int
    capsule_set_name.argtypes = [ctypes.py_object, ctypes.c_void_p]
    used_name = ctypes.create_string_buffer(b"used_dltensor")

    def _from_dlpack(c_tensor, name, obj):
        try:
            on_cpu = obj.__dlpack_device__()[0] in (1, 3)  # kDLCPU, kDLCUDAHost
        except Exception:
            on_cpu = False
        if not on_cpu:
            return c_tensor.from_dlpack(name, obj)
        capsule = obj.__dlpack__()
        tensor = c_tensor.from_dlpack(name, capsule)
        if capsule_is_valid(capsule, b"used_dlpack"):
            capsule_set_name(capsule, ctypes.addressof(used_name))
        return tensor

    _mmserve_numpy2_compat.keep += (used_name,)

    class _TensorMeta(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, cls._c_tensor)

        def __call__(cls, name, array):
            c_tensor = cls._c_tensor
            array = np.asarray(array)
            if array.dtype.kind == "U":
                array = array.astype(np.object_)
            if array.dtype.kind in "OS":
                pending.dtypes = []
                try:
                    return c_tensor(name, array)
                finally:
                    for dtype in pending.dtypes:
                        ctypes.c_uint64.from_address(id(dtype) + 32).value = 0
                    pending.dtypes = None
            # (b) numeric: through DLPack (the stub computes the byte size from shape and dtype).
            if not array.flags.c_contiguous:
                array = array.copy(order="C")
            return _from_dlpack(c_tensor, name, array)

    class _ModuleWithCompatTensor(type(_sys.modules[__name__])):
        def __setattr__(self, attr, value):
            if attr == "Tensor" and not isinstance(value, _TensorMeta):
                value = _TensorMeta("Tensor", (), {
                    "_c_tensor": value,
                    "from_dlpack": staticmethod(lambda name, obj, _c=value: _from_dlpack(_c, name, obj)),
                    "__doc__": value.__doc__,
                })
            super().__setattr__(attr, value)

    _sys.modules[__name__].__class__ = _ModuleWithCompatTensor

    try:  # self-test: pybind11 must take NumPy's C-API from the patched table (it does so on first use)
        import c_python_backend_utils
    except ImportError:  # not inside the stub
        return
    try:
        probe = np.arange(3, dtype=np.int32)
        if _from_dlpack(c_python_backend_utils.Tensor, "probe", probe).as_numpy().tolist() != [0, 1, 2]:
            print("mmserve numpy2 compat: self-test failed; tensors will be wrong", file=_sys.stderr)
    except Exception as exc:
        print(f"mmserve numpy2 compat: self-test error: {exc!r}", file=_sys.stderr)


_mmserve_numpy2_compat()
"""


class TritonServerError(RuntimeError):
    """The server could not be found, started or became ready."""


# --------------------------------------------------------------------------------------------------
# Locating the installation


@dataclasses.dataclass(frozen=True)
class TritonInstall:
    """Paths of the tritonserver installation inside the nvidia-pytriton package."""

    root: Path  # .../site-packages/pytriton/tritonserver
    binary: Path  # root/bin/tritonserver
    python_backend_dir: Path  # root/backends/python (libtriton_python.so, triton_python_backend_utils.py)
    stubs_dir: Path  # root/python_backend_stubs/<X.Y>/triton_python_backend_stub
    libs_dir: Path  # .../site-packages/nvidia_pytriton.libs

    def stub(self, python_version: str | None = None) -> Path:
        """The Python-backend stub built for ``python_version`` ("3.11"; default: this interpreter)."""
        version = python_version or "{}.{}".format(*sys.version_info[:2])
        path = self.stubs_dir / version / _STUB_NAME
        if not path.is_file():
            have = sorted(p.parent.name for p in self.stubs_dir.glob(f"*/{_STUB_NAME}"))
            raise TritonServerError(f"no Python-backend stub for Python {version} in {self.stubs_dir} (have {have})")
        return path


def find_tritonserver() -> TritonInstall:
    """Locate tritonserver, its Python backend, the stubs and the bundled libraries.

    The ``pytriton`` package is located without importing it (its ``__init__`` pulls in its client).
    """
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonServerError(
            "nvidia-pytriton is not installed (it carries the tritonserver binary); run scripts/setup_env.sh"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    root = package_dir / "tritonserver"
    install = TritonInstall(
        root=root,
        binary=root / "bin" / "tritonserver",
        python_backend_dir=root / "backends" / "python",
        stubs_dir=root / "python_backend_stubs",
        libs_dir=package_dir.parent / "nvidia_pytriton.libs",
    )
    missing = [
        str(p)
        for p in (
            install.binary,
            install.libs_dir,
            install.stubs_dir,
            *(install.python_backend_dir / f for f in _PYTHON_BACKEND_FILES),
        )
        if not p.exists()
    ]
    if missing:
        raise TritonServerError(f"incomplete tritonserver installation in {package_dir}: missing {missing}")
    return install


def python_libdir() -> Path:
    """The directory of the shared libpython this interpreter was built with (pyenv's ``lib/``).

    It must come first on LD_LIBRARY_PATH: otherwise the stub may load the system's libpython3.11
    (a different patch release) against this interpreter's standard library.
    """
    candidates = []
    libdir = sysconfig.get_config_var("LIBDIR")  # in a venv: the base interpreter's build config
    if libdir:
        candidates.append(Path(libdir))
    candidates.append(Path(sys.base_prefix) / "lib")
    soname = "libpython{}.{}.so".format(*sys.version_info[:2])
    for cand in candidates:
        if any(cand.glob(soname + "*")):
            return cand
    raise TritonServerError(
        f"no shared {soname} next to this interpreter (looked in {[str(c) for c in candidates]}); "
        "the Python-backend stub needs a Python built with --enable-shared"
    )


def _venv_bin() -> Path:
    """The bin/ folder of the running virtual env (or of the interpreter when not in one)."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "bin"
    return Path(sys.executable).parent


def _default_cache_dir() -> Path:
    base = os.environ.get("MMSERVE_CACHE_DIR")
    if base:
        return Path(base) / "triton"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "mmserve" / "triton"


def prepare_backend_dir(
    cache_dir: str | os.PathLike[str] | None = None,
    install: TritonInstall | None = None,
    *,
    numpy2_compat: bool = True,
) -> Path:
    """Lay out ``<cache_dir>/backends/python/`` for ``--backend-directory`` and return ``<cache_dir>/backends``.

    It holds copies of libtriton_python.so, triton_python_backend_utils.py and the stub for this
    interpreter's Python version. With ``numpy2_compat`` (the default) NUMPY2_COMPAT_PATCH is appended
    to triton_python_backend_utils.py: without it, tensors passed through numpy are wrong under NumPy 2
    (see the patch's comment). Created once (atomically, so concurrent callers are safe) and reused
    while the sources and the patch are unchanged.
    """
    install = install or find_tritonserver()
    version = "{}.{}".format(*sys.version_info[:2])
    sources = {name: install.python_backend_dir / name for name in _PYTHON_BACKEND_FILES}
    sources[_STUB_NAME] = install.stub(version)
    patch = NUMPY2_COMPAT_PATCH if numpy2_compat else ""
    fingerprint = "\n".join(
        [f"{n} {src.resolve()} {src.stat().st_size} {src.stat().st_mtime_ns}" for n, src in sorted(sources.items())]
        + [f"patch {hashlib.sha256(patch.encode()).hexdigest()}"]
    )

    cache = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    backends = cache / "backends"
    target = backends / "python"
    stamp = target / ".mmserve-source"
    if stamp.is_file() and stamp.read_text() == fingerprint and all((target / n).is_file() for n in sources):
        return backends

    backends.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".python-", dir=backends))
    try:
        for name, src in sources.items():
            shutil.copy2(src, staging / name)
        if patch:
            utils = staging / "triton_python_backend_utils.py"
            utils.write_text(utils.read_text() + patch)
        (staging / ".mmserve-source").write_text(fingerprint)
        old = None
        if target.exists():
            old = backends / f".old-python-{os.getpid()}-{time.monotonic_ns()}"
            with contextlib.suppress(OSError):
                target.rename(old)
        try:
            staging.rename(target)
        except OSError:
            # Another process won the race; use its copy if complete.
            if not (stamp.is_file() and stamp.read_text() == fingerprint):
                raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return backends


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


def remove_stale_shm() -> list[str]:
    """Remove /dev/shm regions named by the default prefix (``mmserve_<pid>_<n>_``) whose process is gone."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(SHM_DIR):
            match = _SHM_PREFIX_RE.match(name)
            if not match or _pid_alive(int(match.group(1))):
                continue
            with contextlib.suppress(OSError):
                (SHM_DIR / name).unlink()
                removed.append(name)
    return removed


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


_LIVE_SERVERS: set[TritonServer] = set()
_LIVE_LOCK = threading.Lock()
_SERVER_COUNTER = itertools.count()


def _stop_all_at_exit() -> None:
    with _LIVE_LOCK:
        servers = list(_LIVE_SERVERS)
    for server in servers:
        with contextlib.suppress(Exception):
            server.stop(timeout=10.0)


atexit.register(_stop_all_at_exit)


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
        numpy2_compat: patch the Python backend for NumPy 2 (see NUMPY2_COMPAT_PATCH); keep it on.
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
        self.log_path = Path(log_file)
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
        self.keeper = None
        self.process: subprocess.Popen[bytes] | None = None
        self._pgid: int | None = None
        self._log_handle = None
        self._stop_lock = threading.Lock()

    # ---------------------------------------------------------------------------------- endpoints
    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

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
            "--http-address=127.0.0.1",
            f"--http-port={self.http_port}",
            "--grpc-address=127.0.0.1",
            f"--grpc-port={self.grpc_port}",
            "--allow-metrics=true",
            "--allow-gpu-metrics=false",
            "--allow-cpu-metrics=true",
            "--metrics-address=127.0.0.1",
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
        path = [str(_venv_bin())]
        if env.get("PATH"):
            path.append(env["PATH"])
        env["PATH"] = os.pathsep.join(path)
        env.setdefault("PYTHONUNBUFFERED", "1")
        for key, value in self.env_overrides.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    # ------------------------------------------------------------------------------- start / stop
    def start(self, timeout: float = 120.0) -> TritonServer:
        """Launch the server and wait until /v2/health/ready answers 200.

        Raises TritonServerError (with the tail of the server log) if the process exits or ``timeout``
        seconds pass first; the server is stopped in that case. Free ports are re-chosen and the launch
        retried (twice) when a chosen port was taken in the meantime.
        """
        if self.is_running():
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_bytes(b"")  # this start's log only (retries append)
        attempts = 3
        for attempt in range(attempts):
            try:
                self._launch()
                self._wait_ready(timeout)
                if self.keep_loaded:
                    from mmserve.serving.keeper import ModelKeeper

                    self.keeper = ModelKeeper(self.http_url, self.keep_loaded).start()
                return self
            except TritonServerError as exc:
                self.stop()
                picked = [
                    port
                    for port, fixed in zip(self.ports, self._fixed_ports, strict=True)
                    if fixed is None and f":{port}' already in use" in str(exc)
                ]
                if attempt + 1 >= attempts or not picked:
                    raise
        raise AssertionError("unreachable")

    def _launch(self) -> None:
        auto = free_ports(3)
        self.http_port, self.grpc_port, self.metrics_port = (
            fixed if fixed is not None else picked for fixed, picked in zip(self._fixed_ports, auto, strict=True)
        )
        cmd = self.command()
        env = self.environment()
        remove_stale_shm()
        setpriv = shutil.which("setpriv")
        if self.die_with_parent and setpriv and threading.current_thread() is threading.main_thread():
            # SIGKILL the server if this process dies without stopping it (killed by a test timeout,
            # say). PR_SET_PDEATHSIG fires when the *thread* that started the server ends: main thread only.
            cmd = [setpriv, "--pdeathsig", "KILL", "--", *cmd]
        self._log_handle = open(self.log_path, "ab")
        self._log_handle.write(f"$ {' '.join(cmd)}\n".encode())
        self._log_handle.flush()
        self.process = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log_handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: stubs and their children can be killed together
        )
        self._pgid = self.process.pid
        with _LIVE_LOCK:
            _LIVE_SERVERS.add(self)

    def _wait_ready(self, timeout: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        url = f"http://{self.http_url}/v2/health/ready"
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
            if time.monotonic() > deadline:
                raise TritonServerError(
                    f"tritonserver not ready after {timeout:.0f} s; log {self.log_path}:\n" + self.log_tail()
                )
            time.sleep(0.1)

    def stop(self, timeout: float | None = None) -> int | None:
        """Stop the server: SIGINT, wait up to ``timeout`` s (default: exit_timeout_s + 3, the time it
        may spend on in-flight requests and the models' finalize(), and a little), then SIGKILL the
        whole process group.

        Afterwards no process of the group is left and the server's /dev/shm regions are removed.
        Idempotent. Returns the server's exit code (None if it was never started).
        """
        with self._stop_lock:
            if self.keeper is not None:  # first: it would load back what the stop unloads
                self.keeper.stop()
                self.keeper = None
            proc, pgid = self.process, self._pgid
            code = None
            if timeout is None:
                timeout = self.exit_timeout_s + 3.0
            # Shared memory of the server's processes (vLLM's engine and workers among them): what a
            # process that is killed, or crashes, can't remove itself is removed below.
            mapped = shm_files_mapped(_group_members(pgid)) if pgid is not None else set()
            if proc is not None:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGINT)
                    try:
                        proc.wait(timeout=timeout)
                    except subprocess.TimeoutExpired:
                        pass
                code = proc.poll()
            if pgid is not None:
                mapped |= shm_files_mapped(_group_members(pgid))
                self._kill_group(pgid, grace=2.0 if code is not None else 0.0)
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

    @staticmethod
    def _kill_group(pgid: int, grace: float) -> None:
        # Stubs exit by themselves shortly after the server finalizes their models; give them
        # ``grace`` seconds, then kill what is left of the group and wait until it is gone.
        deadline = time.monotonic() + grace
        while _group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _group_members(pgid):
            return
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
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

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


# --------------------------------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mmserve.triton_server",
        description="Run tritonserver (CPU, Python backend) in the foreground on 127.0.0.1.",
    )
    parser.add_argument("--model-repository", required=True, action="append", help="may be repeated")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--log-file", default=None, help="server log (default: a temporary file)")
    parser.add_argument("--shm-default-byte-size", type=int, default=None)
    parser.add_argument("--backend-config", action="append", default=[], help="BACKEND,KEY=VALUE; may be repeated")
    parser.add_argument("--model-control-mode", default="explicit", choices=["none", "explicit", "poll"],
                        help="explicit (default) lets mm_llm reload itself after an engine failure")
    parser.add_argument("--load-model", action="append", default=None, help="explicit mode; default: all")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    parser.add_argument("--keep-loaded", default="", metavar="MODEL,MODEL",
                        help="load these back when the first unloads itself after a fault (mmserve.serving.keeper)")
    parser.add_argument("--hint", default="", help="printed once ready; {http} and {grpc} are replaced by the URLs")
    args = parser.parse_args(argv)

    server = TritonServer(
        args.model_repository,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        log_verbose=args.log_verbose,
        log_file=args.log_file,
        backend_config=args.backend_config,
        model_control_mode=args.model_control_mode,
        load_models=args.load_model or ("*",),
        shm_default_byte_size=args.shm_default_byte_size,
        keep_loaded=[name for name in args.keep_loaded.split(",") if name],
    )

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    # Ctrl-C even when started in the background by a non-interactive shell (which ignores SIGINT).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.suppress(AttributeError):
        signal.signal(signal.SIGHUP, on_sigterm)
    try:
        print(f"starting tritonserver (log: {server.log_path}) ...", flush=True)
        t0 = time.monotonic()
        server.start(timeout=args.start_timeout)
        print(f"ready in {time.monotonic() - t0:.1f} s", flush=True)
        print(f"HTTP     {server.http_url}", flush=True)
        print(f"gRPC     {server.grpc_url}", flush=True)
        print(f"metrics  {server.metrics_url}", flush=True)
        if args.hint:
            print(args.hint.format(http=server.http_url, grpc=server.grpc_url), flush=True)
        print("Ctrl-C to stop", flush=True)
        while server.is_running():
            time.sleep(0.5)
        print(f"tritonserver exited by itself (code {server.process.returncode}); log tail:", file=sys.stderr)
        print(server.log_tail(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping ...", flush=True)
        return 0
    except TritonServerError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        # Ignore further Ctrl-C/SIGTERM while tearing down, so cleanup can't be interrupted.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        code = server.stop()
        if code is not None:
            print(f"stopped (exit code {code})", flush=True)


if __name__ == "__main__":
    sys.exit(main())

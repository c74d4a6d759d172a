"""Finding the tritonserver installation of the nvidia-pytriton wheel and preparing its Python backend.

The ``tritonserver`` 2.51.0 binary, its Python backend and the per-Python backend stubs come from the
``nvidia-pytriton`` 0.7.0 wheel (installed without its dependencies by ``scripts/setup_env.sh``).
``prepare_backend_dir`` lays out a ``backends/python/`` folder for it once, with the NumPy 2
compatibility fix (``mmserve_dev.triton.numpy2_compat``) installed; ``server_environment`` is the
environment under which the Python-backend stub runs this virtual env's interpreter and packages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from mmserve.settings import CACHE_DIR

__all__ = [
    "TritonInstall",
    "TritonServerError",
    "find_tritonserver",
    "prepare_backend_dir",
    "python_libdir",
    "venv_bin",
]

_PYTHON_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
_STUB_NAME = "triton_python_backend_stub"


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


def venv_bin() -> Path:
    """The bin/ folder of the running virtual env (or of the interpreter when not in one)."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "bin"
    return Path(sys.executable).parent


def _default_cache_dir() -> Path:
    base = CACHE_DIR.get()
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
    interpreter's Python version. With ``numpy2_compat`` (the default) ``mmserve_dev.triton.numpy2_compat``
    is installed there: copied as mmserve_numpy2_compat.py, and called by a hook appended to the copy of
    triton_python_backend_utils.py. Without it, tensors passed through numpy are wrong under NumPy 2 (see
    that module's docstring). Created once (atomically, so concurrent callers are safe) and reused while
    the sources and the compatibility module are unchanged.
    """
    install = install or find_tritonserver()
    version = "{}.{}".format(*sys.version_info[:2])
    sources = {name: install.python_backend_dir / name for name in _PYTHON_BACKEND_FILES}
    sources[_STUB_NAME] = install.stub(version)
    # The stub appends the backend folder (where it imports triton_python_backend_utils from) to sys.path,
    # so the module copied next to the utils imports by its file name; importing
    # mmserve_dev.triton.numpy2_compat instead would tie the stub to how this package is installed.
    compat_file, compat_source, compat_hook = "mmserve_numpy2_compat.py", "", ""
    if numpy2_compat:
        compat_source = Path(__file__).with_name("numpy2_compat.py").read_text()
        compat_hook = (
            f"\n\n# ---- mmserve: NumPy 2 compatibility for this stub (see {compat_file}) ----\n"
            "import sys as _mmserve_sys\nimport mmserve_numpy2_compat as _mmserve_numpy2_compat\n"
            "_mmserve_numpy2_compat.install(_mmserve_sys.modules[__name__])\n"
        )
    files = [*sources, *([compat_file] if numpy2_compat else [])]
    fingerprint = "\n".join(
        [f"{n} {src.resolve()} {src.stat().st_size} {src.stat().st_mtime_ns}" for n, src in sorted(sources.items())]
        + [f"numpy2_compat {hashlib.sha256((compat_source + compat_hook).encode()).hexdigest()}"]
    )

    cache = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    backends = cache / "backends"
    target = backends / "python"
    stamp = target / ".mmserve-source"
    if stamp.is_file() and stamp.read_text() == fingerprint and all((target / n).is_file() for n in files):
        return backends

    backends.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".python-", dir=backends))
    try:
        for name, src in sources.items():
            shutil.copy2(src, staging / name)
        if numpy2_compat:
            (staging / compat_file).write_text(compat_source)
            utils = staging / "triton_python_backend_utils.py"
            utils.write_text(utils.read_text() + compat_hook)
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

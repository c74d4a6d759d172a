"""A Docker engine for the container tests: the one that answers (``DOCKER_HOST`` or the default socket),
else one started here (as root: Debian's ``docker.io`` installed when missing, ``dockerd`` with its own
data root under the cache folder, kept between runs for the layer cache, and its own socket), stopped
when done. ``DockerUnavailable`` says why there is none (no root, no package, no start).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from mmserve import settings

PACKAGES = ("docker.io", "debootstrap", "docker-compose")
"""Debian's Docker engine (20.10 on bookworm), what makes a base image without a registry, and Compose v1."""
START_TIMEOUT_S = 60.0


class DockerUnavailable(RuntimeError):
    """No Docker engine can run here (the message says why)."""


def _answers(env: dict[str, str]) -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=30, check=False)
    return probe.returncode == 0


def _install() -> None:
    missing = [
        name
        for name, binary in zip(PACKAGES, ("dockerd", "debootstrap", "docker-compose"), strict=True)
        if not shutil.which(binary)
    ]
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise DockerUnavailable(f"no {', '.join(missing)} and no apt-get to install them")
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *missing]):
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
        if done.returncode != 0:
            raise DockerUnavailable(f"{' '.join(command)} failed: {done.stderr[-500:]}")


@contextlib.contextmanager
def docker_engine() -> Iterator[dict[str, str]]:
    """The environment (``DOCKER_HOST``) whose ``docker`` and ``docker-compose`` reach an engine."""
    env = dict(os.environ)
    if _answers(env):
        yield env
        return
    if os.geteuid() != 0:
        raise DockerUnavailable("no Docker engine answers, and starting one needs root")
    _install()
    if shutil.which("docker") is None:
        raise DockerUnavailable("no docker client")
    root = Path(settings.CACHE_DIR.get(str(Path.home() / ".cache" / "mmserve"))) / "docker"
    exec_root = Path("/run/mmserve-docker")
    socket = Path("/run/mmserve-docker.sock")
    root.mkdir(parents=True, exist_ok=True)
    exec_root.mkdir(parents=True, exist_ok=True)
    env["DOCKER_HOST"] = f"unix://{socket}"
    if _answers(env):  # one of ours, left by an earlier run: use it, and leave it
        yield env
        return
    log = (root / "dockerd.log").open("ab")
    daemon = subprocess.Popen(
        [
            "dockerd",
            "--data-root",
            str(root / "data"),
            "--exec-root",
            str(exec_root),
            "-H",
            env["DOCKER_HOST"],
            "--pidfile",
            str(exec_root / "dockerd.pid"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers(env):
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise DockerUnavailable(f"dockerd did not start (log: {root / 'dockerd.log'})")
            time.sleep(0.5)
        yield env
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(60)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        log.close()

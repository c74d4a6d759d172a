"""A Docker engine for the container tests: the one that answers (``DOCKER_HOST`` or the default socket),
else one started here (as root: Debian's ``docker.io`` installed when missing, ``dockerd`` with its own
data root under the cache folder, kept between runs for the layer cache, and its own socket), stopped
when done. ``DockerUnavailable`` says why there is none (no root, no package, no start).

What a session starts carries its label (``Engine.labels``; a Compose project named ``Engine.session``):
a reaper process (``python -m mmserve_dev.docker reap``) removes those containers and networks, and
stops the ``dockerd`` the session started, when the session's process ends without doing it (killed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from mmserve import settings

PACKAGES = ("docker.io", "debootstrap", "docker-compose")
"""Debian's Docker engine (20.10 on bookworm), what makes a base image without a registry, and Compose v1."""
START_TIMEOUT_S = 60.0
SESSION_LABEL = "dev.mmserve.session"


@dataclasses.dataclass(frozen=True)
class Engine:
    """A Docker engine to use: ``env`` (its ``DOCKER_HOST``) for ``docker`` and ``docker-compose``;
    ``session`` names what this session starts (the label's value, the Compose project)."""

    env: dict[str, str]
    session: str

    @property
    def labels(self) -> list[str]:
        """``docker run`` arguments that mark a container as this session's."""
        return ["--label", f"{SESSION_LABEL}={self.session}"]


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
def docker_engine() -> Iterator[Engine]:
    """An engine, and a reaper for what this session starts on it (see the module's docstring)."""
    env = dict(os.environ)
    session = f"mmserve{os.getpid()}x{uuid.uuid4().hex[:8]}"
    if _answers(env):
        with _reaper(env, session, None):
            yield Engine(env, session)
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
        with _reaper(env, session, None):
            yield Engine(env, session)
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
        with _reaper(env, session, daemon.pid):
            yield Engine(env, session)
    finally:
        _stop(daemon.pid)
        daemon.wait()
        log.close()


def _stop(pid: int, timeout_s: float = 60.0) -> None:
    """SIGTERM to ``pid`` (dockerd: it stops its containers), SIGKILL after ``timeout_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.2)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


@contextlib.contextmanager
def _reaper(env: dict[str, str], session: str, daemon: int | None) -> Iterator[None]:
    """A process that outlives this one (its own session) and waits on a pipe from it: "done" then
    the pipe's end means this process cleaned up; the end alone (it was killed) means reap."""
    command = [sys.executable, "-m", "mmserve_dev.docker", "reap", session, str(daemon or 0)]
    reaper = subprocess.Popen(command, stdin=subprocess.PIPE, env=env, start_new_session=True)
    assert reaper.stdin is not None
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            reaper.stdin.write(b"done\n")
            reaper.stdin.close()
        reaper.wait()


def reap(session: str, daemon: int) -> None:
    """Remove the containers and networks of ``session`` (its label, or its Compose project), then
    stop ``dockerd`` ``daemon`` (0: not ours)."""
    env = dict(os.environ)
    for kind in ("container", "network"):
        for label in (f"{SESSION_LABEL}={session}", f"com.docker.compose.project={session}"):
            found = subprocess.run(
                ["docker", kind, "ls", "-aq" if kind == "container" else "-q", "--filter", f"label={label}"],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            ).stdout.split()
            if found:
                remove = ["docker", kind, "rm", *(["-f"] if kind == "container" else []), *found]
                subprocess.run(remove, env=env, capture_output=True, check=False)
    if daemon:
        _stop(daemon)


def main(argv: list[str]) -> int:
    """``reap SESSION DAEMON_PID``: wait for the session's process to close stdin; reap unless it said "done"."""
    if len(argv) != 3 or argv[0] != "reap":
        print("usage: python -m mmserve_dev.docker reap SESSION DAEMON_PID", file=sys.stderr)
        return 2
    told = sys.stdin.buffer.read()
    if told.strip() != b"done":
        reap(argv[1], int(argv[2]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""The CPU image built, run and tested here, and the two-container deployment (deploy/compose.yaml).

A Docker engine is the one that answers, else one this module starts (root: Debian's ``docker.io``
installed when missing; ``mmserve_dev.docker``, which also reaps what a killed run left); without
either, every test here is skipped with the reason (``MMSERVE_CONTAINER_TESTS``: ``0`` skips them,
``1`` fails them instead). The image is built by ``scripts/build_image.sh`` (a base from Debian's packages where no
registry answers). The container runs as the README says, bound to 127.0.0.1 on free ports: the
HEALTHCHECK turns healthy, the processes run as UID 1000, the live end-to-end suites
(``test_e2e_server.py``, ``test_openai.py``) pass against its ports, a SIGKILLed engine core heals,
``docker stop`` with generations in flight exits 0 within ``--stop-timeout``; a checkpoint mounted
read-only serves; Compose brings up Triton and the gateway apart, the gateway answers 503 while
Triton is stopped and serves again once it is back, and ``down`` leaves nothing.

One engine at a time: the container's engine is the only one running while these tests run (they
start and stop their containers in this module, ``own_server``). Measurements (build, size,
start-to-ready, stop) are printed and written to ``MMSERVE_CACHE_DIR``/container-report.json.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmserve import settings
from mmserve_dev.samples import encode_image, sample_image

from utils import ROOT

pytestmark = [pytest.mark.server, pytest.mark.own_server, pytest.mark.container]

TAG = "mmserve-cpu:test"
CPUS = f"{max(1.0, (os.cpu_count() or 1) - 0.5):g}"
"""The containers' CPU limit: the host's cores minus a half. The engine's processes spin while they
wait for each other, and without a limit the clients here (this process, the gateway) waited seconds
to run: a stream arrived in one burst at its end (docs/DEPLOYMENT.md, "CPU engines: one scheduling group")."""
STOP_TIMEOUT_S = 30
READY_TIMEOUT_S = 600
REPORT: dict[str, float | int | str] = {}


def _report(name: str, value: float | int | str) -> None:
    REPORT[name] = value
    folder = Path(settings.CACHE_DIR.get(str(Path.home() / ".cache" / "mmserve")))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "container-report.json").write_text(json.dumps(REPORT, indent=2))
    print(f"[container] {name}: {value}", file=sys.stderr)


@pytest.fixture(scope="module")
def docker():
    from mmserve_dev.docker import DockerUnavailable, docker_engine

    wanted = settings.CONTAINER_TESTS.get()
    if wanted == "0":
        pytest.skip(f"container tests: {settings.CONTAINER_TESTS.name}=0")
    try:
        with docker_engine() as engine:
            yield engine
    except DockerUnavailable as exc:
        if wanted == "1":
            pytest.fail(f"container tests: {settings.CONTAINER_TESTS.name}=1 and no Docker engine here ({exc})")
        pytest.skip(f"container tests: no Docker engine here ({exc}); they run where one answers or root can start one")


def run(docker, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["docker", *args], env=docker.env, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(
            f"docker {' '.join(args)}: {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
    return done


@pytest.fixture(scope="module")
def image(docker):
    started = time.monotonic()
    build = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build_image.sh"), "--tag", TAG],
        env=docker.env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    _report("build_s", round(time.monotonic() - started, 1))
    _report("image_mib", int(run(docker, "image", "inspect", "-f", "{{.Size}}", TAG).stdout) // 2**20)
    return TAG


class Container:
    """``docker run -d --shm-size=2g --stop-timeout=30 --cpus=CPUS -p ...`` of the image, its ports on 127.0.0.1."""

    def __init__(self, docker, image: str, *extra: str) -> None:
        from mmserve_dev.triton import free_ports

        self.docker = docker
        self.http, self.grpc, self.metrics = (f"127.0.0.1:{port}" for port in free_ports(3))
        self.name = f"mmserve-test-{os.getpid()}-{time.monotonic_ns()}"
        ports = [
            arg
            for host, inside in zip((self.http, self.grpc, self.metrics), (8000, 8001, 8002), strict=True)
            for arg in ("-p", f"{host}:{inside}")
        ]
        self.started = time.monotonic()
        run(
            docker,
            "run",
            "-d",
            "--name",
            self.name,
            "--shm-size=2g",
            f"--stop-timeout={STOP_TIMEOUT_S}",
            f"--cpus={CPUS}",
            *docker.labels,
            *ports,
            *extra,
            image,
        )

    def ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        """Seconds from ``docker run`` until ``/v2/health/ready`` answers 200."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://{self.http}/v2/health/ready", timeout=5) as reply:
                    if reply.status == 200:
                        return time.monotonic() - self.started
            except OSError:
                pass
            state = run(self.docker, "inspect", "-f", "{{.State.Status}}", self.name).stdout.strip()
            assert state == "running", f"{state}: {self.logs()}"
            assert time.monotonic() < deadline, self.logs()
            time.sleep(1)

    def logs(self) -> str:
        done = run(self.docker, "logs", "--tail", "80", self.name, check=False)
        return done.stdout + done.stderr

    def exec(self, *command: str) -> str:
        return run(self.docker, "exec", self.name, *command).stdout

    def remove(self) -> None:
        run(self.docker, "rm", "-f", self.name, check=False)


@pytest.fixture(scope="module")
def container(docker, image):
    box = Container(docker, image)
    try:
        _report("start_to_ready_s", round(box.ready(), 1))
        yield box
    finally:
        box.remove()


def test_the_healthcheck_turns_healthy(container):
    deadline = time.monotonic() + 120  # the HEALTHCHECK's first probe is 30 s after the start
    while (
        status := run(container.docker, "inspect", "-f", "{{.State.Health.Status}}", container.name).stdout.strip()
    ) != "healthy":
        assert status in ("starting", "healthy") and time.monotonic() < deadline, status
        time.sleep(2)


def test_every_process_runs_as_the_non_root_user(container):
    uids = container.exec(
        "python",
        "-c",
        "import glob; print(sorted({l.split()[1] for p in glob.glob('/proc/[0-9]*/status') for l in open(p) if l.startswith('Uid:')}))",
    )
    assert json.loads(uids.replace("'", '"')) == ["1000"]


def test_the_live_suites_pass_against_the_container(container):
    """``test_e2e_server.py`` and ``test_openai.py`` (the gateway on the host) against the container's ports."""
    env = {
        **os.environ,
        settings.TRITON_GRPC_URL.name: container.grpc,
        settings.TRITON_HTTP_URL.name: container.http,
        settings.TRITON_METRICS_URL.name: container.metrics,
    }
    suite = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "not fault",
            "tests/test_e2e_server.py",
            "tests/test_openai.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    failures = [line for line in suite.stdout.splitlines() if line.startswith(("FAILED", "ERROR", "E   "))]
    assert suite.returncode == 0, "\n".join(failures[-60:]) or suite.stdout[-4000:]


def _generate(container, **options):
    from mmserve.client import MMClient

    return MMClient(container.grpc, timeout=120).generate("Describe it.", [encode_image(sample_image(3))], **options)


READY_PATHS = ("/v2/health/ready", "/v2/models/mm_llm/ready", "/v2/models/mm_ensemble/ready")


def _readiness(container) -> tuple[int, ...]:
    statuses = []
    for path in READY_PATHS:
        try:
            with urllib.request.urlopen(f"http://{container.http}{path}", timeout=5) as reply:
                statuses.append(reply.status)
        except urllib.error.HTTPError as exc:
            statuses.append(exc.code)
        except OSError:
            statuses.append(0)
    return tuple(statuses)


def _wait_for(condition, timeout: float, what: str, container) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"{what} not within {timeout:g} s: {container.logs()}"
        time.sleep(0.25)
    return time.monotonic() - started


def test_a_killed_engine_core_heals_inside(container):
    """SIGKILL of vLLM's engine core inside the container, as tests/test_faults.py does outside: a
    stream in flight ends with one UNAVAILABLE, the server turns not ready within seconds, the keeper
    loads mm_llm back, and the same request answers as before."""
    from mmserve.client import ClientError, MMClient

    before = _generate(container, max_tokens=8, temperature=0.0).output_ids
    client = MMClient(container.grpc, timeout=120)  # held by name: a client collected closes its streams
    held = client.start("Tell a long story.", max_tokens=3000, ignore_eos=True)
    assert next(iter(held)).output_ids
    killed = container.exec(
        "python",
        "-c",
        "import glob, os, signal\n"
        "pids = [int(p.split('/')[2]) for p in glob.glob('/proc/[0-9]*/cmdline') if b'VLLM::EngineCore' in open(p, 'rb').read()]\n"
        "pids = [pid for pid in pids if pid != os.getpid()]\n"
        "[os.kill(pid, signal.SIGKILL) for pid in pids]; print(len(pids))",
    )
    assert int(killed) == 1
    not_ready = _wait_for(lambda: all(code != 200 for code in _readiness(container)), 10, "not ready", container)
    results: list[Any] = []
    with pytest.raises(ClientError) as ended:
        results.extend(held)
    assert ended.value.code == "UNAVAILABLE", ended.value
    assert 0 < sum(len(r.output_ids) for r in results) < 3000
    healed = _wait_for(lambda: _readiness(container) == (200, 200, 200), 300, "healed", container)
    _report("engine_killed_not_ready_s", round(not_ready, 2))
    _report("engine_killed_serving_again_s", round(not_ready + healed, 1))
    assert _generate(container, max_tokens=8, temperature=0.0).output_ids == before


def _drain(generation) -> tuple[str, str]:
    """Read a stream to its end: ("done", count) or ("error", the error's text)."""
    try:
        return ("done", str(sum(1 for _ in generation)))
    except Exception as exc:  # noqa: BLE001 - the stop's answer
        return ("error", str(exc))


def test_docker_stop_with_generations_in_flight_exits_0(container):
    """``docker stop`` while 4 streams generate: every stream ends with exactly one final answer (its
    text or UNAVAILABLE), and the container exits 0 within ``--stop-timeout``. Runs last: it stops it."""
    from mmserve.client import MMClient

    _wait_for(lambda: _readiness(container) == (200, 200, 200), 300, "ready", container)
    client = MMClient(container.grpc, timeout=120)
    generations = [
        client.start("Tell a long story.", max_tokens=3000, ignore_eos=True, temperature=0.0) for _ in range(4)
    ]
    first = [next(iter(generation)) for generation in generations]  # each has streamed
    assert all(result.output_ids for result in first)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        ends = [pool.submit(_drain, generation) for generation in generations]
        started = time.monotonic()
        run(container.docker, "stop", container.name, timeout=STOP_TIMEOUT_S + 30)
        took = time.monotonic() - started
        outcomes = [end.result(timeout=60) for end in ends]
    code = int(run(container.docker, "inspect", "-f", "{{.State.ExitCode}}", container.name).stdout)
    _report("stop_s", round(took, 1))
    _report("stop_exit_code", code)
    assert code == 0 and took < STOP_TIMEOUT_S, (code, took, container.logs())
    assert all(kind == "done" or "UNAVAILABLE" in detail for kind, detail in outcomes), outcomes


@pytest.fixture(scope="class")
def mounted(docker, image, tiny_models):
    """A container of its own serving Qwen2.5-VL's tiny checkpoint mounted read-only, and that checkpoint."""
    checkpoint = tiny_models["qwen2_5_vl"]
    box = Container(docker, image, "-v", f"{checkpoint}:/models/ckpt:ro", "-e", "MMSERVE_MODEL=/models/ckpt")
    try:
        box.ready()
        yield box, checkpoint
    finally:
        box.remove()


class TestAMountedCheckpoint:
    """``-v CKPT:/models/ckpt:ro -e MMSERVE_MODEL=/models/ckpt``: Qwen2.5-VL's tiny checkpoint from the
    host, in a container of its own (the first one is stopped by then: one engine at a time)."""

    def test_it_serves(self, mounted):
        """``preprocess`` in the container gives the ids the host's processor gives, and it generates."""
        from mmserve.client import MMClient
        from mmserve.serving.preprocess import Preprocessor

        box, checkpoint = mounted
        png = encode_image(sample_image(5))
        client = MMClient(box.grpc, timeout=120)
        want = Preprocessor(checkpoint)("What is it?", [png])["input_ids"]
        tensors = {
            "text_input": np.array([b"What is it?"], dtype=np.object_),
            "image": np.array([png], dtype=np.object_),
        }
        got = client.infer_tensors(tensors, model="preprocess")["input_ids"]
        assert got.reshape(-1).tolist() == np.asarray(want).reshape(-1).tolist()
        assert client.generate("What is it?", [png], max_tokens=4, temperature=0.0).output_ids

    def test_the_kubernetes_prestop_then_docker_stop(self, mounted):
        """The pod's preStop hook, exactly as deploy/kubernetes/deployment.yaml has it (``sleep 5``,
        then ``python3 -m mmserve.drain --grace-s 15``), run with ``docker exec`` while 2 streams
        generate: it exits 0 once they ended (each with one final answer), and the ``docker stop``
        after it (Kubernetes' SIGTERM) exits 0 within ``--stop-timeout``. Runs last: it stops it."""
        import yaml

        from mmserve.client import MMClient

        box, _ = mounted
        manifest = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "deployment.yaml").read_text())
        containers = manifest["spec"]["template"]["spec"]["containers"]
        [pre_stop] = [
            c["lifecycle"]["preStop"]["exec"]["command"]
            for c in containers
            if "mmserve.drain" in str(c.get("lifecycle"))
        ]
        client = MMClient(box.grpc, timeout=120)
        generations = [client.start("Tell a long story.", max_tokens=3000, ignore_eos=True) for _ in range(2)]
        assert all(next(iter(generation)).output_ids for generation in generations)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            ends = [pool.submit(_drain, generation) for generation in generations]
            started = time.monotonic()
            drained = run(box.docker, "exec", box.name, *pre_stop, check=False, timeout=60)
            drain_s = time.monotonic() - started
            outcomes = [end.result(timeout=60) for end in ends]
        assert drained.returncode == 0, drained.stdout + drained.stderr
        assert all(kind == "done" or "UNAVAILABLE" in detail for kind, detail in outcomes), outcomes
        started = time.monotonic()
        run(box.docker, "stop", box.name, timeout=STOP_TIMEOUT_S + 30)
        took = time.monotonic() - started
        code = int(run(box.docker, "inspect", "-f", "{{.State.ExitCode}}", box.name).stdout)
        _report("prestop_drain_s", round(drain_s, 1))
        _report("stop_after_prestop_s", round(took, 1))
        assert code == 0 and took < STOP_TIMEOUT_S, (code, took, box.logs())


def test_compose_runs_triton_and_the_gateway_apart(docker, image, tmp_path):
    """deploy/compose.yaml: the OpenAI SDK through the gateway container (an image and an audio clip);
    Triton's container stopped: the gateway answers 503 (health and chat); started again: it serves;
    ``down`` leaves no container and no network of the project."""
    import base64

    import openai

    from mmserve_dev.samples import encode_audio, sample_audio
    from mmserve_dev.triton import free_ports

    (port,) = free_ports(1)
    project = docker.session  # what the reaper removes if this process is killed
    env = {
        **docker.env,
        settings.COMPOSE_IMAGE.name: image,
        settings.COMPOSE_BIND.name: "127.0.0.1",
        settings.COMPOSE_OPENAI_PORT.name: str(port),
        settings.COMPOSE_TRITON_CPUS.name: CPUS,
    }
    compose = ["docker-compose", "-p", project, "-f", str(ROOT / "deploy" / "compose.yaml")]

    def call(*args: str, timeout: float = 180) -> str:
        done = subprocess.run([*compose, *args], env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return done.stdout

    def health() -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as reply:
                return reply.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    def wait_for(status: int, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while health() != status:
            assert time.monotonic() < deadline, call("logs", "--tail", "60")
            time.sleep(1)

    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=180)
    content = [
        {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(encode_image(sample_image(7))).decode()},
        },
        {
            "type": "input_audio",
            "input_audio": {"data": base64.b64encode(encode_audio(sample_audio(1))).decode(), "format": "wav"},
        },
        {"type": "text", "text": "What do you see and hear?"},
    ]

    messages: Any = [{"role": "user", "content": content}]

    def ask() -> str:
        reply = sdk.chat.completions.create(model="mm_ensemble", messages=messages, max_tokens=8, temperature=0.0)
        return reply.choices[0].message.content or ""

    try:
        call("up", "-d")
        wait_for(200)
        first = ask()
        assert first
        call("stop", "triton", timeout=120)
        wait_for(503, timeout=60)
        with pytest.raises(openai.APIStatusError) as refused:
            ask()
        assert refused.value.status_code == 503
        call("start", "triton")
        wait_for(200)
        assert ask() == first
    finally:
        subprocess.run([*compose, "down", "-v", "--remove-orphans"], env=env, capture_output=True, timeout=180)
    left = run(docker, "ps", "-a", "--filter", f"label=com.docker.compose.project={project}", "-q").stdout.strip()
    networks = run(
        docker, "network", "ls", "--filter", f"label=com.docker.compose.project={project}", "-q"
    ).stdout.strip()
    assert not left and not networks, (left, networks)

"""Engine faults on the live server, made for real: the engine core process SIGKILLed (death) and
SIGSTOPped (a wedge), then a clean stop after all of it (finding 3 of issue 6, and its clean-stop
requirement). These break the session's server, so they run after every other test (``fault``).

What is asserted, each time: requests in flight get UNAVAILABLE; within seconds mm_llm,
mm_ensemble and the server report not ready; the model reloads itself with a new engine; readiness
returns and answers equal their references again. The timings are printed (``-s``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
import urllib.request

import numpy as np
import pytest

from mmserve_dev.streams import HeldStream

import utils
from utils import ROOT, http_status, sampling, wait_for

pytestmark = [pytest.mark.server, pytest.mark.fault]

READY_PATHS = ("/v2/health/ready", "/v2/models/mm_llm/ready", "/v2/models/mm_ensemble/ready")
DETECT_S = 5.0
"""A dead engine must make the service not ready within this many seconds."""
HEAL_S = 300.0
"""...and the new engine must serve within this many (engine start on 2 loaded cores)."""


@pytest.fixture
def own_server(server):
    if server.server is None or server.http is None:
        pytest.skip("needs the server the suite starts (it kills its engine)")
    return server


def _readiness(server) -> tuple[int, ...]:
    return tuple(http_status(server, path) for path in READY_PATHS)


def _stacks(server) -> str:
    """The server's processes' stacks (written to its log by ``dump_stacks``) and the log's tail."""
    signalled = server.server.dump_stacks()
    time.sleep(2)  # the stubs write theirs from a signal handler
    return f"stacks of {signalled} and the server's log:\n{server.server.log_tail(300)}"


def _fault_and_heal(server, references, fault: signal.Signals, detect_within: float) -> dict[str, float]:
    from mmserve.client import ClientError

    [core] = utils.engine_core_pids(server)
    in_flight = utils.start_held(
        server,
        "mm_ensemble",
        {f"{fault.name}-{k}": utils.long_generation(stream) for k, stream in enumerate((True, True, False))},
    )
    started = time.monotonic()
    os.kill(core, fault)
    try:
        assert wait_for(lambda: all(code != 200 for code in _readiness(server)), detect_within, 0.05), (
            f"still ready {detect_within} s after {fault.name}: {_readiness(server)}"
        )
        detected = time.monotonic() - started
        assert all(request.wait(30) for request in in_flight), "a request in flight was never answered"
        _assert_one_final_each(in_flight, "UNAVAILABLE")
        with pytest.raises(ClientError) as refused:
            utils.client(server).generate("Hi", **sampling(2))
        assert refused.value.code == "UNAVAILABLE", refused.value
        if not wait_for(lambda: _readiness(server) == (200, 200, 200), HEAL_S, 0.5):
            pytest.fail(
                f"not healed {HEAL_S:g} s after {fault.name}: readiness {_readiness(server)}; {_stacks(server)}"
            )
        healed = time.monotonic() - started
    finally:
        if fault == signal.SIGSTOP:  # if the watcher missed it, let the process go on (or die)
            with contextlib.suppress(ProcessLookupError):
                os.kill(core, signal.SIGCONT)
    assert core not in utils.engine_core_pids(server), "the failed engine core is still there"
    for entry in utils.ENTRIES:
        for name in ("image_audio#0", "text_only#1"):
            case = references[name]
            assert (
                utils.client(server, entry=entry).generate(case.text, case.images, case.audios, **sampling()).output_ids
                == case.ids
            )
    timings = {"not_ready_after_s": round(detected, 2), "serving_again_after_s": round(healed, 1)}
    print(f"\n{fault.name} of the engine core: {timings}")
    return timings


def _assert_one_final_each(requests: list[utils.Tracked], code: str) -> None:
    """Each request got exactly one final response, an error of class ``code``."""
    from mmserve.wire import code_of

    outcomes = [(r.request_id, r.finals, [code_of(e) for e in r.errors]) for r in requests]
    assert all(finals == 1 and codes == [code] for _, finals, codes in outcomes), outcomes


def test_engine_killed_detect_unavailable_heal(own_server, references):
    _fault_and_heal(own_server, references, signal.SIGKILL, DETECT_S)


def test_engine_wedged_detect_unavailable_heal(own_server, references):
    """A stopped engine core answers nothing: the watcher sees no progress for the stall timeout."""
    config = (ROOT / "model_repository" / "mm_llm" / "config.pbtxt").read_text()
    found = re.search(r'key: "engine_stall_timeout_s", value: \{ string_value: "([\d.]+)"', config)
    assert found is not None, "mm_llm's config.pbtxt sets no engine_stall_timeout_s"
    stall = float(found.group(1))
    _fault_and_heal(own_server, references, signal.SIGSTOP, stall + 2 * DETECT_S)


def _held_streams(server) -> list[HeldStream]:
    """Two clients that keep a gRPC stream open (``mmserve.triton_seam`` HELD_STREAMS): one whose only
    request Triton itself refused (FP16 pixel_values where mm_llm takes FP32: it never reached the
    model, yet its stream holds mm_llm), one whose request mm_ensemble served (it holds mm_ensemble)."""
    refused = HeldStream(
        server.grpc,
        "mm_llm",
        {"input_ids": np.arange(4, dtype=np.int64), "pixel_values": np.zeros((1, 1176), np.float16)},
        f"held-refused-{time.monotonic_ns()}",
    )
    served = HeldStream(
        server.grpc,
        "mm_ensemble",
        {"text_input": np.array([b"Hi"], object), "sampling_parameters": np.array([b'{"max_tokens": 2}'], object)},
        f"held-served-{time.monotonic_ns()}",
    )
    assert wait_for(lambda: bool(refused.answers and served.answers), 60), (refused.answers, served.answers)
    assert "FP16" in (refused.answers[0] or ""), refused.answers
    return [refused, served]


def test_engine_killed_while_clients_hold_streams_heals(own_server, references):
    """The same death while clients hold streams open: mm_llm's unload never ends (a stream holds
    its first request's model until the stream ends, on every Triton release read), and the heal
    used to wait for it for good (184 s and counting, and a stop then exited 1). The keeper loads a
    new instance beside the one still unloading (``mmserve.serving.keeper``: PINNED_UNLOAD)."""
    held = _held_streams(own_server)
    try:
        timings = _fault_and_heal(own_server, references, signal.SIGKILL, DETECT_S)
        assert timings["serving_again_after_s"] < HEAL_S
    finally:
        for stream in held:
            stream.close()


def test_clean_stop_after_faults(own_server):
    """After a death, a wedge, a death while clients held streams open, bad requests and
    cancellations, with generations in flight: a stop within 15 s, exit code 0, each generation ended
    UNAVAILABLE by the drain with one final response, no process of the server's group and no
    /dev/shm file of its processes left. (A stop with streams held open through it:
    test_triton_server.py, and bench/stops.py's ``attacked`` state.)"""
    import psutil

    triton = own_server.server
    group = [
        p.pid for p in psutil.Process(triton.pid).children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE
    ] + [triton.pid]
    from mmserve_dev.triton import shm_files_mapped

    shm = shm_files_mapped(group) | set(triton.shm_files())
    assert shm, "the server maps no shared memory? (the check below would be empty)"
    # Generations in flight at the stop: the drain ends them UNAVAILABLE after its grace period
    # (they would run for minutes), each with exactly one final response, and the unload follows.
    in_flight = utils.start_held(
        own_server,
        "mm_ensemble",
        {f"stop-{k}": utils.long_generation(stream, 4000) for k, stream in enumerate((True, True, False))},
    )
    started = time.monotonic()
    code = triton.stop()
    took = time.monotonic() - started
    print(
        f"\nstop after the faults, {len(in_flight)} generations in flight: {took:.1f} s, exit code {code}, "
        f"{triton.stop_timeline}"
    )
    assert all(request.wait(5) for request in in_flight)
    _assert_one_final_each(in_flight, "UNAVAILABLE")
    assert all("stopping" in request.errors[0] for request in in_flight), [r.errors for r in in_flight]
    assert took < 15, (
        f"the stop took {took:.1f} s (exit code {code}): {triton.stop_timeline}; the server's log:\n"
        + triton.log_tail(150)
    )
    assert not [pid for pid in group if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not [path for path in shm if path.exists()]
    assert code == 0, (
        f"exit code {code} after {took:.1f} s: {triton.stop_timeline}; the server's log:\n" + triton.log_tail(150)
    )


@pytest.mark.parametrize("victim", ["tritonserver", "mm_llm stub"])
def test_engine_dies_with_a_killed_server(tiny_models, victim):
    """tritonserver SIGKILLed (a crash, the OOM killer): mm_llm's stub exits (``exit_with_server``),
    and vLLM's engine core and workers go with it instead of staying behind with the model's memory
    (measured before: the stub still running 40 s later, its engine with it). The stub SIGKILLed
    alone: the engine core dies with it (``die_with_triton_stub``), its workers after it. Runs after
    the clean stop above (its own server: never two engines at once)."""
    import psutil

    from mmserve import settings
    from mmserve_dev.triton import TritonServer

    env = {settings.MODEL.name: str(tiny_models["qwen2_5_omni"]), "VLLM_CPU_KVCACHE_SPACE": "1"}
    with TritonServer(
        ROOT / "model_repository", env=env, load_models=("mm_llm",), shm_default_byte_size=32 * 1024 * 1024
    ) as triton:
        engine, stub = [], None
        for process in psutil.Process(triton.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                command = process.cmdline()
                if command[:1] and command[0].startswith("VLLM::"):
                    engine.append(process)
                elif any("mm_llm/1/model.py" in part for part in command):
                    stub = process
        assert stub is not None and any(p.cmdline()[0] == "VLLM::EngineCore" for p in engine), [
            p.cmdline()[:1] for p in engine
        ]
        assert triton.pid is not None
        os.kill(triton.pid if victim == "tritonserver" else stub.pid, signal.SIGKILL)
        started = time.monotonic()
        # the stub too, when tritonserver died (killed itself, it stays a zombie of the server's)
        _, alive = psutil.wait_procs([*engine, stub] if victim == "tritonserver" else engine, timeout=30)
        print(f"\nthe engine's processes gone {time.monotonic() - started:.1f} s after the {victim}'s SIGKILL")
        assert not [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE], (
            f"orphaned: {[(p.pid, p.cmdline()[:1]) for p in alive]}"
        )


@pytest.mark.parametrize("stop", ["SIGINT", "SIGKILL"])
def test_serve_sh_started_in_the_background_stops_or_dies_whole(tiny_models, stop):
    """``scripts/serve.sh`` started in the background by a script (so SIGINT starts ignored, as in CI
    jobs and supervisors), after it served requests (gRPC and OpenAI): SIGINT stops everything with
    exit code 0 within 15 s; SIGKILL of it leaves no process it started after 15 s, its ports free
    and no /dev/shm file of the server. Killed after traffic, the stub used to stay with its engine
    for good: a thread of it (a metric update) waited in a call into the dead server holding the
    GIL, so nothing of the stub could run its cleanup; its engine core now ends it
    (``die_with_triton_stub``). Its own server each (runs after the others: never two engines at once)."""
    import socket
    import subprocess

    import psutil

    from mmserve_dev.triton import free_ports

    http, grpc, metrics, openai = free_ports(4)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "MMSERVE_MODEL": str(tiny_models["qwen2_5_omni"])}
    command = (
        f"bash scripts/serve.sh --http-port {http} --grpc-port {grpc} --metrics-port {metrics} "
        f"--openai-port {openai} & pid=$!; echo $pid; wait $pid"
    )
    shell = subprocess.Popen(
        ["bash", "-c", command],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert shell.stdout is not None
    try:
        launcher = psutil.Process(int(shell.stdout.readline()))
        lines: list[str] = []
        while not any("Ctrl-C to stop" in line for line in lines):
            line = shell.stdout.readline()
            assert line, "serve.sh ended before it was ready:\n" + "".join(lines)
            lines.append(line)
        assert int(open(f"/proc/{launcher.pid}/status").read().split("SigIgn:")[1].split()[0], 16) & 0x2 == 0, (
            "SIGINT is still ignored"
        )
        served = utils.client(utils.Endpoints(f"127.0.0.1:{grpc}", None, None)).generate("Hi", **sampling(4))
        assert len(served.output_ids) == 4
        body = {"model": "mm_ensemble", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        with urllib.request.urlopen(
            urllib.request.Request(
                f"http://127.0.0.1:{openai}/v1/chat/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            ),
            timeout=60,
        ) as reply:
            assert reply.status == 200
        time.sleep(2)  # the metrics' periodic updates run between requests too
        tree = [launcher, *launcher.children(recursive=True)]
        shm = {path for path in utils.shm_leftovers() if path.startswith(f"mmserve_{launcher.pid}_")}
        assert shm and any(p.name() == "tritonserver" for p in tree), [p.name() for p in tree]
        started = time.monotonic()
        os.kill(launcher.pid, getattr(signal, stop))
        if stop == "SIGINT":
            assert shell.wait(20) == 0, "".join(lines) + shell.stdout.read()  # the shell ends with serve.sh's code
            took = time.monotonic() - started
            assert took < 15, took
        _, alive = psutil.wait_procs(tree, timeout=15 if stop == "SIGKILL" else 1)
        took = time.monotonic() - started
        print(f"\nserve.sh {stop}: everything gone after {took:.1f} s")
        assert not [(p.pid, p.name()) for p in alive if p.status() != psutil.STATUS_ZOMBIE]
        for port in (http, grpc, metrics, openai):
            with socket.socket() as probe:
                assert probe.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still in use"
        assert wait_for(lambda: not (shm & utils.shm_leftovers()), 3), shm & utils.shm_leftovers()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
        shell.wait(10)

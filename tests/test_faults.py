"""Engine faults on the live server, made for real: the engine core process SIGKILLed (death) and
SIGSTOPped (a wedge), then a clean stop after all of it (finding 3 of issue 6, and its clean-stop
requirement). These break the session's server, so they run after every other test (``fault``).

What is asserted, each time: requests in flight get UNAVAILABLE; within seconds mm_llm,
mm_ensemble and the server report not ready; the model reloads itself with a new engine; readiness
returns and answers equal their references again. The timings are printed (``-s``).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time

import pytest

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


def _fault_and_heal(server, references, fault: signal.Signals, detect_within: float) -> dict[str, float]:
    from mmserve.client import ClientError

    [core] = utils.engine_core_pids(server)
    in_flight: list[ClientError] = []

    def long_request() -> None:
        try:
            utils.client(server).generate("Count.", max_tokens=1500, ignore_eos=True)
        except ClientError as exc:
            in_flight.append(exc)

    thread = threading.Thread(target=long_request)
    thread.start()
    assert wait_for(lambda: utils.metric(server, "vllm:num_requests_running") >= 1, 60)
    started = time.monotonic()
    os.kill(core, fault)
    try:
        assert wait_for(lambda: all(code != 200 for code in _readiness(server)), detect_within, 0.05), \
            f"still ready {detect_within} s after {fault.name}: {_readiness(server)}"
        detected = time.monotonic() - started
        thread.join(30)
        assert not thread.is_alive(), "the request in flight was never answered"
        assert [e.code for e in in_flight] == ["UNAVAILABLE"], in_flight
        with pytest.raises(ClientError) as refused:
            utils.client(server).generate("Hi", **sampling(2))
        assert refused.value.code == "UNAVAILABLE", refused.value
        assert wait_for(lambda: _readiness(server) == (200, 200, 200), HEAL_S, 0.5), _readiness(server)
        healed = time.monotonic() - started
    finally:
        if fault == signal.SIGSTOP:  # if the watcher missed it, let the process go on (or die)
            with contextlib.suppress(ProcessLookupError):
                os.kill(core, signal.SIGCONT)
    assert core not in utils.engine_core_pids(server), "the failed engine core is still there"
    for entry in utils.ENTRIES:
        for name in ("image_audio#0", "text_only#1"):
            case = references[name]
            assert utils.client(server, entry=entry).generate(case.text, case.images, case.audios,
                                                               **sampling()).output_ids == case.ids
    timings = {"not_ready_after_s": round(detected, 2), "serving_again_after_s": round(healed, 1)}
    print(f"\n{fault.name} of the engine core: {timings}")
    return timings


def test_engine_killed_detect_unavailable_heal(own_server, references):
    _fault_and_heal(own_server, references, signal.SIGKILL, DETECT_S)


def test_engine_wedged_detect_unavailable_heal(own_server, references):
    """A stopped engine core answers nothing: the watcher sees no progress for the stall timeout."""
    config = (ROOT / "model_repository" / "mm_llm" / "config.pbtxt").read_text()
    stall = float(re.search(r'key: "engine_stall_timeout_s", value: \{ string_value: "([\d.]+)"', config).group(1))
    _fault_and_heal(own_server, references, signal.SIGSTOP, stall + 2 * DETECT_S)


def test_clean_stop_after_faults(own_server):
    """After a death, a wedge, bad requests and cancellations: a stop within 15 s, exit code 0, no
    process of the server's group and no /dev/shm file of its processes left."""
    import psutil

    triton = own_server.server
    group = [p.pid for p in psutil.Process(triton.pid).children(recursive=True)
             if p.status() != psutil.STATUS_ZOMBIE] + [triton.pid]
    from mmserve_dev.triton import shm_files_mapped

    shm = shm_files_mapped(group) | set(triton.shm_files())
    assert shm, "the server maps no shared memory? (the check below would be empty)"
    started = time.monotonic()
    code = triton.stop()
    took = time.monotonic() - started
    print(f"\nstop after the faults: {took:.1f} s, exit code {code}")
    assert took < 15, (code, took, triton.log_tail())
    assert not [pid for pid in group if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not [path for path in shm if path.exists()]
    assert code == 0, (code, took, triton.log_tail())


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
    with TritonServer(ROOT / "model_repository", env=env, load_models=("mm_llm",),
                      shm_default_byte_size=32 * 1024 * 1024) as triton:
        engine, stub = [], None
        for process in psutil.Process(triton.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                command = process.cmdline()
                if command[:1] and command[0].startswith("VLLM::"):
                    engine.append(process)
                elif any("mm_llm/1/model.py" in part for part in command):
                    stub = process
        assert stub is not None and any(p.cmdline()[0] == "VLLM::EngineCore" for p in engine), \
            [p.cmdline()[:1] for p in engine]
        os.kill(triton.pid if victim == "tritonserver" else stub.pid, signal.SIGKILL)
        started = time.monotonic()
        # the stub too, when tritonserver died (killed itself, it stays a zombie of the server's)
        _, alive = psutil.wait_procs([*engine, stub] if victim == "tritonserver" else engine, timeout=30)
        print(f"\nthe engine's processes gone {time.monotonic() - started:.1f} s after the {victim}'s SIGKILL")
        assert not [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE], \
            f"orphaned: {[(p.pid, p.cmdline()[:1]) for p in alive]}"

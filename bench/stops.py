"""Stops: ``scripts/serve.sh`` started and stopped (SIGTERM) in each state, with the machine busy
while it stops; per stop: seconds, the launcher's exit code, processes and /dev/shm files left.

States (each its own server start, ``--rounds`` times):

* ``idle``: nothing ran;
* ``in-flight``: 4 long generations in flight at the stop (2 gRPC streams, 1 HTTP ``generate``, 1
  OpenAI stream through the gateway), each must end with one final answer;
* ``bad-and-cancelled``: bad inputs of every kind and cancelled streams, then the stop;
* ``healed``: the engine core SIGKILLed, the model healed (serving again), then the stop;
* ``gateway``: 30 OpenAI chat requests through the gateway (some streamed), then the stop;
* ``attacked``: a hostile client's traffic (docs/SECURITY.md) -- drains without the operator's key,
  the repository, shared-memory and logging APIs without it, cancels of another client's stream
  and of an id not in use yet, a grid that overflows int64, streams cancelled mid-generation, two
  gRPC streams held open (one whose request Triton itself refused), the engine core SIGKILLed and
  healed with those streams open -- then the stop, the served request's stream still held open
  through it (the refused one half-closed before: cut, 2.51 holds its model for good).

Busy machine: from just before the signal until the stop ends, a CPU hog on every core and a
second vLLM engine starting (``--no-busy``: neither). A stop passes when the launcher exits 0 within
``--limit-s`` (15) seconds and leaves no process it started and no /dev/shm file of its server.

    .venv/bin/python bench/stops.py                       # 5 rounds of every state (about 30 min)
    .venv/bin/python bench/stops.py --rounds 1 --states idle in-flight

Writes ``stops.json`` (every stop) under ``--out`` (default: a new /tmp folder) and prints a table;
exit status 1 if any stop failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import psutil
from common import stop_process_group

from mmserve_dev.streams import HeldStream

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

ROOT = Path(__file__).resolve().parents[1]
STATES = ("idle", "in-flight", "bad-and-cancelled", "healed", "gateway", "attacked")
START_TIMEOUT_S = 600.0
HEAL_TIMEOUT_S = 300.0


@dataclass
class Stop:
    state: str
    round: int
    seconds: float
    exit_code: int | None
    processes_left: list[str]
    shm_left: list[str]
    answers: list[str] = field(default_factory=list)  # in-flight: how each request ended
    phases: str = ""  # the launcher's own account: "stopped in ... (drain, gateway, tritonserver)"

    @property
    def passed(self) -> bool:
        # A stream cut without its final answer (a connection refused before any answer is a request
        # that came too late: a client retries it elsewhere).
        cut = [a for a in self.answers if a.startswith("unanswered") or ("Connection" in a and "after 0 " not in a)]
        return self.exit_code == 0 and not self.processes_left and not self.shm_left and not cut


class Served:
    """``scripts/serve.sh`` on free ports, in a session of its own (as a supervisor starts it)."""

    def __init__(self, model: str) -> None:
        from mmserve_dev.triton import free_ports

        self.http, self.grpc, self.metrics, self.openai = free_ports(4)
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "MMSERVE_MODEL": model,
        }
        self.log = tempfile.NamedTemporaryFile("w+", prefix="mmserve-stops-", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            [
                "bash",
                "scripts/serve.sh",
                "--http-port",
                str(self.http),
                "--grpc-port",
                str(self.grpc),
                "--metrics-port",
                str(self.metrics),
                "--openai-port",
                str(self.openai),
            ],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while "Ctrl-C to stop" not in Path(self.log.name).read_text(errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("serve.sh did not start:\n" + Path(self.log.name).read_text()[-3000:])
            time.sleep(0.5)

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    def tree(self) -> list[psutil.Process]:
        launcher = psutil.Process(self.process.pid)
        return [launcher, *launcher.children(recursive=True)]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)


# -- states -------------------------------------------------------------------------------------------
def _text_request(text: str, stream: bool, max_tokens: int) -> dict[str, np.ndarray]:
    params = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    return {
        "text_input": np.array([text.encode()], dtype=object),
        "stream": np.array([stream]),
        "sampling_parameters": np.array([json.dumps(params).encode()], dtype=object),
    }


def _running(served: Served) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{served.metrics}/metrics", timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running") and 'model="mm_llm"' in line
    )


def start_in_flight(served: Served) -> Callable[[], list[str]]:
    """4 long generations; returns a function that waits for their ends and says how each ended."""
    import requests
    import tritonclient.grpc  # noqa: F401 - imported here, not by 2 threads at once on a busy machine
    from openai import OpenAI

    from mmserve.client import ClientError, MMClient

    outcomes: list[str] = []

    def grpc_stream(k: int) -> None:
        tokens = 0
        try:
            with MMClient(served.grpc_url, timeout=120).start("Count.", max_tokens=4000, ignore_eos=True) as stream:
                for delta in stream:
                    tokens += len(delta.output_ids)
            outcomes.append(f"grpc-{k}: completed ({tokens} tokens)")
        except ClientError as exc:
            outcomes.append(f"grpc-{k}: {exc.code} after {tokens} tokens")

    def http_generate() -> None:
        body = {"text_input": "Count.", "sampling_parameters": json.dumps({"max_tokens": 4000, "ignore_eos": True})}
        try:
            reply = requests.post(
                f"http://127.0.0.1:{served.http}/v2/models/mm_ensemble/generate", json=body, timeout=120
            )
            answer = reply.json()
            outcomes.append(
                f"http: {reply.status_code} "
                + (f"({len(answer['output_ids'])} tokens)" if reply.ok else str(answer.get("error", ""))[:80])
            )
        except requests.RequestException as exc:
            outcomes.append(f"http: {type(exc).__name__}")

    sdk = OpenAI(base_url=f"http://127.0.0.1:{served.openai}/v1", api_key="unused", max_retries=0)

    def openai_stream() -> None:
        chunks = 0
        try:
            for _ in sdk.chat.completions.create(
                model="mm_ensemble",
                messages=[{"role": "user", "content": "Count."}],
                stream=True,
                max_tokens=4000,
                extra_body={"ignore_eos": True},
            ):
                chunks += 1
            outcomes.append(f"openai: completed ({chunks} chunks)")
        except Exception as exc:  # noqa: BLE001 - how it ended is the result
            outcomes.append(f"openai: {type(exc).__name__} after {chunks} chunks: {str(exc)[:60]}")

    threads = [threading.Thread(target=grpc_stream, args=(k,)) for k in range(2)]
    threads += [threading.Thread(target=http_generate), threading.Thread(target=openai_stream)]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    while time.monotonic() < started + 60:  # generating: all of them, or some after 10 s
        running = _running(served)
        if running >= len(threads) or (running and time.monotonic() > started + 10):
            break
        time.sleep(0.2)

    def ended() -> list[str]:
        for thread in threads:
            thread.join(30)
        return sorted(outcomes) + [f"unanswered: {sum(t.is_alive() for t in threads)}"] * any(
            t.is_alive() for t in threads
        )

    return ended


def bad_and_cancelled(served: Served) -> None:
    from mmserve.client import ClientError, MMClient

    client = MMClient(served.grpc_url, timeout=60)
    bad = [
        {"image": np.array([b"not an image"], dtype=object)},
        {"sampling_parameters": np.array([b'{"max_tokens": 16.5}'], dtype=object)},
        {"audio": np.array([b"RIFF...."], dtype=object)},
        {"sampling_parameters": np.array([b"not json"], dtype=object)},
    ]
    for k in range(5):
        for change in bad:
            tensors = {**_text_request(f"Hi {k}", False, 4), **change}
            with contextlib.suppress(ClientError), client.start_tensors(tensors) as generation:
                list(generation)
    for k in range(10):
        with client.start(f"Count {k}.", max_tokens=2000, ignore_eos=True) as generation:
            for n, _ in enumerate(generation):
                if n >= 3:
                    generation.cancel()


def healed(served: Served) -> None:
    import urllib.request

    cores = [p for p in served.tree() if p.name().startswith("VLLM::EngineCore")]
    for core in cores:
        core.kill()
    deadline = time.monotonic() + HEAL_TIMEOUT_S
    time.sleep(2)
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{served.http}/v2/health/ready", timeout=2) as reply:
                if reply.status == 200:
                    return
        time.sleep(0.5)
    raise RuntimeError("the model did not heal")


def gateway_traffic(served: Served) -> None:
    from openai import OpenAI

    sdk = OpenAI(base_url=f"http://127.0.0.1:{served.openai}/v1", api_key="unused", max_retries=0)
    for k in range(30):
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": f"Hello {k}"}]
        if k % 3:
            sdk.chat.completions.create(model="mm_ensemble", messages=messages, max_tokens=16)
        else:
            list(sdk.chat.completions.create(model="mm_ensemble", messages=messages, max_tokens=16, stream=True))


def attacked(served: Served) -> list[HeldStream]:
    """A hostile client's traffic (see the module's docstring); returns the streams it holds open."""
    import urllib.error
    import urllib.request

    import tritonclient.grpc as grpcclient

    from mmserve.client import ClientError, MMClient, cancel_on_engine, grpc_inputs, new_cancel_key
    from mmserve.drain import drain

    client = MMClient(served.grpc_url, timeout=60)
    for key in ("", "not-the-operator-key-0123456789"):
        drain(served.grpc_url, 0.0, answer_margin_s=5.0, operator_key=key)
    region = next(name for name in os.listdir("/dev/shm") if name.startswith(f"mmserve_{served.process.pid}_"))
    for method, path, body in (
        ("POST", "/v2/repository/models/mm_llm/unload", b"{}"),
        (
            "POST",
            f"/v2/systemsharedmemory/region/{region}/register",
            json.dumps({"key": f"/{region}", "offset": 0, "byte_size": 64}).encode(),
        ),
        ("POST", "/v2/logging", b'{"log_verbose_level": 3}'),
    ):
        request = urllib.request.Request(f"http://127.0.0.1:{served.http}{path}", body, method=method)
        with contextlib.suppress(urllib.error.HTTPError):
            urllib.request.urlopen(request, timeout=10).close()
    with client.start("Count.", max_tokens=300, ignore_eos=True) as victim:  # another's cancels reach nothing
        next(iter(victim))
        cancel_on_engine(served.grpc_url, victim.request_id, new_cancel_key())
        assert sum(len(r.output_ids) for r in victim) >= 290, "the victim was cancelled"
    cancel_on_engine(served.grpc_url, "1", new_cancel_key())
    grid: dict[str, np.ndarray] = {
        "input_ids": np.arange(8, dtype=np.int64),
        "image_embeds": np.zeros((2, 128), np.float32),
        "image_grid_thw": np.array([[1, 4611686018427387906, 24]], np.int64),
    }
    with contextlib.suppress(ClientError), client.start_tensors(grid, model="mm_llm") as refused:
        list(refused)
    for k in range(5):  # streams cancelled mid-generation, the way a client that goes away does
        raw = grpcclient.InferenceServerClient(served.grpc_url)
        raw.start_stream(callback=lambda result, error: None)
        raw.async_stream_infer("mm_ensemble", grpc_inputs(_text_request(f"Count {k}.", True, 2000)))
        time.sleep(0.3)
        raw.stop_stream(cancel_requests=True)
        raw.close()
    held = [
        HeldStream(
            served.grpc_url,
            "mm_llm",
            {"input_ids": np.arange(4, dtype=np.int64), "pixel_values": np.zeros((1, 1176), np.float16)},
            "held-refused",
        ),
        HeldStream(served.grpc_url, "mm_ensemble", _text_request("Hi", False, 2), "held-served"),
    ]
    healed(served)
    # The refused request's stream is half-closed before the stop: cut, on 2.51 it would hold mm_llm
    # for good (tests/test_triton_server.py, refused-held; docs/SECURITY.md). The served one stays open.
    held.pop(0).close()
    return held


# -- a busy machine --------------------------------------------------------------------------------------
class Busy:
    """A CPU hog per core and a second vLLM engine starting, until ``stop``."""

    def __init__(self, model: str) -> None:
        from mmserve_dev.triton.process import die_with_this_process  # they go if this benchmark is killed

        hog = die_with_this_process([sys.executable, "-c", "while True: pass"])
        self.processes = [subprocess.Popen(hog, start_new_session=True) for _ in range(os.cpu_count() or 1)]
        engine = (
            f"from vllm import LLM\nif __name__ == '__main__':\n    LLM(model={model!r}, max_model_len=512, "
            "enforce_eager=True, dtype='float32')\n"
        )
        env = {**os.environ, "VLLM_PLUGINS": "", "VLLM_CPU_KVCACHE_SPACE": "1"}
        self.processes.append(
            subprocess.Popen(
                die_with_this_process([sys.executable, "-c", engine]),
                env=env,
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )

    def stop(self) -> None:
        for process in self.processes:
            stop_process_group(process.pid, grace_s=5.0)
            process.wait()


# -- one stop --------------------------------------------------------------------------------------------
def stop_in(state: str, round_: int, model: str, busy: bool, limit_s: float) -> Stop:
    served = Served(model)
    answers: Callable[[], list[str]] | None = None
    keep_log = False
    held: list[HeldStream] = []
    try:
        if state == "attacked":
            held = attacked(served)
        elif state == "bad-and-cancelled":
            bad_and_cancelled(served)
        elif state == "healed":
            healed(served)
        elif state == "gateway":
            gateway_traffic(served)
        tree = served.tree()
        prefix = f"mmserve_{served.process.pid}_"
        shm = {name for name in os.listdir("/dev/shm") if name.startswith(prefix)}
        for process in tree:
            with contextlib.suppress(psutil.Error, OSError), open(f"/proc/{process.pid}/maps") as maps:
                shm |= {line.split()[-1].removeprefix("/dev/shm/") for line in maps if " /dev/shm/" in line}
        if state == "in-flight":  # last: they are to be generating at the signal
            answers = start_in_flight(served)
        hogs = Busy(model) if busy else None
        try:
            started = time.monotonic()
            served.process.send_signal(signal.SIGTERM)
            try:
                code: int | None = served.process.wait(limit_s + 15)
            except subprocess.TimeoutExpired:
                code = None
            seconds = time.monotonic() - started
        finally:
            if hogs is not None:
                hogs.stop()
        _, alive = psutil.wait_procs(tree, timeout=2)
        left = [f"{p.pid} {p.name()}" for p in alive if p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.5)
        shm_left = sorted(name for name in shm if os.path.exists(f"/dev/shm/{name}"))
        result = Stop(
            state,
            round_,
            round(seconds, 1),
            code if seconds <= limit_s else None,
            left,
            shm_left,
            answers() if answers else [],
        )
        if seconds > limit_s:
            result.answers.append(f"over the {limit_s:g}-s limit (exit code {code})")
        result.phases = next(
            (
                line.strip()
                for line in Path(served.log.name).read_text(errors="replace").splitlines()
                if line.startswith("stopped in")
            ),
            "",
        )
        if not result.passed:  # the launcher's log (its phases' times; the server log's path) stays
            keep_log = True
            result.answers.append(f"log: {served.log.name}")
        return result
    finally:
        for stream in held:
            stream.close()
        served.kill()
        if not keep_log:
            with contextlib.suppress(OSError):
                os.unlink(served.log.name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--states", nargs="+", choices=STATES, default=list(STATES))
    parser.add_argument("--no-busy", dest="busy", action="store_false", help="no CPU hogs, no second engine")
    parser.add_argument("--limit-s", type=float, default=15.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from mmserve_dev.tiny_models import build_all

    model = str(build_all(ROOT / "models")["qwen2_5_omni"])
    out = args.out or Path(tempfile.mkdtemp(prefix="mmserve-stops-"))
    out.mkdir(parents=True, exist_ok=True)
    stops: list[Stop] = []
    for round_ in range(args.rounds):
        for state in args.states:
            stop = stop_in(state, round_, model, args.busy, args.limit_s)
            stops.append(stop)
            print(
                f"round {round_} {state:<18} {stop.seconds:5.1f} s  exit {stop.exit_code}  "
                f"left: {len(stop.processes_left)} processes, {len(stop.shm_left)} shm  "
                f"{'ok' if stop.passed else 'FAILED'}  {'; '.join(stop.answers)}  [{stop.phases}]",
                flush=True,
            )
    (out / "stops.json").write_text(json.dumps([asdict(s) for s in stops], indent=1) + "\n")
    print("\n| state | stops | passed | seconds (max) |\n|---|---:|---:|---:|")
    for state in args.states:
        mine = [s for s in stops if s.state == state]
        print(f"| {state} | {len(mine)} | {sum(s.passed for s in mine)} | {max(s.seconds for s in mine):.1f} |")
    print(f"\nwritten: {out / 'stops.json'}; busy machine: {args.busy}")
    return 0 if all(s.passed for s in stops) else 1


if __name__ == "__main__":
    sys.exit(main())

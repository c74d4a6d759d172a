"""Run tritonserver (CPU, Python backend) in the foreground on 127.0.0.1, and optionally the OpenAI
gateway beside it; SIGINT (Ctrl-C), SIGTERM or SIGHUP stops everything, however this was started.

    python -m mmserve_dev.triton --model-repository model_repository \
        [--http-port 8000 --grpc-port 8001 --metrics-port 8002] [--openai-port 9000] [--log-verbose 1]

A stop: ``mm_llm`` is drained (``mmserve.drain``: the generations in flight get ``--drain-grace-s``,
then end UNAVAILABLE), the gateway stops (uvicorn's graceful shutdown), then tritonserver (SIGINT,
``--exit-timeout-secs``), and what is left of its process group is killed, its shared memory
removed. If this process itself is killed (SIGKILL, the OOM killer), the kernel kills tritonserver
and the gateway with it (their parent-death signal), and the stubs follow their server
(``mmserve.serving.embedded.exit_with_server``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from mmserve import operator, settings
from mmserve.settings import OPENAI_API_KEY
from mmserve_dev.triton.install import TritonServerError
from mmserve_dev.triton.process import NEW_PROCESS_GROUP, TritonServer, die_with_this_process

GATEWAY_START_TIMEOUT_S = 60.0
GATEWAY_STOP_TIMEOUT_S = 3.0
"""How long the gateway may take to exit after the drain (its streams have ended): then it is killed."""


def start_gateway(
    server: TritonServer, host: str, port: int, api_key: str | None = None, extra_args: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    """``python -m mmserve.gateway`` against ``server``, dying with this process; returns once it serves.
    ``api_key``: the key it requires on /v1, passed in its environment (``$MMSERVE_OPENAI_API_KEY``),
    never on its command line, which other local users can read. ``extra_args``: more of its options."""
    cmd = die_with_this_process(
        [
            sys.executable,
            "-m",
            "mmserve.gateway",
            "--triton-url",
            server.grpc_url,
            "--host",
            host,
            "--port",
            str(port),
            "--log-level",
            "warning",
            *media_limits(server),
            *tokenizer(server),
            *extra_args,
        ]
    )
    env = None if api_key is None else {**os.environ, OPENAI_API_KEY.name: api_key}
    gateway = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, process_group=NEW_PROCESS_GROUP, env=env)
    deadline = time.monotonic() + GATEWAY_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if gateway.poll() is not None:
            raise TritonServerError(f"the OpenAI gateway exited with code {gateway.returncode} at start")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return gateway
        except urllib.error.HTTPError:  # it answers (401: it requires an API key)
            return gateway
        except OSError:
            time.sleep(0.3)
    stop_gateway(gateway)
    raise TritonServerError(f"the OpenAI gateway did not answer within {GATEWAY_START_TIMEOUT_S:.0f} s")


def media_limits(server: TritonServer) -> list[str]:
    """The gateway's ``--limit-mm-per-prompt``: the served engine's own (``limit_mm_per_prompt`` of
    ``mm_llm/model.json`` in the server's first repository), so that the gateway counts a request's
    media against what the server takes; none where there is no such file."""
    from mmserve.inputs import mm_limits

    engine = server.model_repositories[0] / "mm_llm" / "model.json"
    if not engine.is_file():
        return []
    limits = mm_limits(json.loads(engine.read_text()))
    return ["--limit-mm-per-prompt", json.dumps(limits)] if limits else []


def tokenizer(server: TritonServer) -> list[str]:
    """The gateway's ``--tokenizer``: the checkpoint ``server`` serves (the ``$MMSERVE_MODEL`` it was
    given, else ``model`` of ``mm_llm/model.json`` in its first repository, which this process's
    ``$MMSERVE_MODEL`` overrides as it does the server's), so that text-only requests skip
    ``preprocess`` (``mmserve.gateway.direct``); none where neither says."""
    from mmserve.inputs import read_engine_config

    model = getattr(server, "env_overrides", {}).get(settings.MODEL.name)
    engine = server.model_repositories[0] / "mm_llm" / "model.json"
    if not model and engine.is_file():
        model = read_engine_config(engine)["model"]
    return ["--tokenizer", str(model)] if model else ["--tokenizer", "none"]


def stop_gateway(gateway: subprocess.Popen[bytes] | None, *, signalled: bool = False) -> None:
    """SIGTERM ``gateway`` (unless ``signalled``: a second one makes uvicorn quit at once, cutting
    its streams) and wait for it to exit; past ``GATEWAY_STOP_TIMEOUT_S`` it is killed."""
    if gateway is None or gateway.poll() is not None:
        return
    if not signalled:
        gateway.terminate()
    try:
        gateway.wait(GATEWAY_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        gateway.kill()
        gateway.wait()


def operator_key_origin() -> str:
    """Where the operator's key of this start is (never the key itself: this goes to logs)."""
    apis = ", ".join(operator.RESTRICTED_APIS)
    where = (
        f"${settings.OPERATOR_KEY.name}"
        if settings.OPERATOR_KEY.get()
        else f"the file ${settings.OPERATOR_KEY_FILE.name} names"
        if settings.OPERATOR_KEY_FILE.get()
        else f"made for this start; set ${settings.OPERATOR_KEY.name} to choose it"
    )
    return f"key ({where}): Triton's {apis} APIs and mm_llm's drain need it (docs/SECURITY.md)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mmserve_dev.triton",
        description="Run tritonserver (CPU, Python backend) in the foreground (on 127.0.0.1 unless --host).",
    )
    parser.add_argument("--model-repository", required=True, action="append", help="may be repeated")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address the endpoints bind (0.0.0.0 in a container; default 127.0.0.1)"
    )
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument(
        "--openai-port",
        type=int,
        default=None,
        help="also run the OpenAI gateway (python -m mmserve.gateway) on this port",
    )
    parser.add_argument(
        "--openai-api-key",
        default=None,
        metavar="KEY",
        help=f"the gateway requires it on /v1 (passed in its environment; ${OPENAI_API_KEY.name} "
        "set for this process does the same, unseen on its command line)",
    )
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument(
        "--log-file",
        default=None,
        help="server log (default: a temporary file; '-': this process's stdout, as in a container)",
    )
    parser.add_argument("--shm-default-byte-size", type=int, default=None)
    parser.add_argument("--backend-config", action="append", default=[], help="BACKEND,KEY=VALUE; may be repeated")
    parser.add_argument(
        "--model-control-mode",
        default="explicit",
        choices=["none", "explicit", "poll"],
        help="explicit (default) lets mm_llm reload itself after an engine failure",
    )
    parser.add_argument("--load-model", action="append", default=None, help="explicit mode; default: all")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    parser.add_argument(
        "--keep-loaded",
        default="",
        metavar="MODEL,MODEL",
        help="load these back when the first unloads itself after a fault (mmserve.serving.keeper)",
    )
    parser.add_argument(
        "--drain",
        default="mm_llm",
        metavar="MODEL",
        help="the model drained first at a stop (mmserve.drain; '' for none; default %(default)s)",
    )
    parser.add_argument(
        "--drain-grace-s",
        type=float,
        default=2.0,
        help="how long generations in flight may still run at a stop (default %(default)s)",
    )
    parser.add_argument(
        "--exit-timeout-s",
        type=int,
        default=12,
        help="tritonserver's --exit-timeout-secs: the unload's budget after the drain",
    )
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
        host=args.host,
        drain=args.drain or None,
        drain_grace_s=args.drain_grace_s,
        exit_timeout_s=args.exit_timeout_s,
    )

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # SIGINT too: a program started in the background by a script starts with SIGINT ignored.
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        with contextlib.suppress(AttributeError):
            signal.signal(getattr(signal, name), on_signal)
    gateway = None
    code = 0
    try:
        print(f"starting tritonserver (log: {server.log_path or 'stdout'}) ...", flush=True)
        t0 = time.monotonic()
        server.start(timeout=args.start_timeout)
        print(f"ready in {time.monotonic() - t0:.1f} s", flush=True)
        print(f"HTTP     {server.http_url}", flush=True)
        print(f"gRPC     {server.grpc_url}", flush=True)
        print(f"metrics  {server.metrics_url}", flush=True)
        print(f"operator {operator_key_origin()}", flush=True)
        active = ", ".join(w.key for w in server.workarounds())
        print(f"Triton {server.version or '(release unknown)'}: workarounds active: {active}", flush=True)
        if args.openai_port is not None:
            gateway = start_gateway(server, args.host, args.openai_port, args.openai_api_key)
            print(f"OpenAI   http://127.0.0.1:{args.openai_port}/v1  (chat completions, models; /health)", flush=True)
        if args.hint:
            print(args.hint.format(http=server.http_url, grpc=server.grpc_url, openai=args.openai_port), flush=True)
        print("Ctrl-C to stop", flush=True)
        while server.is_running() and (gateway is None or gateway.poll() is None):
            time.sleep(0.5)
        if not server.is_running():
            assert server.process is not None  # started above
            print(f"tritonserver exited by itself (code {server.process.returncode}); log tail:", file=sys.stderr)
            print(server.log_tail(), file=sys.stderr)
        else:
            assert gateway is not None  # the loop ends on a dead server or a dead gateway
            print(f"the OpenAI gateway exited by itself (code {gateway.returncode}); stopping", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("stopping ...", flush=True)
    except TritonServerError as exc:
        print(exc, file=sys.stderr)
        code = 1
    finally:
        # Ignore further signals while tearing down, so cleanup can't be interrupted.
        for name in ("SIGINT", "SIGTERM", "SIGHUP"):
            with contextlib.suppress(AttributeError):
                signal.signal(getattr(signal, name), signal.SIG_IGN)
        started = time.monotonic()
        # The gateway stops taking requests and exits once its streams have ended, which the drain
        # does (their last event, "stopping", relayed by the gateway).
        if gateway is not None and gateway.poll() is None:
            gateway.terminate()
        server.drain_now()
        drained = time.monotonic()
        stop_gateway(gateway, signalled=True)
        gateway_stopped = time.monotonic()
        server_code = server.stop()
        if server_code is not None:
            print(
                f"stopped in {time.monotonic() - started:.1f} s (drain {drained - started:.1f} s, gateway "
                f"{gateway_stopped - drained:.1f} s, tritonserver {time.monotonic() - gateway_stopped:.1f} s; "
                f"tritonserver's exit code {server_code})",
                flush=True,
            )
            code = code or (0 if server_code == 0 else 1)
    return code


if __name__ == "__main__":
    sys.exit(main())

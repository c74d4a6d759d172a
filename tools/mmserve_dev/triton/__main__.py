"""Run tritonserver (CPU, Python backend) in the foreground on 127.0.0.1; Ctrl-C or SIGTERM stops it.

    python -m mmserve_dev.triton --model-repository model_repository \
        [--http-port 8000 --grpc-port 8001 --metrics-port 8002] [--log-verbose 1]
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from collections.abc import Sequence

from mmserve_dev.triton.install import TritonServerError
from mmserve_dev.triton.process import TritonServer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mmserve_dev.triton",
        description="Run tritonserver (CPU, Python backend) in the foreground (on 127.0.0.1 unless --host).",
    )
    parser.add_argument("--model-repository", required=True, action="append", help="may be repeated")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address the endpoints bind (0.0.0.0 in a container; default 127.0.0.1)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--log-file", default=None,
                        help="server log (default: a temporary file; '-': this process's stdout, as in a container)")
    parser.add_argument("--shm-default-byte-size", type=int, default=None)
    parser.add_argument("--backend-config", action="append", default=[], help="BACKEND,KEY=VALUE; may be repeated")
    parser.add_argument("--model-control-mode", default="explicit", choices=["none", "explicit", "poll"],
                        help="explicit (default) lets mm_llm reload itself after an engine failure")
    parser.add_argument("--load-model", action="append", default=None, help="explicit mode; default: all")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    parser.add_argument("--keep-loaded", default="", metavar="MODEL,MODEL",
                        help="load these back when the first unloads itself after a fault (mmserve.serving.keeper)")
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
    )

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    # Ctrl-C even when started in the background by a non-interactive shell (which ignores SIGINT).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.suppress(AttributeError):
        signal.signal(signal.SIGHUP, on_sigterm)
    try:
        print(f"starting tritonserver (log: {server.log_path or 'stdout'}) ...", flush=True)
        t0 = time.monotonic()
        server.start(timeout=args.start_timeout)
        print(f"ready in {time.monotonic() - t0:.1f} s", flush=True)
        print(f"HTTP     {server.http_url}", flush=True)
        print(f"gRPC     {server.grpc_url}", flush=True)
        print(f"metrics  {server.metrics_url}", flush=True)
        if args.hint:
            print(args.hint.format(http=server.http_url, grpc=server.grpc_url), flush=True)
        print("Ctrl-C to stop", flush=True)
        while server.is_running():
            time.sleep(0.5)
        print(f"tritonserver exited by itself (code {server.process.returncode}); log tail:", file=sys.stderr)
        print(server.log_tail(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping ...", flush=True)
        return 0
    except TritonServerError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        # Ignore further Ctrl-C/SIGTERM while tearing down, so cleanup can't be interrupted.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        code = server.stop()
        if code is not None:
            print(f"stopped (exit code {code})", flush=True)


if __name__ == "__main__":
    sys.exit(main())

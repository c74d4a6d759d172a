"""How the gateway reaches Triton: gRPC streams (what it does) vs HTTP ``generate_stream``.

One tritonserver serves ``mm_ensemble``; two clients in this process send it ``bench/peers.py``'s
requests at one concurrency, alternating run by run:

* ``grpc``: ``mmserve.gateway.triton.TritonBackend``, the gateway's own: requests spread over a few
  long-lived ``ModelStreamInfer`` streams (grpc.aio), each response parsed to a ``Delta``; an image
  arrives as a base64 data URL and is decoded to bytes first, as the gateway does.
* ``http``: aiohttp ``POST /v2/models/mm_ensemble/generate_stream`` (Triton's generate extension,
  server-sent events), the request's ``id`` in the JSON body (so ``mm_llm``'s ``cancel`` control
  request reaches it); the data URL goes as it came (``preprocess`` decodes it).

Per run: requests/s, this process's CPU per request (the gateway's side of the link) and the
serving processes' (tritonserver and each stub). The OpenAI side of the gateway (FastAPI, the SSE
it writes) is the same for both and not in this measurement.

Reproduce (about 2 minutes on 2 CPU cores)::

    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python bench/triton_transport.py
    # more: --workloads text image --rounds 4 --requests 256 --stream-flush-ms 0
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers  # noqa: E402
from common import cpu_seconds_by_kind, serving_processes  # noqa: E402

MODEL = "mm_ensemble"


def request_fields(workload: str, seed: int, settings: peers.Settings) -> dict[str, Any]:
    """``bench/peers.py``'s request of ``workload`` for ``seed`` (its text, its 448x448 PNG), as JSON
    values (the generate extension's form): an image as the base64 data URL a gateway's client sends."""
    request = peers.make_request(workload, seed, settings)
    fields: dict[str, Any] = {
        "text_input": request.text,
        "sampling_parameters": json.dumps(settings.sampling),
        "stream": True,
        "return_finish_reason": True,
    }
    if request.images:
        fields["image"] = ["data:image/png;base64," + base64.b64encode(image).decode() for image in request.images]
    return fields


async def via_grpc(backend: Any, fields: dict[str, Any]) -> int:
    from mmserve.dataurl import data_url_payload

    tensors: dict[str, np.ndarray] = {}
    for name, value in fields.items():
        if name == "image":  # the gateway decodes the client's data URL and sends the bytes
            tensors[name] = np.array([data_url_payload(url) for url in value], dtype=np.object_)
        elif isinstance(value, bool):
            tensors[name] = np.array([value])
        else:
            tensors[name] = np.array([value.encode()], dtype=np.object_)
    tokens = 0
    async for delta in backend.generate(tensors, uuid.uuid4().hex):
        tokens += len(delta.token_ids)
    return tokens


async def via_http(session: Any, url: str, fields: dict[str, Any]) -> int:
    tokens = 0
    async with session.post(url, json={"id": uuid.uuid4().hex, **fields}) as reply:
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {(await reply.read())[:300]!r}")
        async for line in reply.content:
            if line.startswith(b"data:"):
                event = json.loads(line[5:])
                if "error" in event:
                    raise RuntimeError(event["error"])
                ids = event.get("output_ids", [])
                tokens += len(ids) if isinstance(ids, list) else 1  # one id comes as a number
    return tokens


async def one_run(
    send: Callable[[dict[str, Any]], Awaitable[int]], requests: Sequence[dict[str, Any]], concurrency: int, procs: list
) -> dict[str, Any]:
    import psutil

    slots = asyncio.Semaphore(concurrency)

    async def one(fields: dict[str, Any]) -> int:
        async with slots:
            return await send(fields)

    me = psutil.Process()
    client0, server0, start = me.cpu_times(), cpu_seconds_by_kind(procs), time.perf_counter()
    tokens = await asyncio.gather(*(one(fields) for fields in requests))
    wall, client1, server1 = time.perf_counter() - start, me.cpu_times(), cpu_seconds_by_kind(procs)
    n = len(requests)
    server = {kind: (server1[kind] - server0.get(kind, 0.0)) / n * 1e3 for kind in server1}
    return {
        "req/s": n / wall,
        "client CPU": (client1.user + client1.system - client0.user - client0.system) / n * 1e3,
        "server CPU": sum(server.values()),
        "split": server,
        "tokens": sum(tokens) / n,
    }


async def measure(
    server: Any, args: argparse.Namespace, settings: peers.Settings
) -> list[tuple[str, str, dict[str, Any]]]:
    import aiohttp

    from mmserve.gateway.triton import TritonBackend

    procs = serving_processes(server.pid)
    backend = TritonBackend(f"127.0.0.1:{server.grpc_port}", MODEL)
    await backend.start()
    url = f"http://127.0.0.1:{server.http_port}/v2/models/{MODEL}/generate_stream"
    results = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            every: dict[str, Callable[[dict[str, Any]], Awaitable[int]]] = {
                "grpc": lambda fields: via_grpc(backend, fields),
                "http": lambda fields: via_http(session, url, fields),
            }
            transports = {name: every[name] for name in args.transports}
            for workload in args.workloads:
                for send in transports.values():  # warm-up
                    await send(request_fields(workload, 0, settings))
                for round_ in range(args.rounds):
                    order = list(transports) if round_ % 2 == 0 else list(reversed(transports))
                    for name in order:
                        seed = 1000 * round_ + (1 if name == "http" else 0)
                        requests = [request_fields(workload, seed + 2 * i, settings) for i in range(args.requests)]
                        result = await one_run(transports[name], requests, args.concurrency, procs)
                        if result["tokens"] != settings.max_tokens:
                            raise RuntimeError(
                                f"{name}: {result['tokens']} tokens per request, not {settings.max_tokens}"
                            )
                        split = " · ".join(f"{k} {v:.2f}" for k, v in sorted(result["split"].items()) if v > 0.005)
                        print(
                            f"{workload:6} round {round_} {name:5} {result['req/s']:6.1f} req/s  "
                            f"client CPU {result['client CPU']:5.2f} ms/req  server CPU {result['server CPU']:5.2f} "
                            f"ms/req ({split})",
                            flush=True,
                        )
                        results.append((workload, name, result))
    finally:
        await backend.close()
    return results


def summary(results: list[tuple[str, str, dict[str, Any]]]) -> None:
    print("\n| workload | transport | req/s (median) | client CPU ms/req | server CPU ms/req | runs |")
    print("|---|---|---:|---:|---:|---:|")
    for workload in dict.fromkeys(w for w, _, _ in results):
        for name in ("grpc", "http"):
            runs = [r for w, n, r in results if w == workload and n == name]
            if runs:
                med = {key: float(np.median([r[key] for r in runs])) for key in ("req/s", "client CPU", "server CPU")}
                print(
                    f"| {workload} | {name} | {med['req/s']:.1f} | {med['client CPU']:.2f} | "
                    f"{med['server CPU']:.2f} | {len(runs)} |"
                )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=["text", "image"], default=["text", "image"])
    parser.add_argument("--transports", nargs="+", choices=["grpc", "http"], default=["grpc", "http"])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=128, help="requests per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per transport and workload (alternating)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--stream-flush-ms", type=float, default=None, help="mm_llm's (default: as shipped)")
    args = parser.parse_args(argv)
    flags = ["--systems", MODEL, "--max-tokens", str(args.max_tokens)] + (
        [] if args.stream_flush_ms is None else ["--stream-flush-ms", str(args.stream_flush_ms)]
    )
    settings = peers.parse_settings(flags)
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        server = peers.start_triton(settings, Path(folder), stack)
        results = asyncio.run(measure(server, args, settings))
    summary(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

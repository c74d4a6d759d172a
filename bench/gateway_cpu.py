"""Where the gateway's CPU goes: its HTTP side alone, and a gRPC streaming client of Triton alone.

``bench/gateway.py`` measures the gateway's process at 16-23 ms of CPU per streamed request of 32
tokens. This splits it, in CPU time (which hardly depends on the machine's load):

1. **HTTP side**: the gateway's FastAPI app (uvicorn, as ``python -m mmserve.gateway`` runs it) with a
   stand-in backend that yields N deltas at once, no Triton; a sequential aiohttp client streams 200
   requests; the gateway process's CPU per request, for 1 and 33 deltas (parse, validate, SSE).
2. **gRPC side**: the same streamed text request (32 tokens) to ``mm_pipeline`` on a real tritonserver,
   30 times in sequence, from ``tritonclient.grpc.aio`` (what the gateway uses) and from the blocking
   ``tritonclient.grpc`` stream API; the client process's CPU per request.

    .venv/bin/python bench/gateway_cpu.py            # ~3 min on 2 CPU cores (a tritonserver start)
    .venv/bin/python bench/gateway_cpu.py --no-grpc  # the HTTP side only, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HTTP_REQUESTS = 200
GRPC_REQUESTS = 30
TOKENS = 32

STAND_IN = """
import asyncio, sys
import uvicorn
from mmserve.gateway.app import GatewayConfig, create_app
from mmserve.gateway.triton import Delta

N = int(sys.argv[2])

class StandIn:
    async def start(self): pass
    async def close(self): pass
    async def ready(self): pass
    async def generate(self, tensors, request_id):
        for i in range(N):
            await asyncio.sleep(0)
            yield Delta(text=" tok", token_ids=[5], finish_reason="length" if i == N - 1 else None,
                        num_input_tokens=10 if i == 0 else None, num_output_tokens=1, logprobs=None)

uvicorn.run(create_app(GatewayConfig(), backend=StandIn()), host="127.0.0.1", port=int(sys.argv[1]),
            log_level="warning")
"""


async def _stream_http(port: int, count: int) -> None:
    import aiohttp

    body = {"model": "mm_pipeline", "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    async with aiohttp.ClientSession() as session:
        for _ in range(count):
            async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as reply:
                async for _ in reply.content:
                    pass


def http_side(deltas: int) -> float:
    """The gateway process's CPU ms per request with a stand-in backend of ``deltas`` responses."""
    import psutil

    from mmserve_dev.triton import free_ports

    (port,) = free_ports(1)
    process = subprocess.Popen([sys.executable, "-c", STAND_IN, str(port), str(deltas)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                asyncio.run(_stream_http(port, 10))  # warm-up (and: it is up)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        gateway = psutil.Process(process.pid)
        before = sum(gateway.cpu_times()[:2])
        asyncio.run(_stream_http(port, HTTP_REQUESTS))
        return (sum(gateway.cpu_times()[:2]) - before) / HTTP_REQUESTS * 1e3
    finally:
        process.terminate()
        process.wait(15)


def _tensors() -> dict[str, np.ndarray]:
    sampling = {"max_tokens": TOKENS, "ignore_eos": True, "temperature": 0}
    return {"text_input": np.array([b"Count to ten."], dtype=np.object_), "stream": np.array([True]),
            "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=np.object_)}


async def _aio_cpu(url: str) -> float:
    import tritonclient.grpc.aio as grpc_aio

    from mmserve.client import grpc_inputs

    client = grpc_aio.InferenceServerClient(url)

    async def one(index: int) -> None:
        inputs = grpc_inputs(_tensors())

        async def request():
            yield {"model_name": "mm_pipeline", "inputs": inputs, "request_id": str(index)}

        async for _, error in client.stream_infer(request()):
            assert error is None, error

    await one(0)
    started = time.process_time()
    for index in range(GRPC_REQUESTS):
        await one(index)
    cpu = (time.process_time() - started) / GRPC_REQUESTS * 1e3
    await client.close()
    return cpu


def _blocking_cpu(url: str) -> float:
    import tritonclient.grpc as grpc_client

    from mmserve.client import grpc_inputs

    client = grpc_client.InferenceServerClient(url)

    def one(index: int) -> None:
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer("mm_pipeline", grpc_inputs(_tensors()), request_id=str(index),
                                  enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=120)
            assert error is None, error
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                break
        client.stop_stream()

    one(0)
    started = time.process_time()
    for index in range(GRPC_REQUESTS):
        one(index)
    return (time.process_time() - started) / GRPC_REQUESTS * 1e3


def grpc_side() -> dict[str, float]:
    from mmserve_dev.triton import TritonServer

    with TritonServer(ROOT / "model_repository", shm_default_byte_size=32 * 2**20,
                      env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                      load_models=("preprocess", "mm_llm", "mm_pipeline")) as server:
        return {"tritonclient.grpc.aio": asyncio.run(_aio_cpu(server.grpc_url)),
                "tritonclient.grpc (blocking stream)": _blocking_cpu(server.grpc_url)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-grpc", dest="grpc", action="store_false", help="skip the tritonserver part")
    args = parser.parse_args()
    one, many = http_side(1), http_side(TOKENS + 1)
    print(f"gateway HTTP side (stand-in backend): {one:.2f} ms CPU per request with 1 delta, "
          f"{many:.2f} ms with {TOKENS + 1} ({(many - one) / TOKENS * 1e3:.0f} us per further delta)")
    if args.grpc:
        for name, cpu in grpc_side().items():
            print(f"gRPC client, {TOKENS}-token stream from mm_pipeline: {name}: {cpu:.2f} ms CPU per request")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Helpers of the tests that run against a live tritonserver (test_e2e_*.py): the workload and its
offline-vLLM references, endpoints, raw sends over gRPC and HTTP, metrics, the engine's processes.

The fixtures that use them (``references``, ``server``) are session-scoped in conftest.py; every
server test runs after all other tests (conftest reorders them), so one engine is alive at a time.
"""

from __future__ import annotations

import io
import json
import os
import queue
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmserve.client import grpc_inputs

MAX_TOKENS = 12
CASES: dict[str, list[str]] = {
    "text_only": [],
    "image": ["image"],
    "audio": ["audio"],
    "image_audio": ["image", "audio"],
    "two_images": ["image", "image"],
}
ENTRIES = ("mm_pipeline", "mm_ensemble")


@dataclass
class Case:
    name: str
    text: str
    images: list[bytes]
    audios: list[bytes]
    ids: list[int] | None = None  # offline vLLM's greedy output
    output: str | None = None


def make_case(name: str, parts: list[str], seed: int) -> Case:
    from mmserve_dev.samples import encode_audio, encode_image, sample_audio, sample_image

    images = [encode_image(sample_image(seed + i, size=(112 + 28 * (i % 2), 84))) for i, p in enumerate(parts) if p == "image"]
    audios = [encode_audio(sample_audio(seed + i, seconds=1.0 + 0.5 * (i % 2))) for i, p in enumerate(parts) if p == "audio"]
    return Case(name, ["Describe it.", "What is this?", "Say more."][seed % 3], images, audios)


WORKLOAD = [make_case(name, parts, seed) for seed in range(4) for name, parts in CASES.items()]  # 20 requests
BY_NAME = {f"{c.name}#{i // len(CASES)}": c for i, c in enumerate(WORKLOAD)}


def sampling(max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": 0.0}


def compute_references(model: str, engine_args: dict[str, Any]) -> dict[str, Case]:
    """Offline vLLM on the raw inputs: chat template applied by the HF processor, media decoded."""
    import soundfile
    from PIL import Image
    from vllm import SamplingParams

    from mmserve.engine import EngineRunner
    from mmserve_dev.hf_reference import chat_prompt, load_processor

    processor = load_processor(model)
    params = SamplingParams(**sampling())
    with EngineRunner(model, **engine_args) as engine:
        for case in WORKLOAD:
            parts = ["image"] * len(case.images) + ["audio"] * len(case.audios) + [f"text:{case.text}"]
            mm: dict[str, Any] = {}
            if case.images:
                mm["image"] = [Image.open(io.BytesIO(b)).convert("RGB") for b in case.images]
            if case.audios:
                mm["audio"] = [(soundfile.read(io.BytesIO(b), dtype="float32")[0], 16_000) for b in case.audios]
            prompt: dict[str, Any] = {"prompt": chat_prompt("qwen2_5_omni", processor, parts)}
            if mm:
                prompt["multi_modal_data"] = mm
            completion = engine.generate_sync(prompt, params).outputs[0]
            case.ids, case.output = list(completion.token_ids), completion.text
    return BY_NAME


@dataclass
class Endpoints:
    grpc: str  # host:port
    http: str | None  # host:port
    metrics: str | None  # full URL of /metrics
    server: Any = None  # the TritonServer when the suite started it (None: an external server)


def client(server: Endpoints, **kwargs: Any):
    from mmserve.client import MMClient

    kwargs.setdefault("timeout", 180)  # a test that waits fails instead of hanging
    return MMClient(server.grpc, **kwargs)


# -- raw sends ------------------------------------------------------------------------------------
def grpc_stream(server: Endpoints, model: str, tensors: dict[str, np.ndarray], timeout: float = 120) -> list:
    """Send ``tensors`` to a decoupled ``model`` over a gRPC stream; its results until the final one.

    Raises ``mmserve.client.ClientError`` with the server's message on an error response.
    """
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from mmserve.client import ClientError

    answers: queue.Queue = queue.Queue()
    grpc = grpcclient.InferenceServerClient(server.grpc)
    grpc.start_stream(callback=lambda result, error: answers.put((result, error)))
    results = []
    try:
        try:
            grpc.async_stream_infer(model, grpc_inputs(tensors), enable_empty_final_response=True)
        except InferenceServerException as exc:  # the stream broke first: its callback has why
            answers.put((None, exc))
        while True:
            result, error = answers.get(timeout=timeout)
            if error is not None:
                raise ClientError(error.message() if hasattr(error, "message") else str(error))
            results.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return results
    finally:
        grpc.stop_stream()
        grpc.close()


def grpc_infer(server: Endpoints, model: str, tensors: dict[str, np.ndarray]) -> Any:
    """A plain (non-decoupled) gRPC infer, e.g. to ``preprocess``; ``ClientError`` on an error."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from mmserve.client import ClientError

    grpc = grpcclient.InferenceServerClient(server.grpc)
    try:
        return grpc.infer(model, grpc_inputs(tensors))
    except InferenceServerException as exc:
        raise ClientError(exc.message()) from None
    finally:
        grpc.close()


def http_generate(server: Endpoints, model: str, body: bytes | dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST to Triton's generate endpoint; (HTTP status, JSON body)."""
    import requests

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = requests.post(f"http://{server.http}/v2/models/{model}/generate", data=data, timeout=120,
                          headers={"Content-Type": "application/json"})
    try:
        return reply.status_code, reply.json()
    except ValueError:
        return reply.status_code, {"error": reply.text}


# -- server state ---------------------------------------------------------------------------------
def http_status(server: Endpoints, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{server.http}{path}", timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def metric(server: Endpoints, name: str) -> float:
    text = urllib.request.urlopen(server.metrics, timeout=10).read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and 'model="mm_llm"' in line]
    assert values, f"{name} not in /metrics"
    return sum(values)


def wait_for(condition: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline:
            return False
        time.sleep(interval)
    return True


def generated_after_cancel(server: Endpoints, model: str, tensors: dict[str, np.ndarray]) -> tuple[float, float]:
    """Stream ``tensors`` to ``model``, cancel once generation runs; (tokens generated when the
    client cancelled, tokens generated in all once the engine is idle)."""
    import tritonclient.grpc as grpcclient

    def generated() -> float:
        return metric(server, "vllm:generation_tokens_total")

    before = generated()
    grpc = grpcclient.InferenceServerClient(server.grpc)
    grpc.start_stream(callback=lambda result, error: None)
    grpc.async_stream_infer(model, grpc_inputs(tensors))
    assert wait_for(lambda: generated() > before + 10, 60), "generation did not start"
    at_cancel = generated() - before
    grpc.stop_stream(cancel_requests=True)
    grpc.close()
    last = [generated()]

    def settled() -> bool:
        time.sleep(2)
        now = generated()
        done, last[0] = now == last[0], now
        return done

    assert wait_for(settled, 180)
    return at_cancel, last[0] - before


def engine_core_pids(server: Endpoints) -> list[int]:
    """The server's vLLM engine core processes (only when the suite started the server)."""
    import psutil

    assert server.server is not None
    pids = []
    for process in psutil.Process(server.server.pid).children(recursive=True):
        try:
            title = " ".join(process.cmdline()[:1])  # vLLM sets it: VLLM::EngineCore
            if "EngineCore" in title and process.status() != psutil.STATUS_ZOMBIE:
                pids.append(process.pid)
        except psutil.Error:  # gone, or a zombie (Triton's auto-complete stubs exit at start)
            continue
    return pids


def shm_leftovers() -> set[str]:
    return set(os.listdir("/dev/shm"))

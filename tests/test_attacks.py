"""A hostile client against the live server (issue 39): every attack of the issue's table, each
followed by the check that matters -- the service and other clients' requests are untouched.

Each test makes the attack for real (the real tritonserver, real gRPC and HTTP clients on other
connections) and then asserts what an ordinary client sees: a request whose answer must equal its
offline-vLLM reference, the readiness endpoints, the engine's process (the same one: it did not
die). Where the attack is refused, the test also shows that the refusal is the defence and not an
accident: the operator, with the key, gets what the attacker asked for (``mmserve.operator``).

Covered elsewhere, with real components too: the engine faults and stops after the attacks (a
stream held open through an engine death and through the stop, the launcher SIGKILLed after
traffic: test_faults.py), the gateway's remote media and API key (test_gateway_unit.py), the media
budget's peak RSS (test_media_budget.py) and the processed-input bounds against the engine
(test_property_engine.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import secrets
import struct
import time
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest

import utils
from utils import sampling, send_tensors

pytestmark = pytest.mark.server

LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}


def _good_request_still_served(server, references, name: str = "text_only#0") -> None:
    case = references[name]
    assert utils.client(server).generate(case.text, case.images, case.audios, **sampling()).output_ids == case.ids


def _ready(server) -> tuple[int, ...]:
    return tuple(
        utils.http_status(server, path)
        for path in ("/v2/health/ready", "/v2/models/mm_llm/ready", "/v2/models/mm_ensemble/ready")
    )


def _http(server, method: str, path: str, body: dict[str, Any] | None = None, headers=None) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://{server.http}{path}",
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.fixture(scope="module")
def triton(server):
    if server.server is None or server.http is None:
        pytest.skip("needs the server the suite starts (its operator key, its processes)")
    return server


# -- Triton's operator APIs ------------------------------------------------------------------------
def _operator_calls(triton) -> list[tuple[str, str, dict[str, Any] | None]]:
    """What an attacker sent: unload mm_llm, load a model with a file override (a code path in
    Triton's own deployment guide), register the server's own IPC region as system shared memory
    (CVE-2025-23319/23320/23334's chain), raise the log verbosity, switch tracing on."""
    [region, *_] = [path.name for path in triton.server.shm_files()]
    override = {"parameters": {"config": json.dumps({"backend": "python"}), "file:1/model.py": "aW1wb3J0IG9z"}}
    return [
        ("POST", "/v2/repository/models/mm_llm/unload", None),
        ("POST", "/v2/repository/models/evil/load", override),
        ("POST", "/v2/repository/index", None),
        (
            "POST",
            f"/v2/systemsharedmemory/region/{region}/register",
            {"key": f"/{region}", "offset": 0, "byte_size": 64},
        ),
        ("GET", "/v2/systemsharedmemory/status", None),
        ("POST", "/v2/logging", {"log_verbose_level": 3, "log_error": False}),
        ("POST", "/v2/trace/setting", {"trace_level": ["TIMESTAMPS", "TENSORS"], "trace_rate": "1"}),
    ]


def test_the_operator_apis_refuse_a_client_without_the_key(triton, references):
    from mmserve import operator

    [core] = utils.engine_core_pids(triton)
    for method, path, body in _operator_calls(triton):
        for headers in (None, {operator.OPERATOR_HEADER: "not-the-key-" + secrets.token_urlsafe(16)}):
            status, text = _http(triton, method, path, body, headers)
            assert status == 403 and "restricted" in text, (method, path, status, text)
    assert _ready(triton) == (200, 200, 200)
    assert triton.server.shm_files(), "the server's regions"
    _good_request_still_served(triton, references)
    assert utils.engine_core_pids(triton) == [core]
    # The refusal is the key's doing: the operator reads the same APIs (harmless calls only).
    key = operator.http_headers(triton.server.operator_key)
    assert _http(triton, "POST", "/v2/repository/index", None, key)[0] == 200
    assert _http(triton, "GET", "/v2/systemsharedmemory/status", None, key)[0] == 200
    assert _http(triton, "GET", "/v2/logging", None, key)[0] == 200


def test_the_operator_grpc_protocols_refuse_a_client_without_the_key(triton, references):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from mmserve import operator

    [region, *_] = [path.name for path in triton.server.shm_files()]
    client = grpcclient.InferenceServerClient(triton.grpc)
    calls = {
        "unload": lambda h: client.unload_model("mm_llm", headers=h),
        "index": lambda h: client.get_model_repository_index(headers=h),
        "shm": lambda h: client.register_system_shared_memory(region, f"/{region}", 64, headers=h),
        "logging": lambda h: client.update_log_settings({"log_verbose_level": 3}, headers=h),
        "trace": lambda h: client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]}, headers=h),
    }
    try:
        for name, call in calls.items():
            with pytest.raises(InferenceServerException, match="restricted") as refused:
                call(None)
            assert name and "restricted" in str(refused.value)
        assert client.get_model_repository_index(headers=operator.grpc_headers(triton.server.operator_key))
    finally:
        client.close()
    assert _ready(triton) == (200, 200, 200)
    _good_request_still_served(triton, references)


def test_a_chunked_body_that_kills_triton_251_is_refused_at_the_http_port(triton, references):
    """One request of 600,000 one-byte chunks crashes tritonserver 2.51's HTTP frontend
    (CVE-2025-23310/23311; tests/test_http_guard.py shows it on an unguarded server): the launcher's
    HTTP front refuses it, and the server serves on."""
    import socket

    host, port = triton.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v2/models/preprocess/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Type: application/json\r\n\r\n"
        )
        with contextlib.suppress(OSError):  # the front answers at the head and closes
            sock.sendall(b"1\r\n \r\n" * 600_000 + b"0\r\n\r\n")
        answer = sock.recv(200)
    assert answer.startswith(b"HTTP/1.1 411"), answer
    assert triton.server.is_running() and _ready(triton) == (200, 200, 200)
    _good_request_still_served(triton, references)


# -- mm_llm's controls -----------------------------------------------------------------------------
@pytest.mark.parametrize("key", [None, "not-the-operator-key-0123456789"], ids=["no-key", "wrong-key"])
def test_a_drain_without_the_operators_key_is_refused(triton, references, key):
    """A drain from another connection used to stop the service for everyone, for good (every
    later request UNAVAILABLE "the server is stopping", readiness still green)."""
    from mmserve.client import ClientError

    tensors: dict[str, np.ndarray] = {"input_ids": np.zeros(0, np.int64), "drain": np.array([0.0], np.float32)}
    if key is not None:
        tensors["operator_key"] = np.array([key.encode()], dtype=object)
    with pytest.raises(ClientError) as refused:
        send_tensors(triton, "mm_llm", tensors)
    assert refused.value.code == "INVALID_ARG" and "drain: refused" in str(refused.value), refused.value
    time.sleep(1)
    assert _ready(triton) == (200, 200, 200)
    _good_request_still_served(triton, references)


def _victim(triton, request_id: str | None = None):
    """A client's long stream through mm_ensemble (its own cancel_key, as the project's clients send)."""
    from mmserve.client import Generation

    tensors = {
        "text_input": np.array([b"Count."], dtype=object),
        "stream": np.array([True]),
        "sampling_parameters": np.array([json.dumps(LONG).encode()], dtype=object),
        "return_finish_reason": np.array([True]),
    }
    return Generation(triton.grpc, "mm_ensemble", tensors, request_id=request_id)


def _read_all(generation) -> tuple[int, str | None]:
    tokens, reason = 0, None
    for result in generation:
        tokens += len(result.output_ids)
        reason = result.finish_reason or reason
    return tokens, reason


def test_a_cancel_reaches_only_its_owners_request(triton, references):
    """Another client's cancel for the id of a stream in flight, with no key, a guessed key, or its
    own request under the same id: the victim's stream runs to its end; only the attacker's own
    request (its id and its key) is cancelled."""
    from mmserve.client import cancel_on_engine, new_cancel_key

    victim = _victim(triton)
    first = next(iter(victim))  # the victim's stream runs on the engine
    assert first.output_ids
    # no cancel_key at all (a raw client: the project's adds one to everything it sends): refused
    bare = utils.Tracked(
        triton,
        "mm_llm",
        {"input_ids": np.zeros(0, np.int64), "cancel": np.array([victim.request_id.encode()], dtype=object)},
        f"{victim.request_id}.cancel",
    )
    assert bare.wait(30) and bare.finals == 1, bare.errors
    assert "[INVALID_ARG] cancel: expected the cancel_key" in bare.errors[0], bare.errors
    # a guessed key: answered as any cancel is, and nothing happens
    assert cancel_on_engine(triton.grpc, victim.request_id, new_cancel_key())
    # the attacker's own request under the victim's id, then its cancel: its own ends, not the victim's
    attacker = _victim(triton, request_id=victim.request_id)
    next(iter(attacker))
    attacker.cancel()
    tokens, reason = _read_all(victim)
    assert (tokens + len(first.output_ids), reason) == (LONG["max_tokens"], "length")
    _good_request_still_served(triton, references)


def test_a_cancel_before_the_request_hits_only_its_owners_later_request(triton, references):
    """A cancel for an id nobody uses yet, then another client's request with that id: it is served
    to its end. (The owner's own early cancel still cancels its request: test_e2e_server.py.)"""
    from mmserve.client import cancel_on_engine, new_cancel_key

    request_id = f"2-{time.monotonic_ns()}"  # what load tools use: small numbers
    assert cancel_on_engine(triton.grpc, request_id, new_cancel_key())
    tokens, reason = _read_all(_victim(triton, request_id=request_id))
    assert (tokens, reason) == (LONG["max_tokens"], "length")
    _good_request_still_served(triton, references)


def test_bounds_on_the_control_inputs(triton, references):
    """A cancel_key too short to be a secret, a request id of a megabyte: refused, not stored."""
    from mmserve.client import ClientError, Generation

    hi = {"text_input": np.array([b"Hi"], object)}
    for tensors, request_id, pattern in (
        (
            {**hi, "cancel_key": np.array([b"1"], object)},
            "short-key",
            r"cancel_key: expected 16 to 128 bytes .* found 1",
        ),
        (hi, "x" * (1 << 20), r"request id: expected at most 256 bytes"),
    ):
        with pytest.raises(ClientError, match=pattern):
            list(Generation(triton.grpc, "mm_ensemble", tensors, request_id=request_id))
    _good_request_still_served(triton, references)


# -- processed inputs: numbers ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def encoded(tiny_models) -> dict[str, np.ndarray]:
    """An image request as mm_ensemble_encoded hands it to mm_llm: image_embeds + image_grid_thw."""
    from mmserve.encoder import Encoder, Towers
    from mmserve.serving.preprocess import Preprocessor
    from mmserve_dev.samples import sample_image

    buffer = io.BytesIO()
    sample_image(3, size=(112, 84)).save(buffer, format="PNG")
    wire = Preprocessor(tiny_models["qwen2_5_omni"])("Describe it.", [buffer.getvalue()], [])
    tensors = Encoder(Towers(tiny_models["qwen2_5_omni"]), cache_bytes=0).encoded(wire)
    tensors["sampling_parameters"] = np.array([json.dumps(sampling(4)).encode()], dtype=object)
    return tensors


@pytest.fixture(scope="module")
def video(tiny_models) -> dict[str, np.ndarray]:
    from mmserve.serving.preprocess import Preprocessor
    from mmserve_dev.samples import encode_video, sample_video

    tensors = Preprocessor(tiny_models["qwen2_5_omni"])(
        "What happens?", [], [], videos=[encode_video(sample_video(2, frames=4))]
    )
    tensors["sampling_parameters"] = np.array([json.dumps(sampling(4)).encode()], dtype=object)
    return tensors


def test_a_grid_that_overflows_int64_is_refused_and_the_engine_lives(triton, references, encoded):
    """t*h*w of [1, 4611686018427387906, 24] wraps around in int64 to the right row count: it used
    to pass every check and kill the engine core."""
    from mmserve.client import ClientError

    [core] = utils.engine_core_pids(triton)
    rows = encoded["image_embeds"].shape[0] * 4  # the patches the grid must account for (merge 2x2)
    for grid in ([1, 4611686018427387906, 24], [1, 2**62, 2**3], [1, -rows // 2, -2]):
        with pytest.raises(ClientError) as refused:
            send_tensors(triton, "mm_llm", {**encoded, "image_grid_thw": np.array([grid], np.int64)})
        assert refused.value.code == "INVALID_ARG" and "image_grid_thw" in str(refused.value), (grid, refused.value)
    _good_request_still_served(triton, references, "image_audio#0")
    assert utils.engine_core_pids(triton) == [core]


@pytest.mark.parametrize("seconds", [float("inf"), float("nan"), 1e6, -1.0], ids=["inf", "nan", "1e6", "negative"])
def test_seconds_per_grid_out_of_range_are_refused(triton, references, video, seconds):
    """``second_per_grid_ts`` (Omni: ``video_second_per_grid``) sets the video's M-RoPE time
    positions: inf and 1e6 used to pass (positions far past the rotary table)."""
    from mmserve.client import ClientError

    [core] = utils.engine_core_pids(triton)
    field = "video_second_per_grid" if "video_second_per_grid" in video else "second_per_grid_ts"
    with pytest.raises(ClientError) as refused:
        send_tensors(triton, "mm_llm", {**video, field: np.full_like(video[field], seconds)})
    assert refused.value.code == "INVALID_ARG" and "second_per_grid" in str(refused.value), refused.value
    [served] = [r for r in send_tensors(triton, "mm_llm", video) if r.output_ids]
    assert len(served.output_ids) == 4
    _good_request_still_served(triton, references)
    assert utils.engine_core_pids(triton) == [core]


# -- media: formats outside the allow-list, and a bomb ----------------------------------------------
def _png(width: int, height: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def _sun_au(seconds: float = 1.0, rate: int = 16000) -> bytes:
    samples = (np.sin(np.arange(int(seconds * rate)) / 5) * 3000).astype(">i2").tobytes()
    return struct.pack(">4sIIIII", b".snd", 24, len(samples), 3, rate, 1) + samples


FORMATS = {
    "yuv4mpeg2": ("video", b"YUV4MPEG2 W16 H16 F25:1 Ip A1:1 C420jpeg\n" + (b"FRAME\n" + bytes(384)) * 4),
    "concatenated-png": ("video", _png(32, 32) * 8),
    "ffconcat": ("video", b"ffconcat version 1.0\nfile '/etc/passwd'\nfile 'http://127.0.0.1:1/x.mp4'\n"),
    "sun-au": ("audio", _sun_au()),
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_media_outside_the_allow_list_are_refused_before_any_decoder(triton, references, name):
    from mmserve.client import ClientError

    field, payload = FORMATS[name]
    tensors = {"text_input": np.array([b"What is it?"], object), field: np.array([payload], object)}
    tensors["sampling_parameters"] = np.array([json.dumps(sampling(4)).encode()], object)
    with pytest.raises(ClientError) as refused:
        send_tensors(triton, "mm_ensemble", tensors)
    assert refused.value.code == "INVALID_ARG" and f"{field}[0]" in str(refused.value), refused.value
    _good_request_still_served(triton, references)


def test_a_video_bomb_costs_preprocess_a_bounded_amount_of_memory(triton, references):
    """256 frames of 1920x1080 in 1.5 MB (PNG frames of one colour) used to be decoded whole before
    any limit: +8.4 GiB of server RSS for one request."""
    import av
    import psutil

    from mmserve.client import ClientError

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mov") as container:
        stream = container.add_stream("png", rate=25)
        stream.width, stream.height, stream.pix_fmt = 1920, 1080, "rgb24"
        frame = av.VideoFrame.from_ndarray(np.full((1080, 1920, 3), 90, np.uint8), format="rgb24")
        for _ in range(256):
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    bomb = buffer.getvalue()
    assert len(bomb) < 4 << 20, len(bomb)

    def preprocess_rss() -> int:
        stubs = [
            p
            for p in psutil.Process(triton.server.pid).children(recursive=True)
            if any("preprocess/1/model.py" in part for part in p.cmdline())
        ]
        return sum(p.memory_info().rss for p in stubs)

    before = preprocess_rss()
    tensors = {"text_input": np.array([b"What happens?"], object), "video": np.array([bomb], object)}
    tensors["sampling_parameters"] = np.array([json.dumps(sampling(4)).encode()], object)
    try:
        send_tensors(triton, "mm_ensemble", tensors)
    except ClientError as refused:
        assert refused.code == "INVALID_ARG" and "video[0]" in str(refused), refused
    grown = preprocess_rss() - before
    print(f"\nvideo bomb ({len(bomb)} bytes): preprocess RSS {before >> 20} MiB before, {grown >> 20:+d} MiB after")
    assert grown < 1 << 30, f"preprocess grew by {grown >> 20} MiB"
    _good_request_still_served(triton, references)

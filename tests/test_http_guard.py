"""Tests of mmserve_dev.triton.http_guard: the HTTP front that keeps tritonserver 2.51's frontend from
what it cannot take (CVE-2025-23310/23311, deep JSON).

Without a server: the JSON depth scan, and every refusal against a recording upstream (a socket that
records what reaches it: nothing may). With a server (``server``): a real tritonserver on a tiny
repository of its own, the guard in front of its HTTP port:
  * ``plain``  X (FP32 [-1]) -> Y = 2 X, S (BYTES [-1]) -> T = S;
  * ``ticker`` decoupled: COUNT (INT32 [1]), DELAY (FP32 [1]) -> COUNT responses INDEX = 0, 1, ...,
    DELAY s apart (the SSE events of ``generate_stream``).
The controls (the same attacks on the unguarded port kill 2.51) start servers of their own.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import shutil
import signal
import socket
import subprocess
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve_dev.triton import TritonServer, find_tritonserver, free_ports
from mmserve_dev.triton.http_guard import DEFAULT_MAX_BODY_BYTES, MAX_HEAD_BYTES, HttpGuard, json_depth_within

PLAIN_CONFIG = """
name: "plain"
backend: "python"
max_batch_size: 0
input [
  { name: "X" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "S" data_type: TYPE_STRING dims: [ -1 ] optional: true }
]
output [
  { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "T" data_type: TYPE_STRING dims: [ -1 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

PLAIN_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            s = pb_utils.get_input_tensor_by_name(request, "S")
            t = s.as_numpy() if s is not None else np.array([b""], dtype=object)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2), pb_utils.Tensor("T", t)]))
        return responses
"""

TICKER_CONFIG = """
name: "ticker"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "DELAY" data_type: TYPE_FP32 dims: [ 1 ] }
]
output [ { name: "INDEX" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

TICKER_MODEL = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            delay = float(pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(count):
                if i and delay:
                    time.sleep(delay)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("INDEX", np.array([i], dtype=np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

CHUNKS = 600_000
"""One-byte chunks in the attack: 2.51 dies at this many (measured with 600,000, 3.6 MB)."""
CRASH_DEPTH = 100_000
"""A JSON nesting that kills 2.51 (measured: 10,000 does not, 100,000 does)."""


def write_model(repo: Path, name: str, config: str, model_py: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(textwrap.dedent(config).lstrip())
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(model_py).lstrip())


def need_tritonserver() -> None:
    """The bundled tritonserver (``scripts/setup_env.sh`` installs it): a missing one fails, never skips."""
    find_tritonserver()


# -- requests and answers on raw sockets ---------------------------------------------------------------
INFER_BODY = json.dumps(
    {
        "inputs": [
            {"name": "X", "shape": [3], "datatype": "FP32", "data": [1.0, 2.5, -3.0]},
            {"name": "S", "shape": [1], "datatype": "BYTES", "data": ['[[[ "quoted" \\ ]]]']},
        ]
    }
).encode()


def post(path: str, body: bytes, *headers: str, length: int | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", f"Content-Length: {len(body) if length is None else length}"]
    return ("\r\n".join([*lines, *headers]) + "\r\n\r\n").encode() + body


def get(path: str, *headers: str) -> bytes:
    return ("\r\n".join([f"GET {path} HTTP/1.1", "Host: test", *headers]) + "\r\n\r\n").encode()


GOOD = post("/v2/models/plain/infer", INFER_BODY)


def deep(depth: int) -> bytes:
    """An infer request's JSON whose data nests ``depth`` deep (the whole document: depth + 3)."""
    return b'{"inputs":[{"name":"X","shape":[1],"datatype":"FP32","data":' + b"[" * depth + b"1" + b"]" * depth + b"}]}"


def connect(port: int, timeout: float = 30.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_answer(f: IO[bytes], *, head: bool = False) -> tuple[int, dict[str, str], bytes]:
    """One answer from ``f`` (a socket's buffered reader): status, headers (lowercased names), body
    (none after a HEAD request)."""
    status_line = f.readline()
    if not status_line:
        raise EOFError("the connection ended before an answer")
    status = int(status_line.split(b" ", 2)[1])
    headers: dict[str, str] = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if 100 <= status < 200 or head:
        return status, headers, b""
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while size := int(f.readline().split(b";")[0], 16):
            body += f.read(size)
            f.readline()
        f.readline()
        return status, headers, body
    return status, headers, f.read(int(headers.get("content-length", "0")))


def exchange(port: int, data: bytes, *, answers: int = 1) -> tuple[list[tuple[int, dict[str, str], bytes]], bool]:
    """Send ``data`` on a new connection; the answers read and whether the connection then ended
    (read within 1 s)."""
    with connect(port) as sock, sock.makefile("rb") as f:
        sock.sendall(data)
        got = [read_answer(f, head=data.startswith(b"HEAD ")) for _ in range(answers)]
        sock.settimeout(1.0)
        try:
            ended = f.read(1) == b""
        except (TimeoutError, ConnectionResetError):
            ended = False
    return got, ended


def error_of(body: bytes) -> str:
    document = json.loads(body)
    assert list(document) == ["error"] and b"\n" not in body, body
    return str(document["error"])


# -- a recording upstream: whatever reaches it -------------------------------------------------------
class Recorder:
    """A TCP listener that accepts, records every byte and never answers."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.received = bytearray()
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                self.open.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := conn.recv(65536):
                with self.lock:
                    self.received += data
        with self.lock:
            self.open.remove(conn)

    def close(self) -> None:
        self.listener.close()
        with self.lock:
            for conn in self.open:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    try:
        yield rec
    finally:
        rec.close()


@pytest.fixture
def guarded_recorder(recorder: Recorder) -> Iterator[tuple[HttpGuard, Recorder]]:
    with HttpGuard("127.0.0.1", 0, recorder.port) as guard:
        yield guard, recorder


# ======================================================================================================
# The JSON depth scan


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


_TRICKY_TEXT = st.text(alphabet='[]{}"\\ab\n\u00e9', max_size=6)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | _TRICKY_TEXT,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_TRICKY_TEXT, children, max_size=3),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None)
@given(value=_JSON, limit=st.integers(1, 8), ascii_only=st.booleans())
def test_the_depth_scan_agrees_with_a_parser(value: Any, limit: int, ascii_only: bool) -> None:
    """Brackets, quotes and backslashes inside strings (escaped every way json.dumps escapes them)
    never count; the depth of what is outside them is judged exactly at every limit."""
    data = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert json_depth_within(data, limit) is (_depth(value) <= limit), (data, _depth(value), limit)


def test_the_depth_scan_on_the_attacks_and_the_edges() -> None:
    assert json_depth_within(b"[" * 64 + b"]" * 64, 64)
    assert not json_depth_within(b"[" * 65 + b"]" * 65, 64)
    assert not json_depth_within(b"[" * 10_000, 64)  # unterminated: the parser recursed all the same
    assert not json_depth_within(b"[" * 100 + b"]" * 99, 64)  # does not balance
    assert json_depth_within(b'{"a": "' + b"[" * 10_000 + b'"}', 64)  # in a string
    assert json_depth_within(b'["\\\\", "' + b"[" * 100 + b'"]', 64)  # an escaped backslash ends no string
    assert not json_depth_within(b'["\\\\"' + b"[" * 100 + b"]" * 100 + b"]", 64)  # ... and this one is outside
    assert json_depth_within(b'["\\"' + b"[" * 100 + b'"]', 64)  # an escaped quote ends no string
    assert not json_depth_within(deep(62), 64) and json_depth_within(deep(61), 64)  # data + 3 levels


# ======================================================================================================
# Refusals: nothing reaches the upstream

REFUSALS: dict[str, tuple[bytes, int, bool]] = {
    # name: (request, status, connection kept)
    "chunked": (
        b"POST /v2/models/plain/infer HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n0\r\n\r\n",
        411,
        False,
    ),
    "other transfer coding": (
        b"POST /v2/models/plain/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nTransfer-Encoding: gzip\r\n\r\n{}",
        411,
        False,
    ),
    "oversized": (post("/v2/models/plain/infer", b"", length=DEFAULT_MAX_BODY_BYTES + 1), 413, False),
    "head of 65 KiB": (get("/v2/health/ready", "X-Pad: " + "p" * 65 * 1024), 431, False),
    "deep JSON": (post("/v2/models/plain/infer", deep(10_000)), 400, True),
    "deep JSON, generate": (post("/v2/models/ticker/generate", b"[" * 70 + b"]" * 70), 400, True),
    "deep JSON before binary tensors": (
        post("/v2/models/plain/infer", deep(100) + b"\0" * 16, f"Inference-Header-Content-Length: {len(deep(100))}"),
        400,
        True,
    ),
    "binary header length off the infer path": (
        post("/v2/models/ticker/generate", b"{}" + b"[" * 100, "Inference-Header-Content-Length: 2"),
        400,
        True,
    ),
    "compressed": (post("/v2/models/plain/infer", b"\x1f\x8b", "Content-Encoding: gzip"), 415, False),
    "two lengths": (post("/v2/models/plain/infer", INFER_BODY, f"Content-Length: {len(INFER_BODY)}"), 400, False),
    "length not a number": (
        post("/v2/models/plain/infer", b"{}", length=None).replace(b"Length: 2", b"Length: 2x"),
        400,
        False,
    ),
    "header length past the body": (
        post("/v2/models/plain/infer", b"{}", "Inference-Header-Content-Length: 3"),
        400,
        False,
    ),
    "bare LF": (b"GET /v2 HTTP/1.1\r\nHost: t\nX-Other: 1\r\n\r\n", 400, False),
    "obsolete folding": (b"GET /v2 HTTP/1.1\r\nHost: t\r\n folded\r\n\r\n", 400, False),
    "space before colon": (b"GET /v2 HTTP/1.1\r\nContent-Length : 5\r\n\r\n", 400, False),
    "HTTP/2 preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505, False),
    "other expectation": (post("/v2/models/plain/infer", b"", "Expect: 200-ok", length=2), 417, False),
    "HEAD": (b"HEAD /v2/health/ready HTTP/1.1\r\nHost: t\r\n\r\n", 405, True),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_refusal_reaches_nothing_upstream(guarded_recorder: tuple[HttpGuard, Recorder], name: str) -> None:
    """Each refusal is answered by the guard with its status and a one-line JSON error, before a
    byte (or even a connection) reaches the upstream; the connection ends after it, except where the
    request's end is known (its body read: deep JSON; HEAD)."""
    guard, recorder = guarded_recorder
    request, status, kept = REFUSALS[name]
    (answer,), ended = exchange(guard.port, request)
    assert answer[0] == status, answer
    if name != "HEAD":
        assert error_of(answer[2])
    else:
        assert answer[2] == b""  # no body after a HEAD
    assert ended is not kept, answer
    assert (answer[1].get("connection") == "close") is not kept
    time.sleep(0.1)
    assert recorder.connections == 0 and not recorder.received
    assert guard.refusals[status] >= 1


def test_an_oversized_body_is_refused_before_it_is_sent(guarded_recorder: tuple[HttpGuard, Recorder]) -> None:
    """With Expect: 100-continue the client sends no byte of a body over the maximum: 413 comes in
    place of the 100. Without it, 413 comes as soon as the head is read, and what follows is dropped."""
    guard, recorder = guarded_recorder
    with connect(guard.port) as sock, sock.makefile("rb") as f:
        sock.sendall(post("/v2/models/plain/infer", b"", "Expect: 100-continue", length=DEFAULT_MAX_BODY_BYTES + 1))
        status, headers, body = read_answer(f)
        assert status == 413 and "134217728" in error_of(body)
        assert f.read(1) == b""
    with connect(guard.port) as sock, sock.makefile("rb") as f:
        sock.sendall(post("/v2/models/plain/infer", b"", length=1 << 40))
        sock.sendall(b"x" * 1_000_000)  # the start of that body: read and dropped
        assert read_answer(f)[0] == 413
    assert recorder.connections == 0 and not recorder.received


def test_a_head_at_the_limit_is_taken_and_one_byte_more_is_not(guarded_recorder: tuple[HttpGuard, Recorder]) -> None:
    guard, recorder = guarded_recorder
    base = len(get("/v2", "X-Pad: "))
    with connect(guard.port) as sock:  # exactly MAX_HEAD_BYTES: relayed (the recorder never answers)
        sock.sendall(get("/v2", "X-Pad: " + "p" * (MAX_HEAD_BYTES - base)))
        deadline = time.monotonic() + 10
        while len(recorder.received) < MAX_HEAD_BYTES and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(recorder.received) == MAX_HEAD_BYTES
    (answer,), _ = exchange(guard.port, get("/v2", "X-Pad: " + "p" * (MAX_HEAD_BYTES - base + 1)))
    assert answer[0] == 431


def test_an_unreachable_upstream_is_a_502() -> None:
    (port,) = free_ports(1)
    with HttpGuard("127.0.0.1", 0, port) as guard:
        (answer,), ended = exchange(guard.port, GOOD)
    assert answer[0] == 502 and "unreachable" in error_of(answer[2]) and ended


def test_stop_closes_the_listener_and_every_connection(guarded_recorder: tuple[HttpGuard, Recorder]) -> None:
    guard, recorder = guarded_recorder
    relayed, idle = connect(guard.port), connect(guard.port)
    try:
        relayed.sendall(GOOD)  # forwarded: the recorder holds the upstream side, never answering
        idle.sendall(b"GET /v2 HTTP/1.1\r\n")  # half a head
        deadline = time.monotonic() + 10
        while len(recorder.received) < len(GOOD) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert bytes(recorder.received) == GOOD and guard.connections() == 2
        guard.stop()
        for sock in (relayed, idle):
            sock.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1) == b""
        deadline = time.monotonic() + 5
        while recorder.open and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not recorder.open  # the upstream connection went too
        with pytest.raises(ConnectionRefusedError):
            connect(guard.port).close()
    finally:
        relayed.close()
        idle.close()


def test_a_guard_takes_a_taken_port_as_an_error(recorder: Recorder) -> None:
    with pytest.raises(OSError):
        HttpGuard("127.0.0.1", recorder.port, recorder.port).start()


# ======================================================================================================
# With tritonserver


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("guard_repository")
    write_model(path, "plain", PLAIN_CONFIG, PLAIN_MODEL)
    write_model(path, "ticker", TICKER_CONFIG, TICKER_MODEL)
    return path


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    need_tritonserver()
    srv = TritonServer(repo, log_file=tmp_path_factory.mktemp("guard_logs") / "tritonserver.log", http_guard=False)
    srv.start(timeout=120)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def guard(server: TritonServer) -> Iterator[HttpGuard]:
    assert server.http_port is not None
    with HttpGuard("127.0.0.1", 0, server.http_port) as front:
        yield front


def infer_ok(port: int) -> None:
    """A good infer on a new connection: 200 and Y = 2 X."""
    (answer,), _ = exchange(port, GOOD)
    assert answer[0] == 200, answer
    assert json.loads(answer[2])["outputs"][0]["data"] == [2.0, 5.0, -6.0]


def chunked_attack(port: int) -> bytes:
    """The CVE-2025-23310/23311 request on a new connection: what came back (b"" if nothing)."""
    with connect(port) as sock:
        head = b"POST /v2/models/plain/infer HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n"
        sock.sendall(head + b"Content-Type: application/json\r\n\r\n")
        with contextlib.suppress(OSError):
            sock.sendall(b"1\r\n{\r\n" + b"1\r\n \r\n" * CHUNKS + b"0\r\n\r\n")
        sock.settimeout(20)
        try:
            return sock.recv(4096)
        except OSError:
            return b""


@pytest.mark.server
def test_the_chunked_attack_is_refused_and_triton_serves_on(server: TritonServer, guard: HttpGuard) -> None:
    """600,000 one-byte chunks through the guard: 411, and tritonserver lives and serves."""
    answer = chunked_attack(guard.port)
    assert answer.startswith(b"HTTP/1.1 411 "), answer[:200]
    assert b"Content-Length" in answer.split(b"\r\n\r\n", 1)[1]
    time.sleep(1)
    assert server.is_running()
    infer_ok(guard.port)


@pytest.mark.server
@pytest.mark.parametrize("attack", ["chunked", "deep JSON"])
def test_the_unguarded_attack_kills_tritonserver_2_51(repo: Path, tmp_path: Path, attack: str) -> None:
    """The control, on a server of its own: the same requests sent to Triton's own port end it. When a
    release stops dying of them (2.59 has the fixes), this test fails: re-measure; the guard may go."""
    need_tritonserver()
    srv = TritonServer(repo, log_file=tmp_path / "tritonserver.log", load_models=["plain"], http_guard=False)
    with srv:
        assert srv.http_port is not None and srv.version == "2.51.0", srv.version
        infer_ok(srv.http_port)
        if attack == "chunked":
            chunked_attack(srv.http_port)
        else:
            with contextlib.suppress(OSError, EOFError):
                exchange(srv.http_port, post("/v2/models/plain/infer", deep(CRASH_DEPTH)))
        assert srv.process is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            srv.process.wait(20)
        assert not srv.is_running(), f"tritonserver survived the {attack} attack: re-measure"
        assert srv.process.returncode == -signal.SIGSEGV, srv.log_tail()  # a stack overflow


@pytest.mark.server
def test_the_deep_json_that_kills_2_51_is_refused(server: TritonServer, guard: HttpGuard) -> None:
    (answer,), _ = exchange(guard.port, post("/v2/models/plain/infer", deep(CRASH_DEPTH)))
    assert answer[0] == 400 and "deeper than 64" in error_of(answer[2])
    assert server.is_running()


@pytest.mark.server
@pytest.mark.parametrize(
    "name", ["chunked", "oversized", "head of 65 KiB", "deep JSON", "deep JSON before binary tensors", "HEAD"]
)
def test_after_a_refusal_good_requests_are_served(server: TritonServer, guard: HttpGuard, name: str) -> None:
    """After each refusal: a good request on a new connection; where the connection is kept (the
    refused request's end is known), one on the same connection too."""
    request, status, kept = REFUSALS[name]
    with connect(guard.port) as sock, sock.makefile("rb") as f:
        sock.sendall(request)
        assert read_answer(f, head=name == "HEAD")[0] == status
        if kept:
            sock.sendall(GOOD)
            answer = read_answer(f)
            assert answer[0] == 200 and json.loads(answer[2])["outputs"][0]["data"] == [2.0, 5.0, -6.0]
        else:
            assert f.read(1) == b""
    infer_ok(guard.port)
    assert server.is_running()


# -- pass-through -------------------------------------------------------------------------------------


def _infer(url: str, binary: bool) -> dict[str, np.ndarray]:
    import tritonclient.http as httpclient

    x = np.random.default_rng(1).normal(size=1000).astype(np.float32)
    s = np.array([b'[[[[ " \\ {{', "é".encode(), b"", *([bytes(range(256))] if binary else [])], dtype=object)
    inputs = [httpclient.InferInput("X", [x.size], "FP32"), httpclient.InferInput("S", [s.size], "BYTES")]
    inputs[0].set_data_from_numpy(x, binary_data=binary)
    inputs[1].set_data_from_numpy(s, binary_data=binary)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("Y", "T")]
    with httpclient.InferenceServerClient(url) as client:
        result = client.infer("plain", inputs, outputs=outputs)
        assert np.array_equal(result.as_numpy("Y"), x * 2)
        return {n: result.as_numpy(n) for n in ("Y", "T")}


@pytest.mark.server
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_through_the_guard_is_infer_direct(server: TritonServer, guard: HttpGuard, binary: bool) -> None:
    """tritonclient.http: the same outputs through the guard as direct, JSON tensors and binary ones
    (whose bytes, brackets and quotes among them, follow the JSON and are not scanned)."""
    through, direct = _infer(guard.url, binary), _infer(server.http_url, binary)
    assert np.array_equal(through["Y"], direct["Y"])
    assert list(through["T"]) == list(direct["T"])


@pytest.mark.server
def test_large_binary_tensors_both_ways(server: TritonServer, guard: HttpGuard) -> None:
    """32 MiB up and 32 MiB back: the guard's flow control (either side paused while the other is
    full) delivers every byte."""
    import tritonclient.http as httpclient

    x = np.arange(8 * 1024 * 1024, dtype=np.float32)
    inp = httpclient.InferInput("X", [x.size], "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    with httpclient.InferenceServerClient(guard.url, network_timeout=120) as client:
        result = client.infer("plain", [inp], outputs=[httpclient.InferRequestedOutput("Y", binary_data=True)])
    assert np.array_equal(result.as_numpy("Y"), x * 2)


@pytest.mark.server
@pytest.mark.parametrize("length", ["0", "000"])
def test_an_empty_body_is_relayed(server: TritonServer, guard: HttpGuard, length: str) -> None:
    """``Content-Length: 0`` (tritonclient's repository calls send it): relayed, answered by Triton."""
    (answer,), _ = exchange(
        guard.port,
        post("/v2/repository/index", b"", length=int(length)).replace(
            b"Content-Length: 0", f"Content-Length: {length}".encode()
        ),
    )
    assert answer[0] in (200, 403), answer  # Triton's own answer (403: the API is restricted)


@pytest.mark.server
def test_health_and_metadata_through_the_guard(server: TritonServer, guard: HttpGuard) -> None:
    import tritonclient.http as httpclient

    with (
        httpclient.InferenceServerClient(guard.url) as through,
        httpclient.InferenceServerClient(server.http_url) as direct,
    ):
        assert through.is_server_live() and through.is_server_ready()
        assert through.is_model_ready("plain") and through.is_model_ready("ticker")
        assert through.get_server_metadata() == direct.get_server_metadata()
        for model in ("plain", "ticker"):
            assert through.get_model_metadata(model) == direct.get_model_metadata(model)
            assert through.get_model_config(model) == direct.get_model_config(model)
    (answer,), _ = exchange(guard.port, get("/v2/health/ready"))
    assert answer[0] == 200


def stream_events(port: int, count: int, delay: float) -> list[tuple[float, bytes]]:
    """``ticker``'s SSE stream read off a raw socket: (seconds since the request, event) as each
    arrived, then the stream's end as (seconds, b"")."""
    body = json.dumps({"COUNT": count, "DELAY": delay}).encode()
    got: list[tuple[float, bytes]] = []
    with connect(port) as sock, sock.makefile("rb") as f:
        t0 = time.monotonic()
        sock.sendall(post("/v2/models/ticker/generate_stream", body))
        status, headers = read_answer_head(f)
        assert status == 200 and headers["content-type"].startswith("text/event-stream"), headers
        while size := int(f.readline().split(b";")[0], 16):
            got.append((time.monotonic() - t0, f.read(size)))
            f.readline()
        f.readline()
        got.append((time.monotonic() - t0, b""))
    return got


def read_answer_head(f: IO[bytes]) -> tuple[int, dict[str, str]]:
    status = int(f.readline().split(b" ", 2)[1])
    headers: dict[str, str] = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


@pytest.mark.server
def test_sse_events_arrive_as_they_are_sent(server: TritonServer, guard: HttpGuard) -> None:
    """generate_stream through the guard: each event as the model sends it (0.5 s apart), not at
    the stream's end; the same events as direct."""
    assert server.http_port is not None
    through = stream_events(guard.port, 3, 0.5)
    direct = stream_events(server.http_port, 3, 0.5)
    assert [event for _, event in through] == [event for _, event in direct]
    assert [json.loads(event.removeprefix(b"data: "))["INDEX"] for _, event in through[:-1]] == [0, 1, 2]
    first, end = through[0][0], through[-1][0]
    assert end - first > 0.8, through  # the first event came a second before the stream ended
    assert through[1][0] - first > 0.3, through


@pytest.mark.server
def test_curl_with_a_2mb_body_and_expect_continue(server: TritonServer, guard: HttpGuard, tmp_path: Path) -> None:
    """curl sends Expect: 100-continue with a large body: the guard answers it, and the body is relayed."""
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("no curl")
    values = np.random.default_rng(2).normal(size=120_000).astype(np.float32)
    body = json.dumps({"inputs": [{"name": "X", "shape": [values.size], "datatype": "FP32", "data": values.tolist()}]})
    assert len(body) > 2_000_000
    (tmp_path / "body.json").write_text(body)
    done = subprocess.run(
        [curl, "-sv", "--max-time", "60", "-H", "Content-Type: application/json", "--data-binary",
         f"@{tmp_path / 'body.json'}", f"http://{guard.url}/v2/models/plain/infer"],
        capture_output=True, timeout=90, check=True,
    )  # fmt: skip
    assert b"> Expect: 100-continue" in done.stderr and b"< HTTP/1.1 100 Continue" in done.stderr, done.stderr
    assert b"< HTTP/1.1 200 OK" in done.stderr
    assert np.array_equal(np.array(json.loads(done.stdout)["outputs"][0]["data"], dtype=np.float32), values * 2)


@pytest.mark.server
def test_requests_in_turn_and_pipelined_on_one_connection(server: TritonServer, guard: HttpGuard) -> None:
    """One keep-alive connection: requests in turn (bodies and none; a streamed answer among them),
    then pipelined ones, the guard's own answer (a 400) in its place between two of Triton's."""
    stream = post("/v2/models/ticker/generate_stream", b'{"COUNT": 3, "DELAY": 0}')
    generate = post("/v2/models/ticker/generate", b'{"COUNT": 1, "DELAY": 0}')
    with connect(guard.port) as sock, sock.makefile("rb") as f:
        for request, check in [
            (GOOD, lambda body: json.loads(body)["outputs"][0]["data"] == [2.0, 5.0, -6.0]),
            (get("/v2/health/ready"), lambda body: body == b""),
            (stream, lambda body: body.count(b"data: ") == 3),
            (get("/v2/models/plain"), lambda body: json.loads(body)["name"] == "plain"),
            (generate, lambda body: json.loads(body)["INDEX"] == 0),
            (post("/v2/models/plain/infer", INFER_BODY, "Expect: 100-continue"), lambda body: b"outputs" in body),
        ]:
            sock.sendall(request)
            status, _, body = read_answer(f)
            if status == 100:
                status, _, body = read_answer(f)
            assert status == 200 and check(body), (request[:60], status, body[:200])
        sock.sendall(GOOD + post("/v2/models/plain/infer", deep(100)) + stream + get("/v2/health/ready") + GOOD)
        statuses = [read_answer(f)[0] for _ in range(5)]
        assert statuses == [200, 400, 200, 200, 200]
        sock.sendall(get("/v2/health/ready", "Connection: close"))
        assert read_answer(f)[0] == 200
        assert f.read(1) == b""  # Triton closed after it; so did the guard


@pytest.mark.server
def test_a_refusal_pipelined_behind_requests_follows_their_answers(server: TritonServer, guard: HttpGuard) -> None:
    """Requests pipelined before a refusal that closes are all answered, in order, the refusal last."""
    stream = post("/v2/models/ticker/generate_stream", b'{"COUNT": 3, "DELAY": 0.1}')
    with connect(guard.port) as sock, sock.makefile("rb") as f:
        sock.sendall(stream + GOOD + post("/v2/models/plain/infer", deep(100)) + GOOD + REFUSALS["chunked"][0] + GOOD)
        answers = [read_answer(f) for _ in range(5)]
        assert [status for status, _, _ in answers] == [200, 200, 400, 200, 411]
        assert answers[0][2].count(b"data: ") == 3
        assert f.read(1) == b""  # the GOOD after the refusal is not served


@pytest.mark.server
def test_triton_stalls_a_stream_that_a_pipelined_request_follows(server: TritonServer) -> None:
    """Why the guard holds a pipelined request until the answer before it has ended: sent straight
    to 2.51, a request behind a generate_stream stalls the stream (after its first event or before
    it). When a release stops doing so, this test fails: re-measure."""
    assert server.http_port is not None
    stream = post("/v2/models/ticker/generate_stream", b'{"COUNT": 3, "DELAY": 0}')
    with connect(server.http_port, timeout=3) as sock:
        sock.sendall(stream + GOOD)
        got = b""
        with contextlib.suppress(TimeoutError):
            while data := sock.recv(65536):
                got += data
    assert got.startswith(b"HTTP/1.1 200 ") and got.count(b"data: ") < 3 and b"0\r\n\r\n" not in got, got


@pytest.mark.server
def test_many_connections_at_once(server: TritonServer, guard: HttpGuard) -> None:
    errors: list[BaseException] = []

    def client() -> None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", guard.port, timeout=60)
            for _ in range(5):
                conn.request("POST", "/v2/models/plain/infer", body=INFER_BODY)
                answer = conn.getresponse()
                assert answer.status == 200 and json.loads(answer.read())["outputs"][0]["data"] == [2.0, 5.0, -6.0]
            conn.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client) for _ in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors[:3]
    deadline = time.monotonic() + 5
    while guard.connections() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert guard.connections() == 0


@pytest.mark.server
def test_clients_that_leave_at_any_time(server: TritonServer, guard: HttpGuard) -> None:
    """A client gone mid-head, mid-JSON (nothing was forwarded), mid-binary-body (part was) and
    mid-stream: its connections end on both sides, and Triton serves on."""
    binary_head = post(
        "/v2/models/plain/infer",
        b"",
        f"Inference-Header-Content-Length: {len(INFER_BODY)}",
        length=len(INFER_BODY) + 1000,
    )
    for partial in [
        b"POST /v2/models/plain/infer HTTP/1.1\r\nHost",
        post("/v2/models/plain/infer", INFER_BODY[:20], length=len(INFER_BODY)),
        binary_head + INFER_BODY + b"\0" * 10,
        post("/v2/models/ticker/generate_stream", b'{"COUNT": 5, "DELAY": 0.3}'),
    ]:
        with connect(guard.port) as sock:
            sock.sendall(partial)
            if b"generate_stream" in partial:
                assert b"data: " in sock.recv(4096) or b"data: " in sock.recv(4096)
            time.sleep(0.2)
    deadline = time.monotonic() + 5
    while guard.connections() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert guard.connections() == 0
    assert server.is_running()
    infer_ok(guard.port)


# -- cost -------------------------------------------------------------------------------------------


@pytest.mark.server
def test_the_guards_cost_per_event_and_per_request(server: TritonServer, guard: HttpGuard) -> None:
    """Measured, not asserted: the guard's CPU (its loop thread) per relayed SSE event and per
    request, and the client's time per event and per request, direct and through the guard."""
    import psutil

    assert server.http_port is not None and server.pid is not None
    triton = psutil.Process(server.pid)
    events, requests = 3000, 300
    lines = []
    for name, port in (("direct", server.http_port), ("guard", guard.port)):
        stream_events(port, 10, 0.0)  # warm
        cpu0, t0, tcpu0 = guard.cpu_seconds(), time.monotonic(), sum(triton.cpu_times()[:2])
        got = stream_events(port, events, 0.0)
        wall, cpu, tcpu = time.monotonic() - t0, guard.cpu_seconds() - cpu0, sum(triton.cpu_times()[:2]) - tcpu0
        assert len(got) == events + 1
        lines.append(
            f"SSE {name:6}: {wall / events * 1e6:6.1f} us/event at the client, tritonserver "
            f"{tcpu / events * 1e6:6.1f} us CPU/event, guard {cpu / events * 1e6:5.1f} us CPU/event"
        )
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v2/models/plain/infer", body=INFER_BODY)
        conn.getresponse().read()
        cpu0, t0, tcpu0 = guard.cpu_seconds(), time.monotonic(), sum(triton.cpu_times()[:2])
        for _ in range(requests):
            conn.request("POST", "/v2/models/plain/infer", body=INFER_BODY)
            answer = conn.getresponse()
            assert answer.status == 200
            answer.read()
        wall, cpu, tcpu = time.monotonic() - t0, guard.cpu_seconds() - cpu0, sum(triton.cpu_times()[:2]) - tcpu0
        conn.close()
        lines.append(
            f"infer {name:4}: {wall / requests * 1e6:6.0f} us/request at the client, tritonserver "
            f"{tcpu / requests * 1e6:6.0f} us CPU/request, guard {cpu / requests * 1e6:5.0f} us CPU/request"
        )
    print("\nHTTP guard cost (2 shared cores; tritonserver's CPU excludes its Python stubs):\n  " + "\n  ".join(lines))

"""An HTTP/1.1 front for tritonserver 2.51's HTTP endpoint: it refuses, before a byte reaches
Triton, the requests that 2.51's frontend cannot take safely, and relays everything else byte for
byte (``mmserve.triton_seam`` HTTP_FRONT_GUARD: ``TritonServer`` puts it on the HTTP port where the
release needs it).

Why: the CPU stack runs the ``tritonserver`` 2.51 of the nvidia-pytriton wheel (no newer wheel), and
its HTTP frontend predates the fixes of Triton 25.07 (2.59): CVE-2025-23310 and CVE-2025-23311. Its
handlers ``alloca`` an ``evbuffer_iovec`` per segment of the request body, and libevhtp adds a
segment per chunk of a chunked body: one unauthenticated ``POST /v2/models/<model>/infer`` with
``Transfer-Encoding: chunked`` and 600,000 one-byte chunks (3.6 MB) overflows the stack and kills the
server (measured). Its JSON handling recurses once per nesting level: a body nested 100,000 deep
kills it as well (measured; 2.59 caps the depth at 100). A body with a Content-Length is read into one
buffer reserved for the whole length at its first byte, which is safe in segments but makes the
length itself a memory reservation. The GPU image runs 2.62, which has the fixes; this front is for
the CPU stack only.

What is refused (a one-line JSON answer, ``{"error": "..."}``), and what becomes of the connection:

* any ``Transfer-Encoding`` (chunked or other): 411, send a Content-Length; closed.
* a request line and headers over ``MAX_HEAD_BYTES`` (64 KiB): 431; closed.
* a Content-Length over ``max_body_bytes`` (default 128 MiB: preprocess takes 64 MiB of media, and
  base64 in JSON adds a third): 413 at once, the body unread (Expect: 100-continue is answered with
  the 413 instead); closed.
* a JSON body nested deeper than ``max_json_depth`` (default 64), or whose brackets do not balance:
  400; the connection stays open. The JSON is the whole body, or its first
  ``Inference-Header-Content-Length`` bytes on ``/v2/models/<m>[/versions/<v>]/infer`` (the only
  path where Triton reads that header; the binary tensors after it are not scanned). The scan works
  on bytes (``json_depth_within``): strings and their escapes are taken out, and the brackets left
  must balance within the depth (one regular expression, linear); the JSON is never parsed.
* a ``Content-Encoding`` other than identity: 415; closed. Triton inflates gzip and deflate bodies on
  ``/infer`` before it parses them, so a compressed body cannot be scanned (nothing in this project
  compresses its requests).
* what would let this front and Triton frame a request differently (request smuggling): two
  Content-Length or Inference-Header-Content-Length headers, one that is not a plain number, bare CR
  or LF, obsolete line folding, control characters, a malformed request line: 400; an HTTP version
  other than 1.0 and 1.1: 505; an ``Expect`` other than 100-continue: 417; closed.
* ``HEAD``: 405 without a body, answered here (Triton 2.51 answers HEAD with a body, which no client
  can frame); the connection stays open.
* Triton unreachable: 502; closed.

What is relayed: everything else, byte for byte in both directions, on one upstream connection per
client connection, opened at its first relayed request: several requests in turn, each request's
head and body told apart by its Content-Length; a request's JSON held until scanned and then sent
with its head, the rest of its body as it arrives. A request pipelined behind another is held until
Triton's answer to that one has ended (2.51 mishandles pipelining: a request sent behind a
generate_stream stalls that stream, measured). ``Expect: 100-continue`` is answered here (once the
answers before it are out) and stripped. Answers come back as they arrive, unbuffered (streamed
generations' SSE events included); only their framing (Content-Length, chunked, or until close) is
followed, a few operations per answer or chunk, to know where each ends. When either side closes,
the other is closed; ``stop`` closes the listener and every connection.

The scan costs about 8 ns a byte of JSON in the worst case (a body of nothing but brackets: 1 s at
the 128 MiB maximum, on the guard's one thread); bodies with few brackets (base64 media, flat
tensors) cost two ``bytes.count``. A request's JSON is held in memory until scanned, as Triton holds
the whole body.

Triton then sees every client as 127.0.0.1. Its gRPC and metrics endpoints are not behind this front.

Library use::

    server = TritonServer(repo, http_port=internal_port)      # Triton's HTTP on 127.0.0.1 only
    guard = HttpGuard("0.0.0.0", 8000, internal_port).start()
    ...
    guard.stop()
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import re
import threading
import time
from collections.abc import Iterable

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_JSON_DEPTH",
    "MAX_HEAD_BYTES",
    "HttpGuard",
    "json_depth_within",
]

MAX_HEAD_BYTES = 64 * 1024
"""The longest request line and headers taken (the blank line that ends them included)."""
DEFAULT_MAX_BODY_BYTES = 128 * 1024 * 1024
"""The largest Content-Length taken by default: preprocess's 64 MiB of media as base64 in JSON."""
DEFAULT_MAX_JSON_DEPTH = 64
"""The deepest JSON nesting taken by default (Triton 2.59 takes 100; this project's requests nest 4)."""
LINGER_S = 2.0
"""After a refusal that closes the connection, how long what the client still sends is read and
dropped, so that it reads the answer rather than a reset."""
PENDING_HIGH_BYTES = 1 << 20
"""Bytes held for an upstream connection still being opened beyond which the client is not read."""
MERGED_SEND_BYTES = 64 * 1024
"""A request's JSON up to this size is sent together with its head (one copy, one send fewer)."""
MAX_RESPONSE_HEAD_BYTES = 1 << 20
"""Triton's answer heads are a few hundred bytes: a longer one is a broken upstream."""

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_REQUEST_LINE = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+) ([\x21-\x7e]+) HTTP/(\d)\.(\d)")
_CTL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
"""Control characters, but for HTAB and the CR LF that end lines (checked apart)."""
_DIGITS = re.compile(rb"[0-9]+")
_INFER_TARGET = re.compile(rb"/v2/models/[^/?#]+(?:/versions/[0-9]+)?/infer(?:\?[^#]*)?")
"""A target on which Triton reads ``Inference-Header-Content-Length`` (its ``model_regex_``, kind
``infer``); on any other the whole body is scanned, as Triton parses all of it."""

_REASONS = {
    400: "Bad Request",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    417: "Expectation Failed",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
    505: "HTTP Version Not Supported",
}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


# --------------------------------------------------------------------------------------------------
# The JSON depth scan

_TO_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
MAX_JSON_DEPTH_LIMIT = 256
"""The deepest limit ``json_depth_within`` takes (its pattern nests one group per level)."""


@functools.lru_cache(maxsize=8)
def _balanced_within(limit: int) -> re.Pattern[bytes]:
    """Brackets that balance, nested at most ``limit`` deep: ``(?:\\[ ... \\])*+``, ``limit`` groups
    one inside the other. Possessive: never backtracks, linear in the bytes (about 6 ns a byte)."""
    pattern = b""
    for _ in range(limit):
        pattern = rb"(?:\[" + pattern + rb"\])*+"
    return re.compile(pattern)


def json_depth_within(data: bytes, limit: int) -> bool:
    """Whether the JSON ``data`` nests arrays and objects at most ``limit`` deep (at most
    ``MAX_JSON_DEPTH_LIMIT``), judged on its bytes without parsing it, with ``bytes`` operations and
    one regular expression (no Python loop over the bytes).

    Escaped backslashes, then escaped quotes, are taken out; the quotes left delimit the strings,
    which are dropped; of what remains only the brackets are kept, ``{}`` as ``[]``, and they must
    balance within ``limit`` levels (``_balanced_within``). Brackets that do not balance are refused
    as too deep unless there are at most ``limit`` of them. Invalid JSON may be judged either way
    where it makes no difference to Triton: its parser stops at the first error, and up to there the
    JSON is valid and judged exactly.
    """
    if data.count(b"[") + data.count(b"{") <= limit:
        return True  # no deeper than its brackets, counted in strings or not
    if b"\\" in data:
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    skeleton = b"".join(data.split(b'"')[::2]).translate(_TO_BRACKETS, _NOT_BRACKETS)
    return _balanced_within(limit).fullmatch(skeleton) is not None


# --------------------------------------------------------------------------------------------------
# Requests


class _Refusal(Exception):
    """A request answered here: ``status`` and ``message``; ``close``: the connection ends after it."""

    def __init__(self, status: int, message: str, *, close: bool = True, headers: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.status, self.message, self.close, self.headers = status, message, close, tuple(headers)


def _answer(status: int, message: str, *, close: bool, headers: Iterable[str] = (), body: bool = True) -> bytes:
    payload = json.dumps({"error": message}).encode()
    lines = [
        f"HTTP/1.1 {status} {_REASONS[status]}",
        "Content-Type: application/json",
        f"Content-Length: {len(payload)}",
        *headers,
    ]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (payload if body else b"")


class _Request:
    """A request head that passed the checks: what to forward and how its body is read."""

    __slots__ = ("head", "length", "json_length", "expect_continue", "keep_alive", "is_head")

    def __init__(self, head: bytes, max_body_bytes: int) -> None:
        text = head[:-4]
        crlf = text.count(b"\r\n")
        if text.count(b"\r") != crlf or text.count(b"\n") != crlf:
            raise _Refusal(400, "bare CR or LF in the request head: lines end with CRLF")
        if _CTL.search(text):
            raise _Refusal(400, "control character in the request head")
        lines = text.split(b"\r\n")
        line = _REQUEST_LINE.fullmatch(lines[0])
        if line is None:
            raise _Refusal(400, "malformed request line: METHOD SP target SP HTTP/1.1 expected")
        method, target, major, minor = line.groups()
        if (major, minor) not in ((b"1", b"1"), (b"1", b"0")):
            raise _Refusal(505, f"HTTP/{major.decode()}.{minor.decode()} is not served: HTTP/1.1 or 1.0")
        found: dict[bytes, list[bytes]] = {}
        for raw in lines[1:]:
            if raw[:1] in (b" ", b"\t"):
                raise _Refusal(400, "obsolete line folding in the request head")
            name, colon, value = raw.partition(b":")
            if not colon or _TOKEN.fullmatch(name) is None:
                raise _Refusal(400, f"malformed header line {raw[:40]!r}")
            found.setdefault(name.lower(), []).append(value.strip(b" \t"))

        if b"transfer-encoding" in found:
            raise _Refusal(
                411,
                "Transfer-Encoding is not accepted (Triton 2.51 crashes on chunked request bodies: "
                "CVE-2025-23310/23311): send the body with a Content-Length",
            )
        self.length = self._number(found, b"content-length", "Content-Length")
        if self.length > max_body_bytes:
            raise _Refusal(413, f"Content-Length {self.length} exceeds the maximum of {max_body_bytes} bytes")
        encodings = found.get(b"content-encoding", [])
        if len(encodings) > 1 or (encodings and encodings[0] not in (b"", b"identity")):
            raise _Refusal(
                415,
                f"Content-Encoding {b', '.join(encodings).decode(errors='replace')} is not accepted: "
                "send the body uncompressed",
                headers=["Accept-Encoding: identity"],
            )
        self.json_length = self.length
        if b"inference-header-content-length" in found and _INFER_TARGET.fullmatch(target):
            self.json_length = self._number(
                found, b"inference-header-content-length", "Inference-Header-Content-Length"
            )
            if self.json_length > self.length:
                raise _Refusal(
                    400, f"Inference-Header-Content-Length {self.json_length} exceeds Content-Length {self.length}"
                )
        expects = [value.lower() for value in found.get(b"expect", [])]
        if any(value != b"100-continue" for value in expects):
            raise _Refusal(417, "only Expect: 100-continue is served")
        self.expect_continue = bool(expects)
        tokens = {t.strip().lower() for value in found.get(b"connection", []) for t in value.split(b",")}
        self.keep_alive = b"close" not in tokens and (minor == b"1" or b"keep-alive" in tokens)
        self.is_head = method == b"HEAD"
        if self.expect_continue:  # answered here: Triton must not answer it too
            head = b"\r\n".join(raw for raw in lines if raw.split(b":", 1)[0].strip().lower() != b"expect")
            head += b"\r\n\r\n"
        self.head = head

    @staticmethod
    def _number(found: dict[bytes, list[bytes]], key: bytes, name: str) -> int:
        values = found.get(key)
        if not values:
            return 0
        if len(values) > 1:
            raise _Refusal(400, f"{len(values)} {name} headers: one is taken")
        if _DIGITS.fullmatch(values[0]) is None:
            raise _Refusal(400, f"{name} {values[0][:40]!r} is not a number")
        digits = values[0].lstrip(b"0") or b"0"
        return int(digits) if len(digits) <= 18 else 1 << 62  # beyond any limit, without int()'s cost


# --------------------------------------------------------------------------------------------------
# Answers: where each of Triton's ends


class _BrokenUpstream(Exception):
    pass


class _Framer:
    """Follows the framing of Triton's answers on one connection: ``feed`` says where the current
    answer ends. Per answer it reads the head; per chunk of a chunked answer, its size line; the
    bytes in between are only counted."""

    __slots__ = ("state", "left", "buf")

    HEAD, LENGTH, CHUNK_SIZE, CHUNK_DATA, TRAILER, UNTIL_CLOSE = range(6)

    def __init__(self) -> None:
        self.state = self.HEAD
        self.left = 0
        self.buf = bytearray()

    def feed(self, data: bytes, pos: int) -> int:
        """The offset in ``data`` just past the end of the answer that ``data[pos:]`` continues;
        -1 if it goes on beyond ``data``."""
        n = len(data)
        while pos < n:
            state = self.state
            if state == self.CHUNK_DATA or state == self.LENGTH:
                if n - pos < self.left:
                    self.left -= n - pos
                    return -1
                pos += self.left
                self.left = 0
                if state == self.LENGTH:
                    self.state = self.HEAD
                    return pos
                self.state = self.CHUNK_SIZE
            elif state == self.UNTIL_CLOSE:
                return -1
            elif state == self.HEAD:
                found = self._through(data, pos, b"\r\n\r\n", MAX_RESPONSE_HEAD_BYTES)
                if found is None:
                    return -1
                head, pos = found
                if self._head(head):
                    return pos
            else:  # CHUNK_SIZE, TRAILER: a line
                found = self._through(data, pos, b"\r\n", 4096)
                if found is None:
                    return -1
                line, pos = found
                if state == self.TRAILER:
                    if not line:
                        self.state = self.HEAD
                        return pos
                    continue
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise _BrokenUpstream(f"chunk size line {line[:40]!r}") from None
                if size:
                    self.state, self.left = self.CHUNK_DATA, size + 2  # the data and its CRLF
                else:
                    self.state = self.TRAILER
        return -1

    def _through(self, data: bytes, pos: int, end: bytes, limit: int) -> tuple[bytes, int] | None:
        """What precedes the next ``end`` and the offset in ``data`` after it; None (the part
        kept) if ``end`` is not in ``data`` yet."""
        buf = self.buf
        if not buf:
            i = data.find(end, pos)
            if i >= 0:
                return data[pos:i], i + len(end)
            buf += data[pos:]
        else:
            kept = len(buf)
            buf += data[pos:]
            i = buf.find(end, max(kept - len(end) + 1, 0))
            if i >= 0:
                found = bytes(buf[:i])
                buf.clear()
                return found, pos + i + len(end) - kept
        if len(buf) > limit:
            raise _BrokenUpstream(f"no {end!r} within {limit} bytes")
        return None

    def _head(self, head: bytes) -> bool:
        """Take an answer's head; True if the answer ends with it."""
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            raise _BrokenUpstream(f"status line {lines[0][:60]!r}")
        status = int(parts[1])
        if status == 101:
            raise _BrokenUpstream("a protocol switch (101) is not relayed")
        if status < 200:
            return False  # interim: the final head follows
        chunked, length = False, None
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding":
                chunked = True
            elif name == b"content-length":
                if not value.strip().isdigit():
                    raise _BrokenUpstream(f"Content-Length {value[:40]!r}")
                length = int(value.strip())
        if status in (204, 304):
            return True
        if chunked:
            self.state = self.CHUNK_SIZE
        elif length is not None:
            if length == 0:
                return True
            self.state, self.left = self.LENGTH, length
        else:
            self.state = self.UNTIL_CLOSE
        return False


# --------------------------------------------------------------------------------------------------
# Connections


class _Held:
    """A request read and checked, held until Triton's answer to the one before has ended."""

    __slots__ = ("parts", "released")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.released = False


class _Local:
    """An answer of this front, queued in its place among Triton's."""

    __slots__ = ("data", "close", "cancelled")

    def __init__(self, data: bytes, close: bool) -> None:
        self.data, self.close, self.cancelled = data, close, False


_UPSTREAM = object()
"""A queue entry: an answer that Triton gives."""

_HEAD, _JSON, _BODY, _SKIP, _IGNORE, _REFUSED = range(6)
"""Reading a request head; its JSON (held); the rest of its body (relayed); the body of a request
answered here (dropped); nothing more (the last request was sent); anything (a refusal closes)."""


class _Upstream(asyncio.Protocol):
    """Triton's side of a connection: answers relayed as they arrive."""

    __slots__ = ("conn", "framer")

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn
        self.framer = _Framer()

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        write = conn.transport.write
        pos, n = 0, len(data)
        try:
            while True:
                end = self.framer.feed(data, pos)
                if end < 0:
                    write(data if pos == 0 else data[pos:])
                    return
                write(data if pos == 0 and end == n else data[pos:end])
                conn.answer_done()
                pos = end
                if pos >= n or conn.up is None:
                    return
        except _BrokenUpstream as exc:
            logger.warning("tritonserver's answer cannot be framed (%s): connection closed", exc)
            conn.close(abort=True)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.upstream_lost(self)

    def pause_writing(self) -> None:
        self.conn.pause_reading("upstream")

    def resume_writing(self) -> None:
        self.conn.resume_reading("upstream")


class _Connection(asyncio.Protocol):
    """A client's connection: requests read, checked and forwarded; answers put in order."""

    def __init__(self, guard: HttpGuard) -> None:
        self.guard = guard
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set at connection_made
        self.up: asyncio.Transport | None = None
        self.upstream: _Upstream | None = None
        self.connecting = False
        self.pending: list[bytes] = []  # for an upstream connection being opened
        self.pending_bytes = 0
        self.current = _Held()  # the request being read
        self.waiting: collections.deque[_Held] = collections.deque()  # read, not yet relayed
        self.held_bytes = 0
        self.answering = False  # Triton has a request whose answer has not ended
        self.state = _HEAD
        self.buf = bytearray()
        self.request: _Request | None = None
        self.parts: list[bytes] = []
        self.left = 0  # bytes of the JSON (_JSON) or of the body (_BODY, _SKIP) still to come
        self.rest = 0  # bytes of the body after the JSON
        self.queue: collections.deque[object] = collections.deque()
        self.continue_entry: _Local | None = None
        self.paused: set[str] = set()
        self.client_paused = False  # the client's side is full: Triton is not read
        self.last_sent = False  # no request follows
        self.client_eof = False
        self.linger: asyncio.TimerHandle | None = None
        self.closed = False
        self.peer = "?"

    # -- the client's side ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.guard._connections.add(self)

    def data_received(self, data: bytes) -> None:
        while data:
            state = self.state
            if state == _BODY:
                left = self.left
                if len(data) <= left:
                    self.left = left - len(data)
                    self.to_upstream(data)
                    if not self.left:
                        self.request_done()
                    return
                self.to_upstream(data[:left])
                data = data[left:]
                self.left = 0
                self.request_done()
            elif state == _HEAD:
                data = self.read_head(data)
            elif state == _JSON:
                data = self.read_json(data)
            elif state == _SKIP:
                if len(data) < self.left:
                    self.left -= len(data)
                    return
                data = data[self.left :]
                self.left = 0
                self.request_done()
            else:  # _IGNORE, _REFUSED
                return

    def read_head(self, data: bytes) -> bytes:
        buf = self.buf
        if not buf:
            data = data.lstrip(b"\r\n")  # empty lines between requests are ignored (RFC 9112 2.2)
            if not data:
                return b""
            end = data.find(b"\r\n\r\n")
            if end >= 0 and end + 4 <= MAX_HEAD_BYTES:
                self.begin(data[: end + 4])
                return data[end + 4 :]
            start = 0
        else:
            start = max(len(buf) - 3, 0)
        buf += data
        end = buf.find(b"\r\n\r\n", start)
        if end < 0 or end + 4 > MAX_HEAD_BYTES:
            if end >= 0 or len(buf) >= MAX_HEAD_BYTES:
                self.buf = bytearray()
                self.refuse(_Refusal(431, f"the request line and headers exceed {MAX_HEAD_BYTES} bytes"))
            return b""
        head, rest = bytes(buf[: end + 4]), bytes(buf[end + 4 :])
        self.buf = bytearray()
        self.begin(head)
        return rest

    def begin(self, head: bytes) -> None:
        try:
            request = _Request(head, self.guard.max_body_bytes)
        except _Refusal as refusal:
            self.refuse(refusal)
            return
        self.request = request
        if request.is_head:
            self.refuse(_Refusal(405, "HEAD is not served", close=False, headers=["Allow: GET, POST"]), body=False)
            self.skip(request.length)
            return
        if request.expect_continue and request.length:
            self.continue_entry = _Local(_CONTINUE, close=False)
            self.queue.append(self.continue_entry)
            self.flush()
        if request.json_length:
            self.state, self.left, self.rest = _JSON, request.json_length, request.length - request.json_length
            self.parts = []
        else:
            self.forward(request.head)
            self.body(request.length)

    def read_json(self, data: bytes) -> bytes:
        self.body_started()
        if len(data) < self.left:
            self.parts.append(data)
            self.left -= len(data)
            return b""
        self.parts.append(data[: self.left])
        data = data[self.left :]
        document = b"".join(self.parts)
        self.parts = []
        request = self.request
        assert request is not None
        limit = self.guard.max_json_depth
        if not json_depth_within(document, limit):
            self.refuse(
                _Refusal(
                    400,
                    f"the request's JSON nests deeper than {limit} levels, or its brackets do not balance",
                    close=False,
                )
            )
            self.skip(self.rest)
        else:
            self.forward(request.head, document)
            self.body(self.rest)
        return data

    def body(self, length: int) -> None:
        if length:
            self.state, self.left = _BODY, length
        else:
            self.request_done()

    def skip(self, length: int) -> None:
        if length:
            self.state, self.left = _SKIP, length
        else:
            self.request_done()

    def body_started(self) -> None:
        if self.continue_entry is not None:  # the client did not wait for it: none is sent
            self.continue_entry.cancelled = True
            self.continue_entry = None

    def request_done(self) -> None:
        self.continue_entry = None
        request, self.request = self.request, None
        if self.state == _REFUSED:
            return
        if request is not None and not request.keep_alive:
            self.state = _IGNORE
            self.last_sent = True
            self.flush()
        else:
            self.state = _HEAD

    def eof_received(self) -> bool:
        self.client_eof = True
        if self.state == _REFUSED:
            return any(isinstance(e, _Local) and e.close for e in self.queue)  # its refusal still to go out
        if (self.state == _HEAD and not self.buf) or self.state == _IGNORE:
            self.state = _IGNORE
            self.last_sent = True
            return bool(self.queue)  # answers still to come: kept open for them
        return False  # within a request: it will not be complete

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.linger is not None:
            self.linger.cancel()
        self.guard._connections.discard(self)
        self.close_upstream(abort=True)

    def pause_writing(self) -> None:
        self.client_paused = True
        if self.up is not None:
            self.up.pause_reading()

    def resume_writing(self) -> None:
        self.client_paused = False
        if self.up is not None:
            self.up.resume_reading()

    # -- reading pauses ------------------------------------------------------------------------
    def pause_reading(self, why: str) -> None:
        if self.state != _REFUSED and not self.closed:
            self.paused.add(why)
            self.transport.pause_reading()

    def resume_reading(self, why: str) -> None:
        self.paused.discard(why)
        if not self.paused and not self.closed:
            self.transport.resume_reading()

    # -- upstream ------------------------------------------------------------------------------
    def forward(self, head: bytes, document: bytes = b"") -> None:
        """Relay the current request: now if Triton's answer to the one before has ended, else once
        it has (Triton 2.51 mishandles pipelined requests: one sent behind a generate_stream stalls
        that stream)."""
        self.queue.append(_UPSTREAM)
        self.current = request = _Held()
        self.waiting.append(request)
        if len(document) <= MERGED_SEND_BYTES:
            self.to_upstream(head + document)  # one send
        else:
            self.to_upstream(head)
            self.to_upstream(document)
        self.release()

    def to_upstream(self, data: bytes) -> None:
        """The current request's bytes: to Triton, or held while the answer before it goes on."""
        current = self.current
        if current.released:
            self.write_upstream(data)
            return
        current.parts.append(data)
        self.held_bytes += len(data)
        if self.held_bytes > PENDING_HIGH_BYTES:
            self.pause_reading("held")

    def release(self) -> None:
        """Relay the next request held, if Triton is answering none."""
        while self.waiting and not self.answering:
            request = self.waiting.popleft()
            request.released = self.answering = True
            for data in request.parts:
                self.held_bytes -= len(data)
                self.write_upstream(data)
            request.parts = []
        if self.held_bytes <= PENDING_HIGH_BYTES:
            self.resume_reading("held")

    def write_upstream(self, data: bytes) -> None:
        if self.up is not None:
            self.up.write(data)
            return
        self.pending.append(data)
        self.pending_bytes += len(data)
        if self.pending_bytes > PENDING_HIGH_BYTES:
            self.pause_reading("connecting")
        if not self.connecting:
            self.connecting = True
            asyncio.get_running_loop().create_task(self.connect())

    async def connect(self) -> None:
        guard = self.guard
        loop = asyncio.get_running_loop()
        try:
            transport, upstream = await loop.create_connection(
                lambda: _Upstream(self), guard.upstream_host, guard.upstream_port
            )
        except OSError as exc:
            logger.warning("tritonserver at %s:%s unreachable: %s", guard.upstream_host, guard.upstream_port, exc)
            if not self.closed:
                self.queue.clear()
                self.refuse(_Refusal(502, f"tritonserver unreachable: {exc.strerror or exc}"))
            return
        if self.closed:
            transport.abort()
            return
        assert isinstance(transport, asyncio.Transport)
        self.up, self.upstream = transport, upstream
        pending, self.pending, self.pending_bytes = self.pending, [], 0
        for data in pending:
            transport.write(data)
        if self.client_paused:
            transport.pause_reading()
        self.resume_reading("connecting")

    def upstream_lost(self, upstream: _Upstream) -> None:
        if upstream is not self.upstream:
            return
        self.up = self.upstream = None
        if upstream.framer.state == _Framer.UNTIL_CLOSE:
            self.answer_done()
        elif self.queue and self.queue[0] is _UPSTREAM:
            self.queue.popleft()  # cut short: the client sees the connection end
        self.flush()
        self.close()

    def close_upstream(self, *, abort: bool = False) -> None:
        up, self.up, self.upstream = self.up, None, None
        if up is not None:
            up.abort() if abort else up.close()

    # -- answers -------------------------------------------------------------------------------
    def answer_done(self) -> None:
        if self.queue and self.queue[0] is _UPSTREAM:
            self.queue.popleft()
        self.answering = False
        self.flush()
        if not self.closed:
            self.release()  # requests read before a refusal are still answered

    def flush(self) -> None:
        """Send this front's answers that are next in line; close when nothing more is to come."""
        queue = self.queue
        while queue and queue[0] is not _UPSTREAM:
            entry = queue.popleft()
            assert isinstance(entry, _Local)
            if entry.cancelled or self.closed:
                continue
            self.transport.write(entry.data)
            if entry.close:
                self.refused()
                return
        if not queue and self.last_sent and not self.closed:
            self.close()

    def refuse(self, refusal: _Refusal, *, body: bool = True) -> None:
        self.guard._refused(refusal, self.peer)
        answer = _answer(refusal.status, refusal.message, close=refusal.close, headers=refusal.headers, body=body)
        self.queue.append(_Local(answer, refusal.close))
        if refusal.close:
            self.state = _REFUSED
            self.continue_entry = None
            self.paused.clear()
            if not self.closed:
                self.transport.resume_reading()  # what follows is read and dropped
        self.flush()

    def refused(self) -> None:
        """A closing refusal is out: Triton's side goes; the client's, once it has read it."""
        self.state = _REFUSED
        self.queue.clear()
        self.waiting.clear()
        self.close_upstream()
        transport = self.transport
        if self.client_eof or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self.linger = asyncio.get_running_loop().call_later(LINGER_S, transport.abort)

    def close(self, *, abort: bool = False) -> None:
        if not self.closed:
            self.transport.abort() if abort else self.transport.close()
        self.close_upstream(abort=abort)


# --------------------------------------------------------------------------------------------------
# The front


class HttpGuard:
    """The front: listens on ``listen_host:listen_port`` (0: a free port, then in ``port``) and
    relays to tritonserver's HTTP endpoint at ``upstream_host:upstream_port``, refusing what the
    module's docstring lists. ``start`` runs its event loop on a daemon thread and returns once it
    listens; ``stop`` closes the listener and every connection.

    Args:
        max_body_bytes: the largest Content-Length taken (413 beyond).
        max_json_depth: the deepest JSON nesting taken (400 beyond).
    """

    def __init__(
        self,
        listen_host: str,
        listen_port: int,
        upstream_port: int,
        *,
        upstream_host: str = "127.0.0.1",
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_json_depth: int = DEFAULT_MAX_JSON_DEPTH,
    ) -> None:
        if max_body_bytes < 0 or not 1 <= max_json_depth <= MAX_JSON_DEPTH_LIMIT:
            raise ValueError(
                f"max_body_bytes {max_body_bytes}: 0 or more; max_json_depth {max_json_depth}: 1 to {MAX_JSON_DEPTH_LIMIT}"
            )
        self.listen_host, self.port = listen_host, listen_port
        self.upstream_host, self.upstream_port = upstream_host, upstream_port
        self.max_body_bytes, self.max_json_depth = max_body_bytes, max_json_depth
        self.refusals: collections.Counter[int] = collections.Counter()
        """Requests refused since the start, by status."""
        self._connections: set[_Connection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        """``127.0.0.1:<port>`` (tritonclient's form), for a front that listens on every address or loopback."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> HttpGuard:
        """Listen; raise the OSError of the bind (a port taken) or TimeoutError."""
        if self._thread is not None:
            return self
        self._ready.clear()
        self._error = None
        self._thread = threading.Thread(target=self._run, name=f"http-guard-{self.port}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the HTTP guard did not listen within {timeout} s")
        if self._error is not None:
            self._thread.join()
            self._thread = None
            raise self._error
        logger.info("HTTP guard on %s:%s -> %s:%s", self.listen_host, self.port, self.upstream_host, self.upstream_port)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Close the listener and every connection (in-flight answers are cut); idempotent."""
        thread, loop, stopping = self._thread, self._loop, self._stopping
        if thread is None:
            return
        if loop is not None and stopping is not None:
            try:
                loop.call_soon_threadsafe(stopping.set)
            except RuntimeError:  # the loop has ended already
                pass
        thread.join(timeout)
        self._thread = None

    def cpu_seconds(self) -> float:
        """CPU time its event loop's thread has used (Linux; 0.0 when not running)."""
        thread = self._thread
        if thread is None or thread.ident is None:
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, AttributeError):
            return 0.0

    def connections(self) -> int:
        """Client connections open now."""
        return len(self._connections)

    def __enter__(self) -> HttpGuard:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "listening" if self._thread is not None else "stopped"
        return f"HttpGuard({self.listen_host}:{self.port} -> {self.upstream_host}:{self.upstream_port}, {state})"

    # ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported by start(), or logged
            if not self._ready.is_set():
                self._error = exc
                self._ready.set()
            else:
                logger.exception("the HTTP guard's loop failed")

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop, self._stopping = loop, asyncio.Event()
        server = await loop.create_server(
            lambda: _Connection(self), self.listen_host, self.port, backlog=1024, reuse_address=True
        )
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            await self._stopping.wait()
        finally:
            server.close()
            for conn in list(self._connections):
                conn.close(abort=True)
            for _ in range(3):  # the transports' connection_lost callbacks
                await asyncio.sleep(0)

    def _refused(self, refusal: _Refusal, peer: str) -> None:
        self.refusals[refusal.status] += 1
        logger.info("HTTP guard: %s refused (%s): %s", peer, refusal.status, refusal.message)

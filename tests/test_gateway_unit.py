"""The OpenAI gateway without a server: request validation, the conversion to Triton tensors, the
logprobs mapping, the error mapping, and the app's HTTP answers with a fake Triton backend (the
official ``openai`` SDK as the client). The live tests: test_openai.py."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import ipaddress
import json
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmserve import wire
from mmserve.gateway import app as app_module
from mmserve.gateway import convert, errors, protocol
from mmserve.gateway.app import GatewayConfig, create_app
from mmserve.gateway.triton import Delta, delta_from
from mmserve_dev.samples import WEATHER_TOOL

PNG = b"\x89PNG\r\n\x1a\n fake image"
WAV = b"RIFF\x00\x00\x00\x00WAVEfmt fake audio"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def image(data: bytes = PNG) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(data)}"}}


def audio(data: bytes = WAV, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}


def body(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "mm_ensemble", "messages": list(messages), **fields}


def user(*parts: Any) -> dict[str, Any]:
    return {"role": "user", "content": parts[0] if len(parts) == 1 and isinstance(parts[0], str) else list(parts)}


def convert_body(data: dict[str, Any], **kwargs: Any) -> convert.Conversation:
    return asyncio.run(convert.conversation(protocol.parse_request(data), **kwargs))


def rejected(data: Any, **kwargs: Any) -> errors.APIError:
    with pytest.raises(errors.APIError) as info:
        convert_body(data, **kwargs)
    assert info.value.status == 400
    return info.value


# -- remote media ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("192.168.0.1", False),
        ("169.254.169.254", False),  # cloud metadata
        ("100.64.0.1", False),
        ("0.0.0.0", False),
        ("::1", False),
        ("fc00::1", False),
        ("fe80::1%eth0", False),
        ("::ffff:127.0.0.1", False),
        ("224.0.0.1", False),
        ("::ffff:8.8.8.8", True),  # an IPv6 form of a public IPv4 address: judged as that address
        ("64:ff9b::808:808", True),  # NAT64 to 8.8.8.8
        ("::808:808", True),  # IPv4-compatible 8.8.8.8
        ("64:ff9b::a00:1", False),  # NAT64 to 10.0.0.1
        ("64:ff9b:1::808:808", False),  # local-use NAT64: the site's own translator
        ("2002:a9fe:a9fe::1", False),  # 6to4 to 169.254.169.254
        ("2001:0:4136:e378:8000:63bf:f5ff:fffe", False),  # Teredo, client 10.0.0.1
        ("::ffff:0:a00:1", False),  # IPv4-translated 10.0.0.1
        ("::", False),
        ("fec0::1", False),  # site-local
        ("ff02::1", False),
    ],
)
def test_only_public_addresses_count_as_public(address, public):
    from mmserve.gateway.media import is_public

    assert is_public(address) is public


def _fetch_from_a_local_server(**fetcher_kwargs: Any) -> dict[str, Any]:
    """Fetch a few paths of an HTTP server on 127.0.0.1 (``/a.wav``: bytes, ``/to/<path>``: a redirect
    to ``<path>`` on this server, ``/to-localhost``: a redirect to the same file by name, ``/loop``:
    redirects forever) with a ``MediaFetcher``; what each fetch gave (bytes or the error's code)."""
    from aiohttp import web

    from mmserve.gateway.media import MediaFetcher

    async def run() -> dict[str, Any]:
        app = web.Application()
        port = 0

        async def media(request: web.Request) -> web.Response:
            return web.Response(body=b"RIFF-audio")

        async def redirect(request: web.Request) -> web.Response:
            raise web.HTTPFound("/" + request.match_info["path"])

        async def to_localhost(request: web.Request) -> web.Response:
            raise web.HTTPFound(f"http://localhost:{port}/a.wav")

        async def loop(request: web.Request) -> web.Response:
            raise web.HTTPFound("/loop")

        app.add_routes(
            [
                web.get("/a.wav", media),
                web.get("/to/{path}", redirect),
                web.get("/to-localhost", to_localhost),
                web.get("/loop", loop),
            ]
        )
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        fetcher = MediaFetcher(1000, 5.0, **fetcher_kwargs)
        results: dict[str, Any] = {}
        try:
            for name, url in {
                "ip": f"http://127.0.0.1:{port}/a.wav",
                "name": f"http://localhost:{port}/a.wav",
                "redirect": f"http://127.0.0.1:{port}/to/a.wav",
                "redirect to a name": f"http://127.0.0.1:{port}/to-localhost",
                "loop": f"http://127.0.0.1:{port}/loop",
            }.items():
                try:
                    results[name] = await fetcher(url, "p")
                except errors.APIError as exc:
                    assert exc.status == 400 and exc.param == "p" and exc.message.startswith("p: ")
                    results[name] = exc.code
        finally:
            await fetcher.close()
            await runner.cleanup()
        return results

    return asyncio.run(run())


def test_remote_media_come_from_public_hosts_only():
    """Even with remote media allowed, a URL that names or resolves to a loopback address (here: the
    test's own server) is refused, as the address the connection would use."""
    refused = "media_address_not_allowed"
    assert _fetch_from_a_local_server() == {
        "ip": refused,
        "name": refused,  # localhost: refused after resolution
        "redirect": refused,
        "redirect to a name": refused,
        "loop": refused,
    }


def test_private_hosts_allowed_and_redirects_checked_against_the_domains():
    data = b"RIFF-audio"
    assert _fetch_from_a_local_server(allow_private=True) == {
        "ip": data,
        "name": data,
        "redirect": data,
        "redirect to a name": data,
        "loop": "media_fetch_failed",  # more than 3 redirects
    }
    assert _fetch_from_a_local_server(allow_private=True, allowed_domains=["127.0.0.1"]) == {
        "ip": data,
        "name": "media_domain_not_allowed",
        "redirect": data,
        "redirect to a name": "media_domain_not_allowed",  # the redirect's host is checked too
        "loop": "media_fetch_failed",
    }


# -- hostile media URLs: the address connected to is the one checked --------------------------------
MEDIA = b"\x89PNG fetched from the stand-in"
PUBLIC_IP = "93.184.215.14"  # a global address; the test network routes it to a local stand-in


class Listener:
    """A stand-in HTTP server on a loopback address that counts the TCP connections it accepts (each
    answer closes its connection: one fetch, one connection) and the most open at once:
    ``/a.png`` answers ``MEDIA``, ``/slow.png`` too after ``SLOW_S``, ``/go?<url>`` redirects to
    the percent-decoded ``<url>`` (its UTF-8 bytes in ``Location``, as a hostile server may send them)."""

    SLOW_S = 0.5

    def __init__(self, host: str = "127.0.0.1") -> None:
        import socketserver
        import threading

        listener = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                listener._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            daemon_threads = True

        self.lock = threading.Lock()
        self.connections = self.open = self.most_open = 0
        self.server = Server((host, 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def _serve(self, conn: socket.socket) -> None:
        import time
        import urllib.parse

        with self.lock:
            self.connections += 1
            self.open += 1
            self.most_open = max(self.most_open, self.open)
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                data += chunk
            target = data.split(b" ", 2)[1].decode("latin-1")
            content = b""
            if target.startswith("/go?"):
                head = b"HTTP/1.1 302 Found\r\nLocation: " + urllib.parse.unquote(target[4:]).encode()
            elif target in ("/a.png", "/slow.png"):
                if target == "/slow.png":
                    time.sleep(self.SLOW_S)
                head, content = b"HTTP/1.1 200 OK\r\nContent-Type: image/png", MEDIA
            else:
                head = b"HTTP/1.1 404 Not Found"
            conn.sendall(head + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(content) + content)
        finally:
            with self.lock:
                self.open -= 1

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listener():
    """``listener(host="127.0.0.1")``: a started ``Listener``, closed after the test."""
    made: list[Listener] = []

    def make(host: str = "127.0.0.1") -> Listener:
        made.append(Listener(host))
        return made[-1]

    yield make
    for each in made:
        each.close()


@pytest.fixture
def network(monkeypatch):
    """The network beyond the gateway's host, stood in for: ``routes[address] = "127.0.0.1"`` makes a
    connection to ``address`` reach 127.0.0.1 instead (as a NAT64 translator, a 6to4 or Teredo relay,
    or a router of the gateway's network would deliver it); a connection to any other address that
    is not loopback is refused, so that no test leaves the machine. Patched under every asyncio
    selector loop's ``sock_connect``, where aiohttp's connections are made: below every check of
    the gateway."""
    from asyncio import selector_events

    routes: dict[str, str] = {}
    connect = selector_events.BaseSelectorEventLoop.sock_connect

    async def routed(self: Any, sock: socket.socket, address: Any) -> Any:
        ip = ipaddress.ip_address(str(address[0]).split("%", 1)[0])
        target = routes.get(str(ip))
        if target is not None:
            address = (target, address[1]) if sock.family == socket.AF_INET else (f"::ffff:{target}", *address[1:])
        elif not (ip.is_loopback or getattr(ip, "ipv4_mapped", None) in ipaddress.ip_network("127.0.0.0/8")):
            raise ConnectionRefusedError(f"the test network has no route to {address[0]}")
        return await connect(self, sock, address)

    monkeypatch.setattr(selector_events.BaseSelectorEventLoop, "sock_connect", routed)
    return routes


def _remote(*urls: str, kind: str = "image") -> dict[str, Any]:
    parts = [{"type": f"{kind}_url", f"{kind}_url": {"url": url}} for url in urls]
    return body(user(*parts, {"type": "text", "text": "What is it?"}))


def _served() -> FakeBackend:
    return FakeBackend([Delta("ok", [1], "stop", 5, 1, None)])


def _refused_before_connecting(gateway, url: str, listener: Listener, param: str, says: str = "") -> None:
    """``url`` as an image: answered 400 naming the part, no connection at ``listener``, nothing to
    Triton; and, as a control, fetched from ``listener`` by a gateway allowed private hosts (so the
    URL does lead there: the refusal is the check's)."""
    backend = _served()
    before = listener.connections
    reply = gateway(backend, allow_remote_media=True).post("/v1/chat/completions", json=_remote(url))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == (param, "media_address_not_allowed"), error
    assert error["message"].startswith(f"{param}: ") and says in error["message"], error["message"]
    assert listener.connections == before and not backend.requests
    control = _served()
    reply = gateway(control, allow_remote_media=True, allow_private_media=True).post(
        "/v1/chat/completions", json=_remote(url)
    )
    assert reply.status_code == 200, reply.text
    assert control.requests[0]["image"].tolist() == [MEDIA] and listener.connections > before


URL_PARAM = "messages[0].content[0].image_url.url"


@pytest.mark.parametrize(
    "host",
    [
        "127。0。0。1",  # ideographic full stops (U+3002)
        "127．0．0．1",  # full-width full stops (U+FF0E)
        "127｡0｡0｡1",  # half-width ideographic full stops (U+FF61)
        "１２７.０.０.１",  # full-width digits
        "１２７。０。０。１",
        "ｌｏｃａｌｈｏｓｔ",  # a full-width name, resolved after folding
        "0x7f.0.0.1",  # a numeric form the system's resolver reads as 127.0.0.1
        "[::１]",  # a full-width digit in an IPv6 literal
        "[０:０:０:０:０:０:０:１]",
        "[::ffff:１２７.０.０.１]",
    ],
)
def test_a_host_the_http_client_folds_to_loopback_is_refused_before_connecting(gateway, listener, host):
    """``urllib.parse`` reads these hosts as names; the HTTP client folds them (IDNA/UTS-46, as
    yarl does) to 127.0.0.1 or ::1 and connects there: the check is on what it connects to (vLLM's
    CVE-2026-24779 is this class). The control shows each URL does reach the local listener."""
    local = listener("::1" if host.startswith("[") and "ffff" not in host else "127.0.0.1")
    _refused_before_connecting(gateway, f"http://{host}:{local.port}/a.png", local, URL_PARAM)


@pytest.mark.parametrize("host", ["127.1", "2130706433", "0177.0.0.1"])
def test_legacy_numeric_ipv4_forms_are_refused_as_the_address_they_denote(gateway, listener, host):
    """Forms the system's resolver reads as 127.0.0.1 (and aiohttp itself refuses): refused as
    a private address, not fetched."""
    local = listener()
    backend = _served()
    reply = gateway(backend, allow_remote_media=True).post(
        "/v1/chat/completions", json=_remote(f"http://{host}:{local.port}/a.png")
    )
    error = reply.json()["error"]
    assert reply.status_code == 400 and (error["param"], error["code"]) == (URL_PARAM, "media_address_not_allowed")
    assert local.connections == 0 and not backend.requests


EMBEDDED_LOOPBACK = {
    "NAT64 64:ff9b::/96": "64:ff9b::7f00:1",
    "NAT64 local-use 64:ff9b:1::/48, a /96 in it": "64:ff9b:1::7f00:1",
    "NAT64 local-use 64:ff9b:1::/48, RFC 6052's /48 form": "64:ff9b:1:7f00:0:100::",
    "6to4 2002::/16": "2002:7f00:1::1",
    "6to4 to 10.0.0.1": "2002:a00:1::1",
    "Teredo 2001::/32, client 127.0.0.1": "2001:0:4136:e378:8000:63bf:80ff:fffe",
    "IPv4-compatible ::a.b.c.d": "::7f00:1",
    "IPv4-translated ::ffff:0:a.b.c.d": "::ffff:0:7f00:1",
}


@pytest.mark.parametrize("address", EMBEDDED_LOOPBACK.values(), ids=EMBEDDED_LOOPBACK.keys())
def test_an_ipv6_address_that_carries_a_private_ipv4_is_refused_before_connecting(gateway, network, listener, address):
    """The network delivers a connection to these IPv6 addresses to the IPv4 host inside (the stand-in
    network routes them to the local listener, as a translator or relay would): refused, never
    connected to; the control shows the route works."""
    local = listener()
    network[address] = "127.0.0.1"
    _refused_before_connecting(gateway, f"http://[{address}]:{local.port}/a.png", local, URL_PARAM)


@pytest.mark.parametrize(
    "target",
    [
        "http://127。0。0。1:{port}/a.png",
        "http://[64:ff9b::7f00:1]:{port}/a.png",
        "http://ｌｏｃａｌｈｏｓｔ:{port}/a.png",
    ],
)
def test_a_redirect_to_such_a_host_is_refused_before_connecting(gateway, network, listener, target):
    """A public host (the stand-in network routes its address to a local server) redirects to a host
    that folds or translates to loopback: the public one is fetched, the redirect refused, the
    victim never connected to (the control, allowed private hosts, follows it to the victim)."""
    import urllib.parse

    public, victim = listener(), listener()
    network[PUBLIC_IP] = network["64:ff9b::7f00:1"] = "127.0.0.1"
    url = f"http://{PUBLIC_IP}:{public.port}/go?" + urllib.parse.quote(target.format(port=victim.port))
    _refused_before_connecting(gateway, url, victim, URL_PARAM, says="(a redirect)")
    assert public.connections == 2  # the refused request's and the control's


@pytest.mark.parametrize("left", ["resolved addresses", "socket addresses", None])
def test_each_connection_check_alone_keeps_the_client_off_loopback(monkeypatch, network, listener, left):
    """Defence in depth, each layer shown to work by itself: with the URL's literal check off and
    only ``left`` of the connector's two checks on (the addresses ``_resolve_host`` gives, the socket
    address of each attempt), a literal, a folded literal, a name and a NAT64 address of loopback are
    still refused, never connected to; with neither on (``None``) all four are fetched."""
    import aiohttp

    from mmserve.gateway import media

    monkeypatch.setattr(media, "literal_address", lambda host: None)
    if left != "socket addresses":
        monkeypatch.setattr(media, "_public_socket", lambda info: socket.socket(info[0], info[1], info[2]))
    if left != "resolved addresses":
        monkeypatch.setattr(media.public_only_connector(), "_resolve_host", aiohttp.TCPConnector._resolve_host)
    local = listener()
    network["64:ff9b::7f00:1"] = "127.0.0.1"
    hosts = ["127.0.0.1", "127。0。0。1", "localhost", "[64:ff9b::7f00:1]"]

    async def run() -> list[Any]:
        fetcher = media.MediaFetcher(1000, 5.0)
        results: list[Any] = []
        try:
            for host in hosts:
                try:
                    results.append(await fetcher(f"http://{host}:{local.port}/a.png", "p"))
                except errors.APIError as exc:
                    assert exc.status == 400 and exc.param == "p" and exc.message.startswith("p: ")
                    results.append(exc.code)
        finally:
            await fetcher.close()
        return results

    results = asyncio.run(run())
    if left is None:
        assert results == [MEDIA] * len(hosts) and local.connections == len(hosts)
    else:
        assert results == ["media_address_not_allowed"] * len(hosts) and local.connections == 0


def test_media_are_counted_against_the_limits_before_anything_is_fetched(gateway, listener):
    """A request with more media of a modality than ``limit_mm_per_prompt`` is refused with a 400
    naming the first part over the limit, before any fetch: its remote URL, which comes before the
    part over the limit, is never connected to. Within the limits, the same URLs are fetched."""
    local = listener()
    url = f"http://127.0.0.1:{local.port}/a.png"
    remote = {"type": "image_url", "image_url": {"url": url}}
    clip = {"type": "audio_url", "audio_url": {"url": url.replace(".png", ".png?clip")}}
    config = {"allow_remote_media": True, "allow_private_media": True, "limit_mm_per_prompt": {"image": 2, "audio": 1}}
    cases = {
        "messages[1].content[1]": body(user(remote, image()), user({"type": "text", "text": "and"}, image())),
        "messages[0].content[1]": body(user(clip, audio(), audio())),
    }
    for param, request in cases.items():
        backend = _served()
        reply = gateway(backend, **config).post("/v1/chat/completions", json=request)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert (error["param"], error["code"]) == (param, "too_many_media_items"), error
        assert local.connections == 0 and not backend.requests
    assert error["message"] == (
        "messages[0].content[1]: the request has 3 audio clips; at most 1 may be provided in one request "
        "(--limit-mm-per-prompt)"
    )
    backend = _served()
    reply = gateway(backend, **config).post("/v1/chat/completions", json=body(user(remote, image())))
    assert reply.status_code == 200 and backend.requests[0]["image"].tolist() == [MEDIA, PNG]
    assert local.connections == 1
    reply = gateway(_served(), limit_mm_per_prompt={"video": 0}).post(
        "/v1/chat/completions",
        json=body(user({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}})),
    )
    assert reply.json()["error"]["message"] == (
        "messages[0].content[0]: the request has 1 video; this server takes no videos (--limit-mm-per-prompt)"
    )


def test_the_default_limits_are_the_shipped_engines(tmp_path):
    """Without ``--limit-mm-per-prompt`` the gateway counts against the shipped ``mm_llm/model.json``'s
    ``limit_mm_per_prompt`` (what ``preprocess`` and the engine refuse beyond)."""
    from mmserve.gateway.__main__ import config_from_args
    from mmserve.inputs import mm_limits

    shipped = json.loads((Path(__file__).resolve().parents[1] / "model_repository/mm_llm/model.json").read_text())
    assert dict(GatewayConfig().limit_mm_per_prompt) == mm_limits(shipped)
    config, _ = config_from_args(["--limit-mm-per-prompt", '{"image": {"count": 8}, "video": 0}'])
    assert dict(config.limit_mm_per_prompt) == {**mm_limits(shipped), "image": 8, "video": 0}
    for bad in ('{"image": -1}', '{"picture": 2}', "[4]", "four"):
        with pytest.raises(SystemExit):
            config_from_args(["--limit-mm-per-prompt", bad])


def test_fetches_of_one_request_are_bounded_in_flight(gateway, listener):
    """Six remote images, at most two fetched at once (``media_fetches_in_flight``): the stand-in saw
    six connections, never more than two open together, and the images come in order."""
    local = listener()
    urls = [f"http://127.0.0.1:{local.port}/slow.png" for _ in range(6)]
    backend = _served()
    client = gateway(
        backend,
        allow_remote_media=True,
        allow_private_media=True,
        media_fetches_in_flight=2,
        limit_mm_per_prompt={"image": 6},
    )
    reply = client.post("/v1/chat/completions", json=_remote(*urls))
    assert reply.status_code == 200, reply.text
    assert backend.requests[0]["image"].tolist() == [MEDIA] * 6
    assert (local.connections, local.most_open) == (6, 2)


# -- the API key ----------------------------------------------------------------------------------
KEY = "sk-test-0123456789"


def test_an_api_key_guards_v1_as_vllm_serve_guards_it(gateway):
    """With ``api_keys``: every ``/v1`` path answers 401 ``{"error": "Unauthorized"}`` without one of
    the keys as a bearer token (before anything reaches Triton), and serves with it; ``/health`` stays
    open. The same requests through vLLM 0.32's own ``AuthenticationMiddleware`` get the same statuses."""
    from fastapi.testclient import TestClient
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware as VLLMAuthentication

    backend = _served()
    client = gateway(backend, api_keys=(KEY, "second-key"))
    chat = body(user("Hi"))
    requests = {  # name: (headers, authorized)
        "no header": ({}, False),
        "another key": ({"Authorization": "Bearer sk-wrong"}, False),
        "a longer key": ({"Authorization": f"Bearer {KEY}x"}, False),
        "another scheme": ({"Authorization": f"Basic {KEY}"}, False),
        "no scheme": ({"Authorization": KEY}, False),
        "the key": ({"Authorization": f"Bearer {KEY}"}, True),
        "the other key, scheme in capitals": ({"Authorization": "BEARER second-key"}, True),
    }
    paths = [("GET", "/v1/models"), ("GET", "/v1/models/mm_ensemble"), ("POST", "/v1/chat/completions")]
    paths += [("GET", "/health"), ("GET", "/v2/anything"), ("OPTIONS", "/v1/models")]

    async def anything(request: Any) -> PlainTextResponse:
        return PlainTextResponse("served")

    routes = [Route(path, anything, methods=["GET", "POST", "OPTIONS"]) for _, path in paths]
    reference_app = VLLMAuthentication(Starlette(routes=routes), tokens=[KEY, "second-key"])

    async def asgi(scope: Any, receive: Any, send: Any) -> None:  # vLLM's __call__ returns an awaitable
        await reference_app(scope, receive, send)

    vllm = TestClient(asgi)
    for name, (headers, authorized) in requests.items():
        for method, path in paths:
            reply = client.request(method, path, headers=headers, json=chat if method == "POST" else None)
            reference = vllm.request(method, path, headers=headers)
            guarded = path.startswith(("/v1", "/v2")) and method != "OPTIONS"
            if guarded and not authorized:
                assert (reply.status_code, reply.json()) == (401, {"error": "Unauthorized"}), (name, path)
            else:
                assert reply.status_code != 401, (name, method, path, reply.text)
            assert (reply.status_code == 401) == (reference.status_code == 401), (name, method, path)
    assert len(backend.requests) == 2  # the two authorized chat requests only
    assert client.get("/health").status_code == 200
    assert KEY not in repr(GatewayConfig(api_keys=(KEY,)))


def test_the_openai_sdk_with_the_key_is_served_over_a_socket():
    """The real ``openai`` SDK (``api_key=``) against the gateway served by uvicorn on a real socket:
    served with the key; ``AuthenticationError`` (401) with another; ``/health`` open without one."""
    import threading
    import urllib.error
    import urllib.request

    import openai
    import uvicorn

    from mmserve_dev.triton import free_ports

    (port,) = free_ports(1)
    app = create_app(GatewayConfig(api_keys=(KEY,)), backend=FakeBackend([Delta("Hello!", [1, 2], "stop", 7, 2, None)]))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            thread.join(0.05)
        assert server.started
        url = f"http://127.0.0.1:{port}"
        reply = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0).chat.completions.create(
            model="mm_ensemble", messages=[{"role": "user", "content": "Hi"}]
        )
        assert reply.choices[0].message.content == "Hello!"
        with pytest.raises(openai.AuthenticationError) as info:
            openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0).models.list()
        assert info.value.status_code == 401 and info.value.body == "Unauthorized"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{url}/v1/chat/completions", data=json.dumps(body(user("Hi"))).encode())
        assert refused.value.code == 401 and json.loads(refused.value.read()) == {"error": "Unauthorized"}
        with urllib.request.urlopen(f"{url}/health") as health:
            assert health.status == 200
    finally:
        server.should_exit = True
        thread.join(10)


def test_the_key_comes_from_the_command_line_or_the_environment(monkeypatch):
    """``--api-key`` (one or more keys) over ``$MMSERVE_OPENAI_API_KEY``, as vLLM's ``--api-key`` over
    ``VLLM_API_KEY``; neither: no key."""
    from mmserve import settings
    from mmserve.gateway.__main__ import config_from_args

    monkeypatch.delenv(settings.OPENAI_API_KEY.name, raising=False)
    assert config_from_args([])[0].api_keys == ()
    monkeypatch.setenv(settings.OPENAI_API_KEY.name, KEY)
    assert config_from_args([])[0].api_keys == (KEY,)
    assert config_from_args(["--api-key", "a", "b"])[0].api_keys == ("a", "b")


def test_the_launcher_passes_the_key_in_the_environment_not_on_a_command_line(monkeypatch):
    """``python -m mmserve_dev.triton --openai-api-key KEY``'s ``start_gateway``: the gateway it starts
    requires the key, which is in its environment (readable by its user only) and nowhere on its
    command line (readable by every local user in /proc)."""
    import types
    import urllib.error
    import urllib.request

    from mmserve import settings
    from mmserve_dev.triton import free_ports
    from mmserve_dev.triton.__main__ import start_gateway, stop_gateway

    monkeypatch.delenv(settings.OPENAI_API_KEY.name, raising=False)
    nothing, port = free_ports(2)  # no Triton: /v1/models needs none
    repository = Path(__file__).resolve().parents[1] / "model_repository"
    served = types.SimpleNamespace(grpc_url=f"127.0.0.1:{nothing}", model_repositories=[repository])
    gateway = start_gateway(served, "127.0.0.1", port, KEY)  # type: ignore[arg-type]
    try:
        command_line = Path(f"/proc/{gateway.pid}/cmdline").read_bytes()
        # the engine's own media limits, counted before anything is fetched
        assert b'--limit-mm-per-prompt\x00{"image": 4, "audio": 2, "video": 1}' in command_line, command_line
        # the served checkpoint: text-only requests skip preprocess (mmserve.gateway.direct)
        served_model = os.environ.get(settings.MODEL.name) or str(repository.parent / "models" / "qwen2_5_omni")
        assert f"--tokenizer\0{served_model}\0".encode() in command_line, command_line
        environment = Path(f"/proc/{gateway.pid}/environ").read_bytes().split(b"\0")
        assert b"mmserve.gateway" in command_line and KEY.encode() not in command_line
        assert f"{settings.OPENAI_API_KEY.name}={KEY}".encode() in environment
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10)
        assert refused.value.code == 401
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {KEY}"}
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert json.loads(reply.read())["data"][0]["id"] == "mm_ensemble"
    finally:
        stop_gateway(gateway)


# -- conversion ----------------------------------------------------------------------------------
def test_a_conversation_becomes_messages_and_media_in_order():
    conv = convert_body(
        body(
            {"role": "developer", "content": "Be brief."},
            user({"type": "text", "text": "First"}, image(b"img0"), audio(b"aud0")),
            {"role": "assistant", "content": [{"type": "text", "text": "A picture."}]},
            user(audio(b"aud1", "flac"), {"type": "text", "text": "and"}, image(b"img1"), image(b"img2")),
        )
    )
    assert conv.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "First"}, {"type": "image"}, {"type": "audio"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A picture."}]},
        {
            "role": "user",
            "content": [{"type": "audio"}, {"type": "text", "text": "and"}, {"type": "image"}, {"type": "image"}],
        },
    ]
    assert conv.images == [b"img0", b"img1", b"img2"] and conv.audios == [b"aud0", b"aud1"]


def test_audio_url_parts_take_their_place_among_the_clips():
    """vLLM's ``audio_url`` part (a data: URL of an audio file) is an audio clip like
    ``input_audio``, in order of appearance; a remote one is fetched only where allowed."""
    url = {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + b64(b"aud1")}}
    conv = convert_body(body(user(audio(b"aud0"), url, {"type": "text", "text": "Hm?"}, audio(b"aud2"))))
    assert conv.messages == [
        {
            "role": "user",
            "content": [{"type": "audio"}, {"type": "audio"}, {"type": "text", "text": "Hm?"}, {"type": "audio"}],
        }
    ]
    assert conv.audios == [b"aud0", b"aud1", b"aud2"] and conv.images == []
    remote = body(user({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}}, image(b"img")))
    error = rejected(remote)
    assert (error.code, error.param) == ("remote_media_disabled", "messages[0].content[0].audio_url.url")
    assert "remote audio URLs are disabled" in error.message

    async def fetch(url: str, param: str) -> bytes:
        return f"{url} for {param}".encode()

    fetched = convert_body(remote, fetch=fetch)
    assert fetched.audios == [b"https://example.com/a.wav for messages[0].content[0].audio_url.url"]
    assert fetched.images == [b"img"]


def test_video_url_parts_become_the_video_input():
    """vLLM's ``video_url`` part (a data: URL of a video file): a video part of the conversation and
    an item of the ``video`` input, in order; a remote one is fetched only where allowed."""
    from mmserve.gateway.convert import request_tensors
    from mmserve.gateway.protocol import ChatCompletionRequest

    def video(data: bytes) -> dict:
        return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + b64(data)}}

    request = body(user(image(b"img"), video(b"vid0"), {"type": "text", "text": "And?"}, video(b"vid1")))
    conv = convert_body(request)
    assert conv.messages == [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "And?"}, {"type": "video"}],
        }
    ]
    assert conv.videos == [b"vid0", b"vid1"] and conv.images == [b"img"] and conv.audios == []
    [tensors] = request_tensors(ChatCompletionRequest.model_validate(request), conv)
    assert tensors["video"].tolist() == [b"vid0", b"vid1"] and "audio" not in tensors
    error = rejected(body(user({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}})))
    assert (error.code, error.param) == ("remote_media_disabled", "messages[0].content[0].video_url.url")
    assert "remote video URLs are disabled" in error.message


def test_use_audio_in_video_comes_as_vllm_serve_takes_it():
    """vLLM's ``mm_processor_kwargs: {"use_audio_in_video": true}`` -> the ``use_audio_in_video``
    input of mm_ensemble (with videos only); other processor kwargs, and the name at the top level,
    are refused."""
    from mmserve.gateway.convert import request_tensors

    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + b64(b"vid")}}
    request = body(user(video, {"type": "text", "text": "x"}), mm_processor_kwargs={"use_audio_in_video": True})
    [tensors] = request_tensors(protocol.parse_request(request), convert_body(request))
    assert tensors["use_audio_in_video"].tolist() == [True]
    plain = body(user(video, {"type": "text", "text": "x"}), mm_processor_kwargs={})
    [tensors] = request_tensors(protocol.parse_request(plain), convert_body(plain))
    assert "use_audio_in_video" not in tensors
    text_only = body(user("x"), mm_processor_kwargs={"use_audio_in_video": True})
    [tensors] = request_tensors(protocol.parse_request(text_only), convert_body(text_only))
    assert "use_audio_in_video" not in tensors  # no video: nothing to hear
    error = rejected(body(user("x"), mm_processor_kwargs={"use_audio_in_video": True, "fps": 2}))
    assert (error.code, error.param) == (
        "unsupported",
        "mm_processor_kwargs",
    ) and "only use_audio_in_video" in error.message
    error = rejected(body(user("x"), use_audio_in_video=True))
    assert (error.code, error.param) == ("unknown_field", "use_audio_in_video")


def test_tensors_use_the_messages_input_and_wire_names():
    chat = protocol.parse_request(
        body(
            user(image(), {"type": "text", "text": "Hi"}),
            max_tokens=5,
            temperature=0,
            top_k=1,
            seed=3,
            stop="x",
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            top_logprobs=2,
        )
    )
    [tensors] = convert.request_tensors(chat, asyncio.run(convert.conversation(chat)))
    assert set(tensors) <= set(wire.names(wire.PUBLIC_INPUTS)) | {"messages"}
    assert "text_input" not in tensors and tensors["image"].dtype == object and tensors["image"][0] == PNG
    assert json.loads(tensors["messages"][0]) == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}
    ]
    assert json.loads(tensors["sampling_parameters"][0]) == {
        "max_tokens": 5,
        "temperature": 0.0,
        "top_k": 1,
        "seed": 3,
        "stop": "x",
        "logprobs": 2,
    }
    assert tensors["stream"][0] and tensors["return_logprobs"][0] and tensors["exclude_input_in_output"][0]


def test_messages_is_a_public_input_of_the_tree():
    """The gateway sends ``messages`` (preprocess's conversation input); the tree must declare it."""
    assert "messages" in wire.names(wire.PREPROCESS_INPUTS)


def test_sampling_defaults_and_aliases():
    params = convert.sampling_parameters(protocol.parse_request(body(user("Hi"))))
    assert params == {"max_tokens": None}  # OpenAI: up to the context length (vLLM's None)
    params = convert.sampling_parameters(
        protocol.parse_request(body(user("Hi"), max_completion_tokens=7, logprobs=True))
    )
    assert params == {"max_tokens": 7, "logprobs": 0}


def test_vllms_sampling_extensions_pass_through_and_the_others_say_why_not():
    """vLLM's chat extensions that are sampling parameters reach mm_llm as vLLM names them; those
    this chain doesn't take are refused with the reason, not as unknown fields."""
    extensions = {
        "stop_token_ids": [5, 6],
        "bad_words": ["no"],
        "allowed_token_ids": [1, 2, 3],
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "stream_interval": 4,
    }
    params = convert.sampling_parameters(protocol.parse_request(body(user("Hi"), echo=True, **extensions)))
    assert {key: params[key] for key in extensions} == extensions
    for field, value, why in [
        ("chat_template", "{{ x }}", "model's own chat template"),
        ("continue_final_message", True, "ends with a user or tool message"),
        ("use_beam_search", True, "beam search"),
        ("mm_processor_kwargs", {"fps": 2}, "deployment's settings"),
        ("kv_transfer_params", {"a": 1}, "not served by this gateway"),
    ]:
        with pytest.raises(errors.APIError) as info:
            protocol.parse_request(body(user("Hi"), **{field: value}))
        assert info.value.param == field and why in info.value.message and info.value.code == "unsupported"
    protocol.parse_request(body(user("Hi"), add_generation_prompt=True, use_beam_search=False, include_reasoning=True))


SCHEMA = {"type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]}


@pytest.mark.parametrize(
    ("fields", "structured"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}},
            {"json": SCHEMA},
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "c", "schema": SCHEMA, "strict": True},
                }
            },
            {"json": SCHEMA},
        ),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
        # two constraints: mm_llm's parser refuses them (exactly one), as vLLM's server does
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
            {"json_object": True, "regex": "a+"},
        ),
    ],
)
def test_structured_output_becomes_vllms_structured_outputs(fields, structured):
    """``response_format`` and vLLM's ``structured_outputs`` extension, mapped as vLLM's server maps
    them (``structured_outputs_from_response_format``), into mm_llm's sampling parameters."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.exceptions import VLLMValidationError

    from mmserve.errors import InputError
    from mmserve.serving.sampling import parse_sampling_parameters

    params = convert.sampling_parameters(protocol.parse_request(body(user("Hi"), **fields)))
    assert params.get("structured_outputs") == structured
    request = ChatCompletionRequest.model_validate(body(user("Hi"), **fields))
    if structured is not None and len(set(structured) & {"json", "regex", "choice", "grammar", "json_object"}) > 1:
        with pytest.raises(VLLMValidationError, match="only use one kind of structured outputs"):
            request.extract_structured_outputs()
        with pytest.raises(InputError, match="structured_outputs: expected exactly one of"):
            parse_sampling_parameters(json.dumps(params), stream=False)
        return
    reference = request.extract_structured_outputs()
    if structured is None:
        assert reference is None
    else:
        assert {k: getattr(reference, k) for k in structured} == structured


def test_media_sources():
    assert convert.data_url_bytes("data:image/png;base64," + b64(PNG), "p") == PNG
    with pytest.raises(errors.APIError, match="p: a data URL must be base64-encoded"):  # as vllm serve
        convert.data_url_bytes("data:,a%20b", "p")
    wrapped = b64(PNG)
    wrapped = "\n".join(wrapped[i : i + 76] for i in range(0, len(wrapped), 76))  # MIME-style lines
    assert convert.b64decode(wrapped, "p", "x") == PNG
    assert convert.data_url_bytes("data:image/png;base64," + wrapped, "p") == PNG  # a view of the URL's bytes
    assert convert.data_url_bytes("data:image/png;BASE64," + b64(b"a,b"), "p") == b"a,b"  # the first comma
    with pytest.raises(errors.APIError, match=r"p: malformed data URL \(no ',' before the data\)"):
        convert.data_url_bytes("data:image/png;base64", "p")
    for bad in ("QUJD!", "QUJ", "QUJDé", "QU JD="):  # stray symbol, short, non-ASCII, padding inside
        with pytest.raises(errors.APIError, match="p: x is not valid base64"):
            convert.b64decode(bad, "p", "x")
    assert convert_body(body(user(audio()))).audios == [WAV]
    data_url_audio = {
        "type": "input_audio",
        "input_audio": {"data": "data:audio/wav;base64," + b64(WAV), "format": "wav"},
    }
    assert convert_body(body(user(data_url_audio))).audios == [WAV]

    async def fetch(url: str, param: str) -> bytes:
        return url.encode()

    remote = {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}}
    assert convert_body(body(user(image(b"x"), remote)), fetch=fetch).images == [b"x", b"https://example.com/a.png"]


@pytest.mark.parametrize(
    ("data", "param", "code"),
    [
        (
            body(user({"type": "image_url", "image_url": {"url": "data:image/png;base64,!!notbase64"}})),
            "messages[0].content[0].image_url.url",
            "invalid_value",
        ),
        (
            body(user({"type": "input_audio", "input_audio": {"data": "abc", "format": "wav"}})),
            "messages[0].content[0].input_audio.data",
            "invalid_value",
        ),
        (
            body(user({"type": "image_url", "image_url": {"url": "http://example.com/a.png"}})),
            "messages[0].content[0].image_url.url",
            "remote_media_disabled",
        ),
        (
            body(user({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}})),
            "messages[0].content[0].image_url.url",
            "invalid_value",
        ),
        (
            body(user({"type": "image_url", "image_url": {"url": "data:image/png;base64"}})),
            "messages[0].content[0].image_url.url",
            "invalid_value",
        ),
    ],
)
def test_bad_media_is_refused_naming_the_part(data, param, code):
    error = rejected(data)
    assert (error.param, error.code) == (param, code)
    assert error.message.startswith(param)


def test_media_size_limit():
    error = rejected(body(user(image(b"x" * 100))), max_bytes=99)
    assert error.code == "media_too_large" and error.param == "messages[0].content[0].image_url.url"


WEATHER = WEATHER_TOOL
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    ("data", "param", "code", "says"),
    [
        (body(user("Hi"), n=17), "n", None, "less than or equal to 16"),
        (
            body(user("Hi"), tools=[{"type": "function", "function": {"name": ""}}]),
            "tools[0].function.name",
            None,
            "at least 1",
        ),
        (body(user("Hi"), response_format={"type": "xml"}), "response_format.type", None, "'json_schema'"),
        (body(user("Hi"), response_format={"type": "json_schema"}), "response_format.json_schema", None, "needs"),
        (
            body(user("Hi"), response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format.json_schema.schema",
            "missing_field",
            "required",
        ),
        (
            body(user("Hi"), response_format={"type": "text", "json_schema": {"name": "x", "schema": {}}}),
            "response_format.json_schema",
            None,
            "only allowed",
        ),
        (body(user("Hi"), frobnicate=1), "frobnicate", "unknown_field", "unknown field"),
        (body(user({"type": "file", "file": {"file_id": "x"}})), "messages[0].content[0]", None, "file"),
        (
            body(user({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "aac"}})),
            "messages[0].content[0].input_audio.format",
            None,
            "'wav'",
        ),
        (body({"role": "tool", "content": "x"}), "messages[0].tool_call_id", "missing_field", "required"),
        (body(user("Hi"), tools=[]), "tools", "invalid_value", "must not be an empty array"),
        (body(user("Hi"), tool_choice="auto"), "tool_choice", "invalid_value", "`tools` must be set"),
        (body(user("Hi"), tools=[WEATHER], tool_choice="sometimes"), "tool_choice", None, "'none'"),
        (
            body(user("Hi"), tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "other"}}),
            "tool_choice",
            "invalid_value",
            "does not match any of the specified `tools`",
        ),
        (
            body(user("Hi"), tools=[WEATHER], tool_choice=NAMED, structured_outputs={"regex": "a+"}),
            "structured_outputs",
            "invalid_value",
            "either use constraints for structured outputs or tools",
        ),
        (body(user("Hi"), functions=[{"name": "f"}]), "functions", "unsupported", "function calling"),
        (body({"role": "system", "content": [image()]}), "messages[0].content[0].type", None, "text"),
        (body(user("Hi"), top_logprobs=2), "top_logprobs", "invalid_value", "logprobs"),
        (body(user("Hi"), max_tokens=3, max_completion_tokens=4), "max_completion_tokens", "invalid_value", "differ"),
        (body(user("Hi"), stream_options={"include_usage": True}), "stream_options", "invalid_value", "stream"),
        ({"model": "m", "messages": []}, "messages", None, "at least 1"),
        ({"messages": [user("Hi")]}, "model", "missing_field", "required"),
        (
            body(user({"type": "text", "text": "a", "extra": 1})),
            "messages[0].content[0].extra",
            "unknown_field",
            "unknown",
        ),
        ([1, 2], None, "invalid_json", "JSON object"),
    ],
)
def test_bad_requests_are_refused_clearly(data, param, code, says):
    with pytest.raises(errors.APIError) as info:
        protocol.parse_request(data)
    error = info.value
    assert error.status == 400 and error.param == param, error.body()
    assert code is None or error.code == code
    assert says in error.message, error.message


def test_harmless_fields_are_accepted():
    protocol.parse_request(
        body(
            user("Hi"),
            user="u1",
            metadata={"k": "v"},
            store=False,
            response_format={"type": "text"},
            modalities=["text"],
            parallel_tool_calls=True,
            stream=True,
            stream_options={"include_usage": True, "include_obfuscation": False},
        )
    )


# -- logprobs ------------------------------------------------------------------------------------
def test_logprobs_map_to_openai_entries():
    steps = [
        {
            "5": {"logprob": -0.1, "rank": 1, "decoded_token": "Hi"},
            "7": {"logprob": -2.5, "rank": 2, "decoded_token": " there"},
            "9": {"logprob": -3.0, "rank": 3, "decoded_token": "!"},
        },
        {
            "7": {"logprob": -1.5, "rank": 4, "decoded_token": "é"},  # sampled, outside the top 2
            "1": {"logprob": -0.2, "rank": 1, "decoded_token": "a"},
            "2": {"logprob": -0.9, "rank": 2, "decoded_token": "b"},
        },
    ]
    content = convert.openai_logprobs(steps, [5, 7], top_logprobs=2)
    assert content[0] == {
        "token": "Hi",
        "logprob": -0.1,
        "bytes": [72, 105],
        "top_logprobs": [
            {"token": "Hi", "logprob": -0.1, "bytes": [72, 105]},
            {"token": " there", "logprob": -2.5, "bytes": list(b" there")},
        ],
    }
    assert content[1]["token"] == "é" and content[1]["bytes"] == [0xC3, 0xA9]
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["a", "b"]
    assert (
        convert.openai_logprobs([{"5": {"logprob": -0.1, "rank": 1, "decoded_token": "x"}}], [5], 0)[0]["top_logprobs"]
        == []
    )


# -- error mapping -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("message", "status", "type_"),
    [
        ("[INVALID_ARG] image[0]: not an image", 400, "invalid_request_error"),
        (
            "in ensemble 'mm_ensemble', [INVALID_ARG] messages: 2 image parts but 1 image given",
            400,
            "invalid_request_error",
        ),
        ("[UNAVAILABLE] the engine failed; retry", 503, "service_unavailable"),
        ("Request for unknown model: 'mm_llm' is not found", 503, "service_unavailable"),
        ("[INTERNAL] internal error (incident abc); the server log has the detail", 500, "server_error"),
        ("something odd at /opt/tritonserver/x.py", 500, "server_error"),
    ],
)
def test_triton_errors_map_to_http_statuses(message, status, type_):
    error = errors.from_triton(message)
    assert (error.status, error.type) == (status, type_)
    assert "[INVALID_ARG]" not in error.message and "/opt/" not in error.message
    if status == 400:
        assert error.message.endswith(message.split("] ", 1)[1])


@pytest.mark.parametrize(
    ("message", "param"),
    [
        (
            "[INVALID_ARG] sampling_parameters: max_tokens=100000 cannot be greater than max_model_len=4096",
            "max_tokens",
        ),
        ("[INVALID_ARG] sampling_parameters: temperature: expected a number, found 'x'", "temperature"),
        ("[INVALID_ARG] sampling_parameters: structured_outputs.regex: unclosed group", "structured_outputs.regex"),
        ("[INVALID_ARG] sampling_parameters: temperature must be non-negative, got -1.0.", "temperature"),
        ("[INVALID_ARG] sampling_parameters: invalid JSON (Expecting value)", None),
        ("[INVALID_ARG] image[0]: cannot identify the image file", None),
    ],
)
def test_a_sampling_error_names_its_field_as_param(message, param):
    """As ``vllm serve``'s 400s: the offending sampling field is the error's ``param``."""
    assert errors.from_triton(message).param == param


def test_grpc_failures_map_to_503_without_internals():
    error = errors.from_grpc("UNAVAILABLE", "failed to connect to all addresses; ipv4:127.0.0.1:1: Connection refused")
    assert error.status == 503 and "127.0.0.1" not in error.message
    assert errors.from_grpc("DEADLINE_EXCEEDED", "").status == 503
    assert errors.from_grpc("INTERNAL", "Request for unknown model: 'x' has no available versions").status == 503
    assert errors.from_grpc("INVALID_ARGUMENT", "unexpected shape for input 'x'").status == 500


def test_delta_from_an_infer_result():
    outputs = {
        "text_output": np.array([b"Hi"], dtype=object),
        "output_ids": np.array([1, 2], dtype=np.int64),
        "finish_reason": np.array([b""], dtype=object),
        "num_input_tokens": np.array([9], dtype=np.uint32),
        "num_output_tokens": np.array([2], dtype=np.uint32),
        "logprobs": np.array([b'[{"1": {"logprob": -1.0, "rank": 1, "decoded_token": "H"}}]'], dtype=object),
    }

    class Result:
        def as_numpy(self, name):
            return outputs.get(name)

    delta = delta_from(Result())
    assert delta == Delta("Hi", [1, 2], None, 9, 2, [{"1": {"logprob": -1.0, "rank": 1, "decoded_token": "H"}}])


def _grpc_result(outputs: dict[str, tuple[str, np.ndarray]]) -> Any:
    """A tritonclient ``InferResult`` around the gRPC message Triton would send (raw outputs)."""
    from tritonclient.grpc import InferResult, service_pb2
    from tritonclient.utils import serialize_byte_tensor

    response = service_pb2.ModelInferResponse(model_name="mm_ensemble", id="r1")
    for name, (datatype, array) in outputs.items():
        response.outputs.add(name=name, datatype=datatype, shape=list(array.shape))
        response.raw_output_contents.append(
            serialize_byte_tensor(array).item() if datatype == "BYTES" and array.size else array.tobytes()
        )
    return InferResult(response)


@pytest.mark.parametrize(
    "outputs",
    [
        {
            "text_output": ("BYTES", np.array(["é x".encode()], dtype=object)),
            "output_ids": ("INT64", np.array([5, 6, 7], dtype=np.int64)),
            "finish_reason": ("BYTES", np.array([b"length"], dtype=object)),
            "logprobs": (
                "BYTES",
                np.array([b'[{"5": {"logprob": -0.5, "rank": 1, "decoded_token": "x"}}]'], dtype=object),
            ),
            "prompt_logprobs": (
                "BYTES",
                np.array([b'[null, {"8": {"logprob": -1.25, "rank": 2, "decoded_token": "y"}}]'], dtype=object),
            ),
            "num_input_tokens": ("UINT32", np.array([41], dtype=np.uint32)),
            "num_output_tokens": ("UINT32", np.array([3], dtype=np.uint32)),
        },
        {
            "text_output": ("BYTES", np.array([b""], dtype=object)),
            "output_ids": ("INT64", np.array([9], dtype=np.int64)),
            "finish_reason": ("BYTES", np.array([b""], dtype=object)),
            "num_output_tokens": ("UINT32", np.array([1], dtype=np.uint32)),
        },
        {"text_output": ("BYTES", np.array([], dtype=object)), "output_ids": ("INT64", np.array([], dtype=np.int64))},
    ],
)
def test_delta_from_a_grpc_response_reads_what_tritonclient_decodes(outputs):
    """The one-pass reading of the gRPC message gives what tritonclient's ``as_numpy`` decoding
    gives (the reference), for a full response, a token with no text yet, and an empty one."""
    from mmserve.gateway.triton import _delta_via_as_numpy

    result = _grpc_result(outputs)
    assert delta_from(result) == _delta_via_as_numpy(result)
    if "prompt_logprobs" in outputs:
        assert delta_from(result).prompt_logprobs == [None, {"8": {"logprob": -1.25, "rank": 2, "decoded_token": "y"}}]


def test_a_silent_triton_stream_times_out_and_is_cancelled():
    """A Triton that answers a request once, then nothing (a stand-in gRPC server on a real socket:
    a hung tritonserver can't be made to order): the backend raises a 504 after its response
    timeout, not never, and sends mm_llm a cancel for the request on its stream, which the
    server receives; a second request on the same backend is answered meanwhile."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from mmserve.gateway.triton import TritonBackend

    async def scenario() -> tuple[list[Delta], errors.APIError, float, list[tuple[str, str]], list[Delta]]:
        received: list[tuple[str, str]] = []
        cancel_seen = asyncio.Event()

        class Silent(service_pb2_grpc.GRPCInferenceServiceServicer):
            async def ModelStreamInfer(self, requests, context):
                async for request in requests:
                    received.append((request.model_name, request.id))
                    if request.id.endswith(".cancel"):
                        cancel_seen.set()
                        continue
                    response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
                    response.outputs.add(name="text_output", datatype="BYTES", shape=[1])
                    response.raw_output_contents.append(b"\x02\x00\x00\x00ok")
                    if request.id == "r2":
                        response.parameters["triton_final_response"].bool_param = True
                    yield service_pb2.ModelStreamInferResponse(infer_response=response)

        server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Silent(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        backend = TritonBackend(f"127.0.0.1:{port}", "mm_ensemble", response_timeout_s=0.5)
        await backend.start()
        got: list[Delta] = []
        started = asyncio.get_running_loop().time()
        try:
            with pytest.raises(errors.APIError) as info:
                async for delta in backend.generate({"text_input": np.array([b"Hi"], dtype=object)}, "r1"):
                    got.append(delta)
            took = asyncio.get_running_loop().time() - started
            await asyncio.wait_for(cancel_seen.wait(), 5)
            other = [d async for d in backend.generate({"text_input": np.array([b"Hi"], dtype=object)}, "r2")]
        finally:
            await backend.close()
            await server.stop(None)
        return got, info.value, took, received, other

    got, error, took, received, other = asyncio.run(scenario())
    assert len(got) == 1 and got[0].text == "ok"
    assert (error.status, error.code) == (504, "timeout") and "0.5 s" in error.message, error.body()
    assert 0.5 <= took < 5, took
    assert received[:2] == [("mm_ensemble", "r1"), ("mm_llm", "r1.cancel")], received
    assert [d.text for d in other] == ["ok"]


def test_requests_take_the_streams_in_turn_and_a_broken_stream_fails_only_its_own():
    """Two streams to a stand-in Triton (a real gRPC server on a socket): requests alternate between
    them; when the server breaks one, the requests on it get a 503 while the other stream's request
    is answered, and the next request in that stream's turn opens a new stream."""
    import itertools

    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from mmserve.gateway.triton import TritonBackend

    async def scenario() -> tuple[dict[str, object], list[tuple[str, int]]]:
        seen: list[tuple[str, int]] = []  # (request id, which stream)
        calls = itertools.count()

        class Stand(service_pb2_grpc.GRPCInferenceServiceServicer):
            async def ModelStreamInfer(self, requests, context):
                call = next(calls)
                async for request in requests:
                    seen.append((request.id, call))
                    if request.id.startswith("hold"):
                        continue
                    if request.id.startswith("break"):
                        await context.abort(grpc.StatusCode.UNAVAILABLE, "broken on purpose")
                    if request.id.startswith("slow"):
                        await asyncio.sleep(0.5)
                    response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
                    response.outputs.add(name="text_output", datatype="BYTES", shape=[1])
                    response.raw_output_contents.append(b"\x02\x00\x00\x00ok")
                    response.parameters["triton_final_response"].bool_param = True
                    yield service_pb2.ModelStreamInferResponse(infer_response=response)

        server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Stand(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        backend = TritonBackend(f"127.0.0.1:{port}", "mm_ensemble", response_timeout_s=10, streams=2)
        await backend.start()

        async def outcome(request_id: str) -> object:
            try:
                return [
                    d.text async for d in backend.generate({"text_input": np.array([b"Hi"], dtype=object)}, request_id)
                ]
            except errors.APIError as exc:
                return exc.status

        try:
            held = asyncio.ensure_future(outcome("hold-a"))  # stream 0
            slow = asyncio.ensure_future(outcome("slow-b"))  # stream 1
            await asyncio.sleep(0.1)
            results = {"break-c": await outcome("break-c")}  # stream 0, which the server breaks
            results["hold-a"] = await asyncio.wait_for(held, 5)
            results["slow-b"] = await asyncio.wait_for(slow, 5)
            results["d"] = await outcome("d")  # stream 1
            results["e"] = await outcome("e")  # stream 0's turn: a new stream
        finally:
            await backend.close()
            await server.stop(None)
        return results, seen

    results, seen = asyncio.run(scenario())
    assert results == {"break-c": 503, "hold-a": 503, "slow-b": ["ok"], "d": ["ok"], "e": ["ok"]}, results
    stream_of = dict(seen)
    assert stream_of["hold-a"] == stream_of["break-c"] != stream_of["slow-b"] == stream_of["d"], seen
    assert stream_of["e"] not in (stream_of["hold-a"], stream_of["slow-b"]), seen


@pytest.mark.parametrize("usage", [False, True])
def test_a_streamed_tokens_event_is_the_chunk_serialized(usage):
    """The per-token event (its JSON frame made once) is byte for byte the chunk serialized whole."""
    from mmserve.gateway.app import _Answer, _sse

    fields = {"stream": True, "stream_options": {"include_usage": True}} if usage else {"stream": True}
    answer = _Answer(protocol.parse_request(body(user("Hi"), n=2, **fields)), "chatcmpl-1", "mm")
    for text in (" hello", "", 'quote " and \\ backslash', "line\nbreak", "é ü 漢字 🙂", '{"content": ""}'):
        for index in (0, 1):
            assert answer.content_event(index, text) == _sse(answer.chunk({"content": text}, index=index)), text


# -- the app with a fake Triton ------------------------------------------------------------------
class FakeBackend:
    """Answers every request with ``deltas`` (or raises ``error`` at once); records what it got."""

    def __init__(
        self,
        deltas: list[Delta] | None = None,
        error: errors.APIError | None = None,
        ready: errors.APIError | None = None,
    ) -> None:
        self.deltas, self.error, self.ready_error = deltas or [], error, ready
        self.requests: list[dict[str, np.ndarray]] = []
        self.closed = 0

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def ready(self) -> None:
        if self.ready_error:
            raise self.ready_error

    async def generate(self, tensors, request_id, model=None):
        self.requests.append(dict(tensors))
        try:
            if self.error:
                raise self.error
            for delta in self.deltas:
                yield delta
        finally:
            self.closed += 1


STREAM = [
    Delta("Hel", [1], None, 20, 1, None),
    Delta("lo", [2], None, 20, 1, None),
    Delta("!", [3], "length", 20, 1, None),
]


@pytest.fixture
def gateway():
    from fastapi.testclient import TestClient

    def make(backend: FakeBackend, **config: Any):
        client = TestClient(create_app(GatewayConfig(**config), backend=backend))
        client.__enter__()
        made.append(client)
        return client

    made: list[Any] = []
    yield make
    for client in made:
        client.__exit__(None, None, None)


def sdk(client):
    import openai

    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)


def test_sdk_non_streamed_and_streamed(gateway):
    backend = FakeBackend([Delta("Hello!", [1, 2, 3], "length", 20, 3, None)])
    client = sdk(gateway(backend))
    reply = client.chat.completions.create(model="mm_ensemble", messages=[user("Hi")], max_tokens=3)
    assert reply.choices[0].message.content == "Hello!" and reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (20, 3, 23)
    assert not backend.requests[0]["stream"][0]

    backend.deltas = STREAM
    chunks = list(
        client.chat.completions.create(
            model="mm_ensemble", messages=[user("Hi")], stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello!"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert backend.requests[1]["stream"][0] and backend.closed == 2


class ChoicesBackend(FakeBackend):
    """Answers the request of choice k (``<id>-k``) with ``STREAM``'s text, k + 1 times over."""

    completed = 0  # requests answered to their end

    async def generate(self, tensors, request_id, model=None):
        self.requests.append(dict(tensors))
        times = int(request_id.rsplit("-", 1)[1]) + 1
        try:
            for delta in STREAM:
                await asyncio.sleep(0)  # the choices' responses interleave
                yield dataclasses.replace(delta, text=delta.text * times)
            self.completed += 1
        finally:
            self.closed += 1


def test_n_choices_each_its_own_seeded_request(gateway):
    """``n``: one request per choice, seeded ``seed + index`` (vLLM's parallel sampling), choices in
    index order, usage summed over the choices (the prompt once); streamed, each choice's role
    first, then its deltas and its finish chunk, with its index."""
    backend = ChoicesBackend()
    client = sdk(gateway(backend))
    reply = client.chat.completions.create(model="mm_ensemble", messages=[user("Hi")], n=3, seed=5, temperature=1.0)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == ["Hello!", "HelHellolo!!", "HelHelHellololo!!!"]
    assert [c.finish_reason for c in reply.choices] == ["length"] * 3
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (20, 9)
    seeds = sorted(json.loads(r["sampling_parameters"][0])["seed"] for r in backend.requests)
    assert seeds == [5, 6, 7] and backend.closed == 3

    chunks = list(
        client.chat.completions.create(
            model="mm_ensemble", messages=[user("Hi")], n=2, stream=True, stream_options={"include_usage": True}
        )
    )
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]] == [(0, "assistant"), (1, "assistant")]
    texts = ["", ""]
    for chunk in chunks[2:-1]:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert texts == ["Hello!", "HelHellolo!!"]
    finishes = [
        (c.choices[0].index, c.choices[0].finish_reason) for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert sorted(finishes) == [(0, "length"), (1, "length")]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all("seed" not in json.loads(r["sampling_parameters"][0]) for r in backend.requests[3:])


def test_an_error_on_one_choice_ends_the_others(gateway):
    """A choice's request that fails fails the completion (400 here), and the others are cancelled."""
    import openai

    class OneFails(ChoicesBackend):
        async def generate(self, tensors, request_id, model=None):
            if request_id.endswith("-1"):
                self.requests.append(dict(tensors))
                raise errors.from_triton("[INVALID_ARG] sampling_parameters: bad")
                yield
            async for delta in super().generate(tensors, request_id):
                await asyncio.sleep(0.05)
                yield delta

    backend = OneFails()
    client = sdk(gateway(backend))
    with pytest.raises(openai.BadRequestError, match="bad"):
        client.chat.completions.create(model="mm_ensemble", messages=[user("Hi")], n=3)
    assert (backend.closed, backend.completed) == (2, 0)  # the two others were closed before their end


def test_prompt_logprobs_as_vllm_serve_gives_them(gateway):
    """vLLM's ``prompt_logprobs``: passed to the engine, answered at the completion's top level (the
    first response's); refused when streamed, as ``vllm serve`` refuses it."""
    import openai

    steps = [None, {"8": {"logprob": -1.25, "rank": 2, "decoded_token": "y"}}]
    first = Delta("Hel", [1], None, 20, 1, None, prompt_logprobs=steps)
    backend = FakeBackend([first, *STREAM[1:]])
    client = sdk(gateway(backend))
    reply = client.chat.completions.create(
        model="mm_ensemble", messages=[user("Hi")], extra_body={"prompt_logprobs": 1}
    )
    assert reply.model_extra is not None and reply.model_extra["prompt_logprobs"] == steps
    assert json.loads(backend.requests[0]["sampling_parameters"][0])["prompt_logprobs"] == 1
    plain = client.chat.completions.create(model="mm_ensemble", messages=[user("Hi")])
    assert "prompt_logprobs" not in (plain.model_extra or {})
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="mm_ensemble", messages=[user("Hi")], stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert info.value.param == "prompt_logprobs" and "stream=True" in info.value.message


def test_sdk_sees_openai_errors_with_their_status(gateway):
    import openai

    backend = FakeBackend(error=errors.from_triton("[INVALID_ARG] image[0]: cannot identify the image file"))
    client = sdk(gateway(backend))
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="mm_ensemble", messages=[user("Hi")], stream=stream)
        assert info.value.status_code == 400 and "cannot identify" in info.value.message
    backend.error = errors.from_grpc("UNAVAILABLE", "connection refused")
    with pytest.raises(openai.InternalServerError) as server_error:
        client.chat.completions.create(model="mm_ensemble", messages=[user("Hi")])
    assert server_error.value.status_code == 503
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="mm_ensemble", messages=[user("Hi")], n=0)
    assert info.value.param == "n"
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="gpt-4o", messages=[user("Hi")])
    assert not_found.value.code == "model_not_found"


def test_error_after_the_first_token_is_an_error_event(gateway):
    import openai

    class Failing(FakeBackend):
        async def generate(self, tensors, request_id, model=None):
            yield STREAM[0]
            raise errors.from_triton("[UNAVAILABLE] the engine died")

    client = sdk(gateway(Failing()))
    stream = client.chat.completions.create(model="mm_ensemble", messages=[user("Hi")], stream=True)
    with pytest.raises(openai.APIError, match="the engine died"):
        list(stream)


@pytest.mark.parametrize(
    "raw",
    [
        json.dumps({"model": "m", "messages": [user("Hi \u00e9 \ud83d\ude00")], "temperature": 0.7, "seed": 2**70}),
        b'{"a": 1, "a": 2, "b": [1.5e-7, -0.0, 1E+3, true, false, null], "c": {"d": "\\u00e9\\n"}}',
        b'  {"temperature": NaN, "top_p": Infinity}  ',  # json.loads takes these; msgspec does not
        b'{"top_p": 1e400}',  # inf for json.loads; out of range for msgspec
        b'\xef\xbb\xbf{"a": 1}',  # a byte-order mark
        b'{"a": "\\ud800"}',  # a lone surrogate
        b"[" * 900 + b"]" * 900,
    ],
)
def test_a_body_reads_as_json_loads_reads_it(raw):
    body = raw.encode() if isinstance(raw, str) else raw
    expected = json.loads(body)
    assert repr(app_module._decode_json(body)) == repr(expected)


@pytest.mark.parametrize("raw", [b"{not json", b'{"a": 1', b'{"a": "x\x01"}', b'{"a": "\xff"}', b"[" * 100_000, b""])
def test_a_body_that_is_not_json_is_refused_with_json_loads_reason(raw):
    with pytest.raises((ValueError, RecursionError)) as reference:
        json.loads(raw)
    with pytest.raises(errors.APIError) as info:
        app_module._decode_json(raw)
    error = info.value
    assert error.status == 400 and error.code == "invalid_json"
    assert error.message == f"the request body is not valid JSON ({reference.value})"


def test_http_answers(gateway):
    client = gateway(FakeBackend(), served_model_name="qwen-omni")
    assert client.get("/v1/models").json()["data"][0]["id"] == "qwen-omni"
    assert client.get("/v1/models/qwen-omni").status_code == 200
    assert client.get("/health").status_code == 200
    reply = client.post("/v1/chat/completions", content=b"{not json")
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"
    reply = client.get("/v1/nothing")
    assert reply.status_code == 404 and set(reply.json()["error"]) == {"message", "type", "param", "code"}
    down = gateway(FakeBackend(ready=errors.unavailable("the model 'mm_ensemble' is not ready on Triton")))
    reply = down.get("/health")
    assert reply.status_code == 503 and reply.json()["error"]["type"] == "service_unavailable"
    small = gateway(FakeBackend(), max_request_bytes=100)
    reply = small.post("/v1/chat/completions", json=body(user("x" * 200)))
    assert reply.status_code == 413


def test_abort_and_missing_finish_reason(gateway):
    client = gateway(FakeBackend([Delta("x", [1], "abort", 5, 1, None)]))
    assert client.post("/v1/chat/completions", json=body(user("Hi"))).status_code == 503
    client = gateway(FakeBackend([Delta("x", [1], None, 5, 1, None)]))
    reply = client.post("/v1/chat/completions", json=body(user("Hi")))
    assert reply.status_code == 500 and "incident" in reply.json()["error"]["message"]


def test_cli_takes_every_option_the_readme_gives(capsys):
    """The README's command line of the gateway names options its ``--help`` lists."""
    import re

    from mmserve.gateway.__main__ import main

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    command = re.search(r"`python -m mmserve\.gateway (.*?)`\.", readme, re.S)
    assert command, "the README gives no gateway command line"
    options = set(re.findall(r"--[a-z][a-z-]*", command.group(1)))
    assert {"--triton-url", "--port"} <= options, options
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    listed = set(re.findall(r"--[a-z][a-z-]*", capsys.readouterr().out))
    assert options <= listed, f"in the README, not in --help: {sorted(options - listed)}"


def test_return_token_ids_as_vllm_serve_gives_them(gateway):
    """vLLM's ``return_token_ids`` extension: each choice carries its token ids (each chunk's, streamed),
    as ``vllm serve`` answers (its OpenAI protocol's ``token_ids``); without it, none."""
    backend = FakeBackend([Delta("Hello!", [1, 2, 3], "length", 20, 3, None)])
    client = gateway(backend)
    body = {"model": "mm_ensemble", "messages": [user("Hi")], "return_token_ids": True}
    reply = client.post("/v1/chat/completions", json=body).json()
    assert reply["choices"][0]["token_ids"] == [1, 2, 3]
    assert (
        "token_ids"
        not in client.post("/v1/chat/completions", json={**body, "return_token_ids": False}).json()["choices"][0]
    )

    backend.deltas = STREAM
    events = [
        line[len("data: ") :]
        for line in client.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
        if line.startswith("data: ")
    ]
    chunks = [json.loads(event) for event in events if event != "[DONE]"]
    assert [i for c in chunks for i in c["choices"][0].get("token_ids", [])] == [1, 2, 3]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Hello!"


# -- tool calling ---------------------------------------------------------------------------------
DEFS_TOOL = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {"where": {"$ref": "#/$defs/place"}},
            "$defs": {"place": {"type": "string"}},
        },
    },
}


def _vllm_request(fields: dict[str, Any]):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate(body(user("Hi"), **fields))


@pytest.mark.parametrize(
    ("fields", "sent"),
    [
        ({"tools": [WEATHER]}, {"tool_choice": "auto"}),
        ({"tools": [WEATHER], "tool_choice": "required"}, {"tool_choice": "required"}),
        (
            {"tools": [WEATHER], "tool_choice": NAMED, "parallel_tool_calls": False},
            {"tool_choice": NAMED, "parallel_tool_calls": False},
        ),
        ({"tools": [WEATHER], "tool_choice": "none"}, None),
    ],
    ids=["default", "required", "named-one", "none"],
)
def test_tools_reach_mm_llm_in_the_sampling_parameters(fields, sent):
    """``mm_llm`` gets the tools and the choice (it constrains the calls with vLLM's own parser);
    with ``none`` only the chat template sees the tools."""
    params = convert.sampling_parameters(protocol.parse_request(body(user("Hi"), **fields)))
    if sent is None:
        assert not {"tools", "tool_choice", "parallel_tool_calls"} & set(params)
    else:
        assert params["tools"] == [WEATHER] and {k: params[k] for k in sent} == sent


def test_mm_llm_constrains_the_calls_as_vllm_serve_does(tiny_models):
    """``vllm_seam.tool_call_params``: vLLM 0.32's hermes parser holds required and named calls to
    a structural tag (the ``<tool_call>`` format with the tools' schemas), leaves ``auto`` free,
    and keeps special tokens in the text; a constraint of the client's stays with ``auto``."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.tokenizers import get_tokenizer

    from mmserve import vllm_seam
    from mmserve.serving.sampling import ToolCalling, parse_generation_parameters

    engine = SimpleNamespace(tokenizer=get_tokenizer(tiny_models["qwen2_5_omni"]))
    base = SamplingParams(max_tokens=8)
    for choice in ("required", NAMED):
        params = vllm_seam.tool_call_params(engine, "hermes", base, ToolCalling([WEATHER, TIME], choice))
        tag = json.loads(params.structured_outputs.structural_tag)
        assert "<tool_call>" in json.dumps(tag) and not params.skip_special_tokens
        assert ("get_time" in json.dumps(tag)) == (choice == "required")
    auto = vllm_seam.tool_call_params(engine, "hermes", base, ToolCalling([WEATHER], "auto"))
    assert auto.structured_outputs is None and not auto.skip_special_tokens and auto.max_tokens == 8
    regex = parse_generation_parameters(
        json.dumps({"structured_outputs": {"regex": "a+"}, "tools": [WEATHER]}), stream=False
    )
    assert regex.tool_calling == ToolCalling([WEATHER], "auto")
    both = vllm_seam.tool_call_params(engine, "hermes", regex.params, regex.tool_calling)
    assert both.structured_outputs.regex == "a+" and not both.skip_special_tokens  # auto: the client's stays
    with pytest.raises(Exception, match="tool_choice"):
        parse_generation_parameters(json.dumps({"tool_choice": "required"}), stream=False)


def test_tools_reach_preprocess_and_the_conversation_keeps_its_calls():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    data = body(
        user("Weather?"),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Snow"},
        tools=[WEATHER],
    )
    chat = protocol.parse_request(data)
    conv = asyncio.run(convert.conversation(chat))
    assert conv.messages[1:] == [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "Snow", "tool_call_id": "call_1"},
    ]
    (tensors,) = convert.request_tensors(chat, conv)
    assert json.loads(tensors["tools"][0]) == [WEATHER]
    assert "tools" in wire.names(wire.PREPROCESS_INPUTS)
    # an assistant turn without text or calls is an empty text, as vLLM renders it
    conv = convert_body(body(user("a"), {"role": "assistant", "content": None}, user("b")))
    assert conv.messages[1] == {"role": "assistant", "content": ""}


HERMES_TEXTS = [
    "No call here.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ås"}}\n</tool_call>',
    '  \n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_weather", '
    '"arguments": {"city": "Rome"}}</tool_call> trailing words',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}',  # never closed
    "<tool_call>{not json}</tool_call>",
    "An early <tool_c and no call",
]


@pytest.mark.parametrize("text", HERMES_TEXTS)
def test_tool_calls_are_read_as_vllms_hermes_parser_reads_them(text, tiny_models):
    """Whole: the content and calls ``vllm serve --tool-call-parser hermes`` answers (its
    ``Hermes2ProToolParser``, through its server's rules for auto, required and named). Streamed in
    pieces of every size: the same delta as vLLM's parser for every piece (ids aside)."""
    from transformers import AutoTokenizer
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    from mmserve.gateway import tools

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen2_5_omni"])
    vllm_request = _vllm_request({"tools": [WEATHER, TIME]})
    found = Hermes2ProToolParser(tokenizer, vllm_request.tools).extract_tool_calls(text, vllm_request)
    calls = [(c.function.name, c.function.arguments) for c in found.tool_calls] if found.tools_called else []
    for mode in ("auto", "required", "named"):
        if mode == "auto":  # vLLM's server: whitespace before the calls is no content
            content = (found.content if found.content and found.content.strip() else None) if calls else text
        else:  # required and named (its auto path): the text, or what came before the calls, or ""
            content = (found.content or "") if calls else (text if text.strip() else "")
        got_content, got_calls = tools.ToolCallReader(mode).message(text)
        assert (got_content, [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls]) == (
            content,
            calls,
        ), mode
        assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in got_calls)

    for size in (1, 3, 7, len(text)):
        parser, reader = Hermes2ProToolParser(tokenizer, vllm_request.tools), tools.ToolCallReader("auto")
        sent = ""
        for at in range(0, len(text), size):
            piece = text[at : at + size]
            expected = parser.extract_tool_calls_streaming(sent, sent + piece, piece, [], [], [], vllm_request)
            sent += piece
            got = reader.feed(piece)
            assert _delta(got) == _delta(expected and expected.model_dump(exclude_none=True)), (size, at)


def _delta(delta: dict[str, Any] | None) -> tuple[str | None, list[tuple[int, str | None, str | None]]]:
    """A delta's content and calls (index, name, arguments); ids aside."""
    if delta is None:
        return None, []
    calls = [
        (call["index"], call.get("function", {}).get("name"), call.get("function", {}).get("arguments"))
        for call in delta.get("tool_calls") or []
    ]
    return delta.get("content") or None, calls


def test_one_call_when_parallel_calls_are_off():
    from mmserve.gateway import tools

    text = HERMES_TEXTS[3]
    assert len(tools.ToolCallReader("auto").message(text)[1]) == 2
    one = tools.ToolCallReader("required", parallel_tool_calls=False)
    assert [c["function"]["name"] for c in one.message(text)[1]] == ["get_time"]
    streamed = tools.ToolCallReader("auto", parallel_tool_calls=False)
    deltas = [streamed.feed(text[at : at + 4]) for at in range(0, len(text), 4)]
    assert {call["index"] for d in deltas if d for call in d.get("tool_calls", [])} == {0}
    assert one.finish_reason("stop", calls=0, streamed=False) == "tool_calls"  # required: vLLM's
    assert tools.ToolCallReader("named").finish_reason("stop", calls=1, streamed=True) == "stop"


def test_tool_calls_through_the_app_streamed_and_not(gateway):
    """The SDK sees the calls (``message.tool_calls``; streamed, joined from ``delta.tool_calls``)
    and the finish reason ``tool_calls``; the engine got the hermes flags."""
    text = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    backend = FakeBackend([Delta(text[:15], [1], None, 20, 1, None), Delta(text[15:], [2], "stop", 20, 1, None)])
    client = sdk(gateway(backend))
    request = {"model": "mm_ensemble", "messages": [user("Weather in Oslo?")], "tools": [WEATHER]}
    reply = client.chat.completions.create(**request)
    message = reply.choices[0].message
    assert message.content == "Checking." and reply.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("get_weather", '{"city": "Oslo"}')
    ]
    sampling = json.loads(backend.requests[0]["sampling_parameters"][0])
    assert sampling["tools"] == [WEATHER] and sampling["tool_choice"] == "auto"

    chunks = list(client.chat.completions.create(**request, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    joined = ("".join(t.function.name or "" for t in calls), "".join(t.function.arguments or "" for t in calls))
    assert content == "Checking." and joined == ("get_weather", '{"city": "Oslo"}')
    assert {t.index for t in calls} == {0} and calls[0].id.startswith("chatcmpl-tool-")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    none = client.chat.completions.create(**request, tool_choice="none")
    assert none.choices[0].message.content == text and not none.choices[0].message.tool_calls

    refused = gateway(FakeBackend([]), tool_call_parser="none")
    answer = refused.post("/v1/chat/completions", json=request)
    assert answer.status_code == 400 and "--tool-call-parser none" in answer.json()["error"]["message"]


def test_a_lora_adapter_is_a_model(gateway):
    """``--lora-modules``: ``model=<adapter>`` reaches mm_llm as ``lora_name`` in every choice's
    ``sampling_parameters`` (the base model's name: none), ``/v1/models`` lists each adapter with the
    base as its parent (as ``vllm serve``), an unknown model is a 404 that lists them; the command
    line takes vLLM's ``NAME=PATH`` form too."""
    from mmserve.gateway.__main__ import config_from_args

    backend = FakeBackend([Delta("Hi", [1], "length", 20, 1, None)])
    client = gateway(backend, lora_modules=("sql", "chat"))
    listed = client.get("/v1/models").json()["data"]
    assert [(card["id"], card.get("parent")) for card in listed] == [
        ("mm_ensemble", None),
        ("sql", "mm_ensemble"),
        ("chat", "mm_ensemble"),
    ]
    assert client.get("/v1/models/sql").json()["parent"] == "mm_ensemble"
    openai_client = sdk(client)
    openai_client.chat.completions.create(model="sql", messages=[user("Hi")], max_tokens=1, n=2, seed=1)
    openai_client.chat.completions.create(model="mm_ensemble", messages=[user("Hi")], max_tokens=1)
    sent = [json.loads(request["sampling_parameters"][0]) for request in backend.requests]
    assert [params.get("lora_name") for params in sent] == ["sql", "sql", None]
    reply = client.post("/v1/chat/completions", json={"model": "nope", "messages": [user("Hi")]})
    assert reply.status_code == 404 and "and its LoRA adapters ['sql', 'chat']" in reply.json()["error"]["message"]
    config, _ = config_from_args(["--lora-modules", "sql=/adapters/sql", "chat", "sql"])
    assert config.lora_modules == ("sql", "chat")


# -- text without the hop: the check (mmserve.gateway.direct) ------------------------------------------
class PreprocessBackend:
    """Triton's side of the direct path's check: ``preprocess``'s parameters, and its answer to the
    probes from ``answer`` (a function of the tensors) or ``APIError`` when ``down``."""

    def __init__(self, answer, parameters=None, down=False) -> None:
        self.answer, self.parameters, self.down = answer, parameters or {"max_messages": "64"}, down
        self.asked: list[str] = []

    async def model_parameters(self, model):
        self.asked.append(model)
        if self.down:
            raise errors.unavailable("the model server is unavailable (UNAVAILABLE); retry later")
        return self.parameters

    async def infer(self, model, tensors, outputs):
        return {"input_ids": self.answer(tensors)}


@pytest.mark.parametrize(
    "answer, state",
    [("same", "on"), ("one token more", "off")],
)
def test_the_direct_path_is_on_only_with_preprocess_ids(tiny_models, answer, state):
    """The gateway's preprocessor (the served checkpoint, preprocess's parameters) must give the ids
    Triton's preprocess gives on every probe; one differing token keeps text on the ensemble."""
    from mmserve.gateway.direct import DirectText, preprocess
    from mmserve.serving.preprocess import PreprocessError, PreprocessLimits, Preprocessor

    parameters = {"max_messages": "3", "user_control_tokens": "reject"}
    limits = PreprocessLimits.from_parameters(parameters, {"image": 1})
    reference = Preprocessor(tiny_models["qwen2_5_omni"], limits=limits, user_control_tokens="reject")

    def ids(tensors):  # as Triton answers: the ids, or INVALID_ARG (a probe over max_messages)
        try:
            out = preprocess(reference, tensors)["input_ids"]
        except PreprocessError as exc:
            raise errors.invalid(str(exc)) from None
        return out if answer == "same" else np.append(out, 0)

    backend = PreprocessBackend(ids, parameters)
    direct = DirectText(str(tiny_models["qwen2_5_omni"]), {"image": 1})
    assert asyncio.run(direct.check(backend)) == state and backend.asked == ["preprocess"]
    if state == "on":  # preprocess's own limits and policy, read from its parameters
        assert direct.preprocessor is not None and direct.preprocessor.limits.max_messages == 3
        assert direct.preprocessor.user_control_tokens == "reject"


def test_the_direct_path_waits_for_triton_and_is_off_without_the_checkpoint(tiny_models, tmp_path):
    """While Triton can't be asked, requests go through the ensemble and the check is retried; a
    --tokenizer folder that isn't a checkpoint turns the path off."""
    from mmserve.gateway import direct as direct_module

    async def scenario(path, backend):
        direct = direct_module.DirectText(path, {})
        assert direct.ready(backend) is None  # the check starts; meanwhile: the ensemble
        await asyncio.sleep(0.5)
        assert direct.ready(backend) is None
        return direct

    down = PreprocessBackend(None, down=True)
    checked = asyncio.run(scenario(str(tiny_models["qwen2_5_omni"]), down))
    assert checked.state == "unchecked" and down.asked == ["preprocess"]  # asked once, retried after RETRY_S
    missing = asyncio.run(scenario(str(tmp_path), PreprocessBackend(None)))
    assert missing.state == "off" and missing.preprocessor is None

"""Remote media (``image_url``, ``audio_url`` or ``video_url`` with an http(s) URL), only when the
operator allows them: fetched with aiohttp, a size limit and a timeout, any failure a 400 naming the
part. Off by default: a gateway that fetches URLs for its clients can be made to reach hosts they
can't (SSRF).

So even when on, it connects to public addresses only (unless ``allow_private``), and the address
checked is the one connected to: ``PublicOnlyConnector`` filters every address aiohttp is about to
connect to, an IP literal of the URL as much as a name's resolved addresses (aiohttp hands a
literal straight to the connection, past any resolver), and its socket factory checks the socket
address of each connection attempt once more. A URL is read as aiohttp reads it (yarl, which folds
a host by IDNA/UTS-46: ``127。0。0。1``, ``１２７.０.０.１`` and ``[::１]`` are ``127.0.0.1`` and
``::1`` to it, names to ``urllib.parse``), and ``is_public`` judges an IPv6 address by the IPv4
address it carries where it carries one (IPv4-mapped, -translated and -compatible, NAT64, 6to4,
Teredo). With ``allowed_domains`` it fetches from those hosts only, on every redirect too.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
from collections.abc import Sequence
from typing import Any

from mmserve.gateway.errors import APIError, invalid

MAX_REDIRECTS = 3

_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class _PrivateAddress(OSError):
    """A host or socket address that is not public (raised inside aiohttp's connection code)."""


def _network(text: str) -> ipaddress.IPv6Network:
    return ipaddress.IPv6Network(text)


_MAPPED = _network("::ffff:0:0/96")  # IPv4-mapped (RFC 4291): the socket connects to the IPv4 address
_TRANSLATED = _network("::ffff:0:0:0/96")  # IPv4-translated (RFC 2765, SIIT)
_COMPATIBLE = _network("::/96")  # IPv4-compatible (RFC 4291, deprecated): ::a.b.c.d
_NAT64 = _network("64:ff9b::/96")  # NAT64's well-known prefix (RFC 6052): a translator reaches a.b.c.d
_SIXTOFOUR = _network("2002::/16")  # 6to4 (RFC 3056): 2002:AABB:CCDD::/48 is a relay away from a.b.c.d
_TEREDO = _network("2001::/32")  # Teredo (RFC 4380): a server and a client IPv4 address
_NOT_PUBLIC_V6 = tuple(
    _network(text)
    for text in (
        "64:ff9b:1::/48",  # local-use NAT64 (RFC 8215): the site's own translator, to its own IPv4 space
        "fec0::/10",  # site-local (deprecated, RFC 3879)
        "3fff::/20",  # documentation (RFC 9637)
        "5f00::/16",  # SRv6 SIDs (RFC 9602)
    )
)
"""Not globally reachable by IANA's registry, yet ``is_global`` in Python 3.11's ``ipaddress``."""


def embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries for a translation or tunnelling mechanism: the
    hosts a packet sent to it reaches (none for an ordinary IPv6 address)."""
    low = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip in _MAPPED or ip in _TRANSLATED or ip in _COMPATIBLE or ip in _NAT64:
        return [low]
    if ip in _SIXTOFOUR:
        return [ipaddress.IPv4Address((int(ip) >> 80) & 0xFFFFFFFF)]
    if ip in _TEREDO:
        server = ipaddress.IPv4Address((int(ip) >> 64) & 0xFFFFFFFF)
        return [server, ipaddress.IPv4Address(int(low) ^ 0xFFFFFFFF)]  # the client's is stored inverted
    return []


def _public(ip: _Address) -> bool:
    return ip.is_global and not ip.is_multicast


def is_public(address: str) -> bool:
    """A globally routable unicast address (not loopback, private, link-local, reserved, ...): for
    an IPv6 address that carries an IPv4 one (``embedded_ipv4``), that IPv4 address must be public
    too; for the IPv4-mapped, -translated and -compatible forms and NAT64's it is what is judged,
    since the connection reaches that host."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv4Address):
        return _public(ip)
    if any(ip in network for network in _NOT_PUBLIC_V6):
        return False
    inner = embedded_ipv4(ip)
    if ip in _MAPPED or ip in _TRANSLATED or ip in _COMPATIBLE or ip in _NAT64:
        return _public(inner[0])
    return _public(ip) and all(_public(v4) for v4 in inner)


def literal_address(host: str) -> _Address | None:
    """The address a URL's host (as the HTTP client reads it, ``yarl``'s ``raw_host``) denotes
    literally: an IP address, or a legacy numeric IPv4 form that the system's resolver reads as one
    (``127.1``, ``0x7f.0.0.1``, ``2130706433``, ``0177.0.0.1``); ``None`` for a name."""
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except (OSError, UnicodeError, ValueError):
        return None


def _public_socket(addr_info: tuple[Any, ...]) -> socket.socket:
    """aiohttp's ``socket_factory``: the socket for one connection attempt, only to a public address
    (the last check, on the socket address itself, whatever came before)."""
    family, type_, proto, _, address = addr_info
    if not is_public(str(address[0])):
        raise _PrivateAddress(f"{address[0]} is not a public address")
    return socket.socket(family=family, type=type_, proto=proto)


@functools.cache
def public_only_connector() -> Any:
    """``PublicOnlyConnector``: an ``aiohttp.TCPConnector`` that connects to public addresses only.

    aiohttp's ``_resolve_host`` gives the addresses a connection tries: an IP literal of the URL
    as it is (the resolver is skipped), a name's from the resolver (or its DNS cache). Every one of
    them is filtered through ``is_public`` here, and a host left with none fails the connection;
    the socket factory checks each attempt's address again (``_public_socket``), so that a change
    of aiohttp's internals cannot open a way around the check. (A class made on first use: the
    gateway imports aiohttp only when remote media are on.)"""
    import aiohttp

    class PublicOnlyConnector(aiohttp.TCPConnector):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(socket_factory=_public_socket, **kwargs)

        async def _resolve_host(self, host: str, port: int, traces: Any = None) -> list[Any]:
            found = await super()._resolve_host(host, port, traces=traces)
            public = [entry for entry in found if is_public(entry["host"])]
            if not public:
                raise _PrivateAddress(f"{host} has no public address")
            return public

    return PublicOnlyConnector


def _folded(host: str) -> str:
    """A host name as the HTTP client compares it: IDNA-folded (yarl), lower case, no trailing dot."""
    import yarl

    try:
        return (yarl.URL.build(scheme="http", host=host).raw_host or host).rstrip(".").lower()
    except (ValueError, UnicodeError):
        return host.rstrip(".").lower()


class MediaFetcher:
    """``await fetcher(url, param)``: the bytes at ``url`` (at most ``max_bytes``, within ``timeout_s``).

    ``allowed_domains``: the only hosts it fetches from (exact names, as vLLM's
    ``--allowed-media-domains``; compared after IDNA folding, as the client connects), checked on
    the URL and on each redirect (``None``: any host). ``allow_private``: also connect to loopback,
    private and link-local addresses (off: a client could otherwise reach the gateway's own
    network). No proxy from the environment, no cookies kept between fetches.
    """

    def __init__(
        self,
        max_bytes: int,
        timeout_s: float,
        *,
        allowed_domains: Sequence[str] | None = None,
        allow_private: bool = False,
    ) -> None:
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self.allowed_domains = None if allowed_domains is None else frozenset(map(_folded, allowed_domains))
        self.allow_private = allow_private
        self._session: Any = None

    def _checked(self, url: Any, param: str, redirected: bool) -> Any:
        """``url`` as the client will request it (a ``yarl.URL``), after the checks that the URL
        alone allows: scheme, allowed domains, a literal address that is not public."""
        import yarl

        found = f"{'a redirect to' if redirected else 'found'} {str(url)[:80]!r}"
        try:
            parsed = url if isinstance(url, yarl.URL) else yarl.URL(url)
            host = parsed.raw_host
        except (ValueError, UnicodeError) as exc:
            raise invalid(
                f"{param}: expected an http(s) URL, {found}, which is not valid ({exc})", param=param
            ) from None
        if parsed.scheme not in ("http", "https") or not host:
            raise invalid(f"{param}: expected an http(s) URL with a host, {found}", param=param)
        if self.allowed_domains is not None and host.rstrip(".") not in self.allowed_domains:
            raise invalid(
                f"{param}: the host {host!r}{' of a redirect' if redirected else ''} is not among the "
                "allowed media domains (--allowed-media-domains)",
                param=param,
                code="media_domain_not_allowed",
            )
        literal = literal_address(host)
        if not self.allow_private and literal is not None and not is_public(str(literal)):
            raise self._private(param, host, redirected)
        return parsed

    @staticmethod
    def _private(param: str, host: str, redirected: bool, resolved: bool = False) -> APIError:
        what = f"the host {host!r} has no public address" if resolved else f"{host!r} is not a public address"
        return invalid(
            f"{param}: {what}{' (a redirect)' if redirected else ''}; this server fetches media from public hosts only",
            param=param,
            code="media_address_not_allowed",
        )

    def _session_for_fetching(self) -> Any:
        if self._session is None:
            import aiohttp

            connector = aiohttp.TCPConnector() if self.allow_private else public_only_connector()()
            self._session = aiohttp.ClientSession(
                connector=connector, trust_env=False, cookie_jar=aiohttp.DummyCookieJar()
            )
        return self._session

    async def __call__(self, url: str, param: str) -> bytes:
        self._session_for_fetching()
        try:
            async with asyncio.timeout(self.timeout_s):  # the whole fetch, redirects included
                return await self._fetch(url, param)
        except TimeoutError:
            raise invalid(
                f"{param}: fetching the media file took longer than {self.timeout_s:g} s",
                param=param,
                code="media_fetch_failed",
            ) from None

    async def _fetch(self, url: str, param: str) -> bytes:
        """The body at ``url``, following at most ``MAX_REDIRECTS`` redirects, each one checked."""
        import aiohttp
        import yarl

        target = self._checked(url, param, redirected=False)
        for hop in range(MAX_REDIRECTS + 1):
            try:
                async with self._session.get(target, allow_redirects=False) as reply:
                    if reply.status in (301, 302, 303, 307, 308) and "Location" in reply.headers:
                        location = reply.headers["Location"]
                        try:
                            following = target.join(yarl.URL(location))
                        except (ValueError, UnicodeError):
                            following = location
                        target = self._checked(following, param, redirected=True)
                        continue
                    return await self._body(reply, param)
            except aiohttp.ClientError as exc:
                if isinstance(getattr(exc, "os_error", None), _PrivateAddress) or isinstance(
                    exc.__cause__, _PrivateAddress
                ):
                    raise self._private(param, target.raw_host or "", hop > 0, resolved=True) from None
                raise invalid(
                    f"{param}: fetching the media file failed ({type(exc).__name__})",
                    param=param,
                    code="media_fetch_failed",
                ) from None
        raise invalid(f"{param}: more than {MAX_REDIRECTS} redirects", param=param, code="media_fetch_failed")

    async def _body(self, reply: Any, param: str) -> bytes:
        if reply.status != 200:
            raise invalid(
                f"{param}: fetching the media file answered HTTP {reply.status}",
                param=param,
                code="media_fetch_failed",
            )
        if (reply.content_length or 0) > self.max_bytes:
            raise self._too_large(param)
        data = bytearray()
        async for chunk in reply.content.iter_chunked(1 << 16):
            data += chunk
            if len(data) > self.max_bytes:
                raise self._too_large(param)
        if not data:
            raise invalid(f"{param}: the media file at the URL is empty", param=param, code="media_fetch_failed")
        return bytes(data)

    def _too_large(self, param: str) -> APIError:
        return invalid(
            f"{param}: the media file is larger than {self.max_bytes} bytes (--media-max-bytes)",
            param=param,
            code="media_too_large",
        )

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
            await asyncio.sleep(0)

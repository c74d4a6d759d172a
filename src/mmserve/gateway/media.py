"""Remote media (``image_url`` or ``audio_url`` with an http(s) URL), only when the operator allows
them: fetched with aiohttp, a size limit and a timeout, any failure a 400 naming the part. Off by
default: a gateway that fetches URLs for its clients can be made to reach hosts they can't (SSRF).
So even when on, it connects to public addresses only (unless ``allow_private``), checked on the
address it actually connects to (a name that resolves to 127.0.0.1 or 10.x is refused, whatever the
URL says), and with ``allowed_domains`` only to those hosts, on every redirect too."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import urllib.parse
from collections.abc import Sequence
from typing import Any

from mmserve.gateway.errors import APIError, invalid

MAX_REDIRECTS = 3


class _PrivateAddress(OSError):
    """The host resolves to no public address (raised by the resolver, inside aiohttp)."""


def is_public(address: str) -> bool:
    """A globally routable unicast address (not loopback, private, link-local, reserved, ...)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def _public_only_resolver() -> Any:
    """aiohttp's resolver, with every non-public address of a host dropped."""
    from aiohttp.resolver import DefaultResolver

    class PublicOnlyResolver(DefaultResolver):  # type: ignore[misc, valid-type]
        async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[dict[str, Any]]:
            found = await super().resolve(host, port, family)
            public = [entry for entry in found if is_public(entry["host"])]
            if not public:
                raise _PrivateAddress(f"{host} resolves to no public address")
            return public

    return PublicOnlyResolver()


class MediaFetcher:
    """``await fetcher(url, param)``: the bytes at ``url`` (at most ``max_bytes``, within ``timeout_s``).

    ``allowed_domains``: the only hosts it fetches from (exact names, as vLLM's
    ``--allowed-media-domains``), checked on the URL and on each redirect (``None``: any host).
    ``allow_private``: also connect to loopback, private and link-local addresses (off: a client
    could otherwise reach the gateway's own network).
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
        self.allowed_domains = None if allowed_domains is None else frozenset(d.lower() for d in allowed_domains)
        self.allow_private = allow_private
        self._session: Any = None

    def _check_host(self, url: str, param: str) -> None:
        parts = urllib.parse.urlsplit(url)
        host = (parts.hostname or "").lower()
        if parts.scheme.lower() not in ("http", "https") or not host:
            raise invalid(f"{param}: expected an http(s) URL, found {url[:80]!r}", param=param)
        if self.allowed_domains is not None and host not in self.allowed_domains:
            raise invalid(
                f"{param}: the host {host!r} is not among the allowed media domains (--allowed-media-domains)",
                param=param,
                code="media_domain_not_allowed",
            )
        if not self.allow_private:
            try:
                literal = is_public(host.strip("[]"))
            except ValueError:
                return  # a name: its addresses are checked when it is resolved
            if not literal:
                raise self._private(param, host)

    @staticmethod
    def _private(param: str, host: str) -> APIError:
        return invalid(
            f"{param}: {host!r} is not a public address; this server fetches media from public hosts only",
            param=param,
            code="media_address_not_allowed",
        )

    async def __call__(self, url: str, param: str) -> bytes:
        import aiohttp

        if self._session is None:
            connector = aiohttp.TCPConnector(resolver=None if self.allow_private else _public_only_resolver())
            self._session = aiohttp.ClientSession(connector=connector)
        try:
            async with asyncio.timeout(self.timeout_s):  # the whole fetch, redirects included
                return await self._fetch(url, param)
        except TimeoutError:
            raise invalid(
                f"{param}: fetching the media file took longer than {self.timeout_s:g} s",
                param=param,
                code="media_fetch_failed",
            ) from None
        except aiohttp.ClientError as exc:
            if isinstance(getattr(exc, "os_error", None), _PrivateAddress) or isinstance(
                exc.__cause__, _PrivateAddress
            ):
                raise self._private(param, urllib.parse.urlsplit(url).hostname or "") from None
            raise invalid(
                f"{param}: fetching the media file failed ({type(exc).__name__})",
                param=param,
                code="media_fetch_failed",
            ) from None

    async def _fetch(self, url: str, param: str) -> bytes:
        """The body at ``url``, following at most ``MAX_REDIRECTS`` redirects, each one checked."""
        for _ in range(MAX_REDIRECTS + 1):
            self._check_host(url, param)
            async with self._session.get(url, allow_redirects=False) as reply:
                if reply.status in (301, 302, 303, 307, 308) and "Location" in reply.headers:
                    url = urllib.parse.urljoin(url, reply.headers["Location"])
                    continue
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
                    raise invalid(
                        f"{param}: the media file at the URL is empty", param=param, code="media_fetch_failed"
                    )
                return bytes(data)
        raise invalid(f"{param}: more than {MAX_REDIRECTS} redirects", param=param, code="media_fetch_failed")

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

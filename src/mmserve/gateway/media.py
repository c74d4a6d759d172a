"""Remote media (``image_url`` or ``audio_url`` with an http(s) URL), only when the operator allows them: fetched with
aiohttp, a size limit and a timeout, any failure a 400 naming the part. Off by default: a gateway
that fetches URLs for its clients can be made to reach hosts they can't (SSRF)."""

from __future__ import annotations

import asyncio
from typing import Any

from mmserve.gateway.errors import invalid


class MediaFetcher:
    """``await fetcher(url, param)``: the bytes at ``url`` (at most ``max_bytes``, within ``timeout_s``)."""

    def __init__(self, max_bytes: int, timeout_s: float) -> None:
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self._session: Any = None

    async def __call__(self, url: str, param: str) -> bytes:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        try:
            async with self._session.get(url, allow_redirects=True, max_redirects=3) as reply:
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
        except TimeoutError:
            raise invalid(
                f"{param}: fetching the media file took longer than {self.timeout_s:g} s",
                param=param,
                code="media_fetch_failed",
            ) from None
        except aiohttp.ClientError as exc:
            raise invalid(
                f"{param}: fetching the media file failed ({type(exc).__name__})",
                param=param,
                code="media_fetch_failed",
            ) from None
        if not data:
            raise invalid(f"{param}: the media file at the URL is empty", param=param, code="media_fetch_failed")
        return bytes(data)

    def _too_large(self, param: str):
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

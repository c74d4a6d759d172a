"""Media sent inline: base64 and ``data:<type>;base64,<data>`` URLs (RFC 2397), the one decoder of
``preprocess`` (its ``image``/``audio`` elements) and the OpenAI gateway (``image_url``,
``input_audio``). Base64 only, as vLLM's server takes them; whitespace in the base64 is tolerated.

``pybase64`` (SIMD; a vLLM dependency) decodes a 600 kB image 60x faster than the standard library.
"""

from __future__ import annotations

import binascii

import pybase64

__all__ = ["DataURLError", "b64decode", "data_url_payload", "is_data_url"]


class DataURLError(ValueError):
    """Malformed base64 or data URL; the message says what is wrong, without the input."""


def is_data_url(value: str | bytes | bytearray | memoryview) -> bool:
    head = value[:5]
    return (head if isinstance(head, str) else bytes(head).decode("latin-1")).lower() == "data:"


def b64decode(data: str | bytes | memoryview, what: str = "the data") -> bytes:
    """Strict base64 (whitespace allowed) -> the bytes; ``DataURLError`` when malformed or empty."""
    try:
        raw = pybase64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):  # whitespace fails validation: drop it, then try once more
        try:
            raw = pybase64.b64decode(
                "".join(data.split()) if isinstance(data, str) else bytes(data).translate(None, b" \t\r\n\v\f"),
                validate=True,
            )
        except (binascii.Error, ValueError):
            raise DataURLError(f"{what} is not valid base64") from None
    if not raw:
        raise DataURLError(f"{what} is empty")
    return raw


def data_url_payload(url: str | bytes) -> bytes:
    """The bytes a ``data:<type>;base64,<data>`` URL carries."""
    data = url.encode("utf-8", "replace") if isinstance(url, str) else bytes(url)
    comma = data.find(b",", 5)
    if comma < 0:
        raise DataURLError("malformed data URL (no ',' before the data)")
    if not data[5:comma].lower().endswith(b";base64"):
        raise DataURLError("a data URL must be base64-encoded (data:<type>;base64,<data>)")
    return b64decode(memoryview(data)[comma + 1 :], "the data URL's payload")  # no copy of the payload

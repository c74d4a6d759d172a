"""The project's exception taxonomy: one class per answer a client can get.

=====================  ==================  ===========  ============================================
class                  Triton error code   HTTP status  meaning
=====================  ==================  ===========  ============================================
``InputError``         ``INVALID_ARG``     400          the request is wrong; the message names the
                                                        input, the item, what was expected and found
``UnavailableError``   ``UNAVAILABLE``     503          the engine can't serve now (dead, wedged,
                                                        restarting, shutting down); retry later
``CancelledError``     ``CANCELLED``       499/--       the client cancelled the request
``InternalError``      ``INTERNAL``        500          a fault of ours; the client gets an incident
                                                        id, the server log keeps the detail
=====================  ==================  ===========  ============================================

Every error a Triton model sends goes through ``public_error`` first: a ``ServiceError`` keeps its
message (scrubbed of file paths); any other exception becomes an ``InternalError`` whose traceback is
logged under a fresh incident id, so no stack trace or server path ever reaches a client.
"""

from __future__ import annotations

import logging
import re
import uuid
from typing import ClassVar

logger = logging.getLogger(__name__)


class ServiceError(Exception):
    """An error answered to the client as it is (its message is for the client)."""

    triton_code: ClassVar[str] = "INTERNAL"
    """The ``pb_utils.TritonError`` attribute the Triton adapters send."""
    http_status: ClassVar[int] = 500


class InputError(ServiceError, ValueError):
    """A request rejected for what it contains (Triton INVALID_ARG, HTTP 400)."""

    triton_code = "INVALID_ARG"
    http_status = 400


class UnavailableError(ServiceError):
    """The service can't take the request now: engine dead, wedged, restarting or stopping (503)."""

    triton_code = "UNAVAILABLE"
    http_status = 503


class CancelledError(ServiceError):
    """The client cancelled the request."""

    triton_code = "CANCELLED"
    http_status = 499


class InternalError(ServiceError):
    """A fault of the service; the message carries an incident id to find the detail in the log."""

    triton_code = "INTERNAL"
    http_status = 500


class ProcessedInputError(InputError):
    """Already-processed multimodal tensors that don't fit the model or the prompt.

    A ``ValueError`` (what vLLM's offline ``LLM`` and most callers expect of bad input). Raised
    inside vLLM's processor, it becomes a ``VLLMValidationError`` too (``mmserve.vllm_seam``), so
    that ``AsyncLLM.generate`` re-raises it to the caller as it is; this module imports no vLLM.
    """

    def __init__(
        self,
        modality: str,
        *,
        item: int | None = None,
        field: str | None = None,
        expected: object,
        found: object,
        hint: str = "",
    ) -> None:
        self.modality = modality
        self.item = item
        self.field = field
        self.expected = expected
        self.found = found
        where = modality if item is None else f"{modality} item {item}"
        if field:
            where += f", {field}"
        message = f"{where}: expected {expected}, found {found}"
        if hint:
            message += f" ({hint})"
        super().__init__(message)


# A path of two or more components (``/usr/lib/x.py``, ``/work/models/m``): never shown to a client.
_PATH = re.compile(r"(?<![\w.])/(?:[\w.@+-]+/)+[\w.@+-]*")


def scrub(message: str) -> str:
    """A message fit for a client: file paths replaced, one line, bounded length."""
    text = _PATH.sub("<path>", message).replace("\n", " ").strip()
    return text if len(text) <= 2000 else text[:2000] + " ..."


def public_error(exc: BaseException, *, context: str = "") -> ServiceError:
    """What the client is told about ``exc``.

    A ``ServiceError`` is returned with its message scrubbed. Anything else is a fault of ours: its
    traceback is logged with an incident id, and the client gets an ``InternalError`` naming the id.
    """
    if isinstance(exc, ServiceError):
        kind = next(
            k for k in (InputError, UnavailableError, CancelledError, InternalError, ServiceError) if isinstance(exc, k)
        )
        return kind(scrub(str(exc)))
    incident = uuid.uuid4().hex[:12]
    logger.error(
        "internal error %s%s",
        incident,
        f" ({context})" if context else "",
        exc_info=(type(exc), exc, exc.__traceback__),
    )
    return InternalError(f"internal error (incident {incident}); the server log has the detail")

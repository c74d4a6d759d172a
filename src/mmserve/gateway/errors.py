"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the HTTP status
that matches the class of the failure.

=========================  ======  ========================  ======================================
what failed                status  ``type``                  ``code``
=========================  ======  ========================  ======================================
the request (ours or       400     ``invalid_request_error``  ``invalid_value``, ``unknown_field``,
Triton's ``[INVALID_ARG]``)                                  ``unsupported``, ``invalid_json``, ...
an unknown ``model``       404     ``invalid_request_error``  ``model_not_found``
a body over the limit      413     ``invalid_request_error``  ``request_too_large``
Triton or the engine       503     ``service_unavailable``   ``service_unavailable``
can't serve now
Triton sent nothing for    504     ``service_unavailable``   ``timeout``
the response timeout
anything else              500     ``server_error``          ``internal_error`` (an incident id in
                                                             the message, the detail in the log)
=========================  ======  ========================  ======================================

Triton's answers are classified with ``mmserve.wire.code_of`` (the ``[CODE]`` tag the models put in
front of every message, ``mmserve.triton_seam``: ERROR_CODE_TAG; Triton's own "model not available"
answers), gRPC failures by their status (``UNAVAILABLE``: nothing listens, the connection broke).
"""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

from mmserve.wire import TAG, code_of

logger = logging.getLogger("mmserve.gateway")


class APIError(Exception):
    """An answer to the client: status, OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code="service_unavailable")


def timed_out(message: str) -> APIError:
    return APIError(504, message, type="service_unavailable", code="timeout")


def internal(detail: str, exc: BaseException | None = None) -> APIError:
    """A fault of ours or an answer we can't classify: logged under an incident id, not shown."""
    incident = uuid.uuid4().hex[:12]
    logger.error(
        "internal error %s: %s",
        incident,
        detail,
        exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None,
    )
    return APIError(
        500,
        f"internal error (incident {incident}); the gateway log has the detail",
        type="server_error",
        code="internal_error",
    )


_SAMPLING_FIELD = re.compile(r"sampling_parameters: ([a-z_]+(?:\.[a-z_]+)*)(?:[:=]| must )")


def from_triton(message: str) -> APIError:
    """An error response of the Triton model (its message as the model wrote it)."""
    code = code_of(message)
    tag = TAG.search(message)
    text = message[tag.end() :] if tag else message  # the tag is Triton's transport, not the client's
    if code == "INVALID_ARG":
        named = _SAMPLING_FIELD.match(text)  # a sampling field: vLLM's name is the request's
        return invalid(text, param=named.group(1) if named else None)
    if code in ("UNAVAILABLE", "CANCELLED"):  # CANCELLED by the server: shutting down
        return unavailable(text)
    if code == "INTERNAL":  # the model's public message: an incident id, paths already scrubbed
        return APIError(500, text, type="server_error", code="internal_error")
    return internal(f"untagged error from Triton: {message}")


_UNAVAILABLE_STATUSES = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "CANCELLED"}


def from_grpc(status: str, message: str) -> APIError:
    """A gRPC failure of the call itself (``status``: the ``grpc.StatusCode`` name)."""
    if status in _UNAVAILABLE_STATUSES:  # the detail (addresses) stays in the log
        logger.warning("Triton unavailable: %s: %s", status, message)
        return unavailable(f"the model server is unavailable ({status}); retry later")
    if code_of(message) is not None:  # Triton's own answer: model not loaded, unknown model, ...
        return from_triton(message)
    return internal(f"gRPC {status}: {message}")

"""What the Triton adapters (``model_repository/*/1/model.py``) share: errors as Triton errors,
config ``parameters``, input tensors, and ``TritonSink``, the guard of a decoupled request's responses. ``pb_utils`` (``triton_python_backend_utils``) exists only in
the Python-backend stub, so it is passed in.

Error codes and what clients see on Triton 2.51 (``mmserve.triton_seam``: ERROR_CODE_TAG): the
models send the taxonomy's code (``mmserve.errors``), but that release drops it on the two paths decoupled models answer on: gRPC
stream responses carry only a message, and the HTTP generate endpoints answer 400 for any model
error (later releases map codes to statuses). So every message also starts with its code in
brackets, ``[UNAVAILABLE] the engine failed ...``: the one part of the status that reaches every
client; ``mmserve.client`` turns it back into an exception class.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from mmserve.errors import InputError, public_error
from mmserve.wire import tagged

logger = logging.getLogger(__name__)


def triton_error(pb_utils: Any, exc: BaseException, *, context: str = "") -> Any:
    """``exc`` as a ``pb_utils.TritonError`` fit for the client (see ``mmserve.errors.public_error``)."""
    error = public_error(exc, context=context)
    return pb_utils.TritonError(tagged(error.triton_code, str(error)), getattr(pb_utils.TritonError, error.triton_code))


def error_response(pb_utils: Any, exc: BaseException, *, context: str = "") -> Any:
    return pb_utils.InferenceResponse(error=triton_error(pb_utils, exc, context=context))


def parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """The model's config.pbtxt ``parameters`` as plain strings."""
    return {key: value.get("string_value", "") for key, value in model_config.get("parameters", {}).items()}


def flag(params: Mapping[str, str], key: str, default: bool = False) -> bool:
    """A boolean config.pbtxt parameter ("true"/"false", any case; absent or empty: ``default``)."""
    value = params.get(key, "").strip().lower()
    if not value:
        return default
    if value not in ("true", "false"):
        raise ValueError(f"parameter {key}: expected true or false, found {params[key]!r}")
    return value == "true"


def read_input(pb_utils: Any, request: Any, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def first_bytes(value: np.ndarray | None, name: str) -> bytes | None:
    """The first element of a BYTES input (None: not sent, or empty); ``InputError`` if not bytes."""
    if value is None or value.size == 0:
        return None
    item = value.reshape(-1)[0]
    if not isinstance(item, bytes):
        raise InputError(f"{name}: expected a BYTES tensor, found {value.dtype}")
    return item


class TritonSink:
    """The response sender of one request of a decoupled model (``mmserve.serving.llm.ResponseSink``),
    guarded so that the request gets exactly one final response, whatever calls it from which thread.

    * Every send after the final one is dropped (and logged): Triton would refuse it.
    * ``is_cancelled()`` is never asked of a finished request (``mmserve.triton_seam``:
      NO_POLL_AFTER_FINAL): Triton 2.51 crashes
      (SIGSEGV in ``TRITONBACKEND_ResponseFactoryIsCancelled``) when a Python model asks that after
      the final response; a final send and every poll hold one lock.
    * The final send drops the sender: Triton frees the request's response factory, which holds the
      model loaded, only when the stub's sender object goes, so a guard that outlives its request
      (in a garbage cycle, an exception's traceback) does not keep the model from unloading.

    ``TritonSink.unfinished()`` counts the guards whose final response is not sent (``mm_llm``
    logs it at its stop: it must be 0); ``end_unfinished`` sends them one.
    """

    _open = 0
    _open_lock = threading.Lock()
    _live: weakref.WeakSet[TritonSink] = weakref.WeakSet()

    def __init__(self, pb_utils: Any, request: Any) -> None:
        self._pb = pb_utils
        self._sender: Any = request.get_response_sender()
        self._lock = threading.Lock()
        with TritonSink._open_lock:
            TritonSink._open += 1
            TritonSink._live.add(self)

    @classmethod
    def unfinished(cls) -> int:
        return cls._open

    @classmethod
    def end_unfinished(cls, error: BaseException, *, but: TritonSink | None = None) -> int:
        """Send ``error`` as the final response of every guard still without one (but ``but``);
        returns how many. Before a stop: a request left without its final response holds its
        model loaded (Triton frees the response factory only then), so the stop would wait for
        ``--exit-timeout-secs`` and exit 1."""
        with cls._open_lock:
            live = list(cls._live)
        ended = 0
        for sink in live:
            if sink is not but and not sink.finished:
                sink.send_error(error)
                ended += 1
        return ended

    @property
    def finished(self) -> bool:
        return self._sender is None

    def _send(self, response: Any = None, *, final: bool) -> None:
        with self._lock:
            sender = self._sender
            if sender is None:
                logger.warning("a response after the request's final one was dropped")
                return
            flags = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
            if final:
                self._sender = None
                with TritonSink._open_lock:
                    TritonSink._open -= 1
            if response is None:
                sender.send(flags=flags)
            else:
                sender.send(response, flags=flags)

    def send(self, outputs: Mapping[str, np.ndarray], *, final: bool) -> None:
        tensors = [self._pb.Tensor(name, array) for name, array in outputs.items()]
        self._send(self._pb.InferenceResponse(output_tensors=tensors), final=final)

    def send_error(self, error: BaseException) -> None:
        """The final response: ``error`` as the client gets it (``triton_error``)."""
        self._send(self._pb.InferenceResponse(error=triton_error(self._pb, error)), final=True)

    def send_final(self) -> None:
        """An empty final response."""
        self._send(final=True)

    def is_cancelled(self) -> bool:
        with self._lock:
            return self._sender is not None and self._sender.is_cancelled()

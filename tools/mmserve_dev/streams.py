"""Raw gRPC streams to a Triton server, for the tests and benchmarks that need what tritonclient's
stream hides: every message read at the wire (an error response's request id included), and a
stream kept open after its request ended (``mmserve.triton_seam`` HELD_STREAMS)."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np


def stream_request(model: str, tensors: Mapping[str, np.ndarray], request_id: str, *, empty_final: bool = False) -> Any:
    """A ``ModelInferRequest`` of ``tensors`` to ``model``; ``empty_final``: ask for Triton's empty
    final response (a decoupled model's end of stream)."""
    from tritonclient.grpc._utils import _get_inference_request

    from mmserve.client import grpc_inputs

    request = _get_inference_request(
        model_name=model,
        inputs=grpc_inputs(tensors),
        model_version="",
        request_id=request_id,
        outputs=None,
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=0,
        timeout=None,
        parameters=None,
    )
    if empty_final:
        request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


def open_stream(url: str, requests: Any) -> tuple[Any, Any]:
    """(channel, the response iterator) of a ``ModelStreamInfer`` call at ``url`` sending ``requests``."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    channel = grpc.insecure_channel(url)
    return channel, service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests)


class HeldStream:
    """A client that sends one request on a gRPC stream and keeps the stream open until ``close``
    (a half-close): Triton holds the stream's first request, and with it that request's model, until
    the stream ends (``mmserve.triton_seam`` HELD_STREAMS). ``answers``: each message's error (None:
    a response), as read."""

    def __init__(self, url: str, model: str, tensors: Mapping[str, np.ndarray], request_id: str) -> None:
        self._outgoing: queue.Queue[Any] = queue.Queue()
        self._outgoing.put(stream_request(model, tensors, request_id))
        self.answers: list[str | None] = []
        self._channel, self._stream = open_stream(url, iter(self._outgoing.get, None))
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(Exception):  # the stream ends when closed (or cut by the server)
            for message in self._stream:
                self.answers.append(message.error_message or None)

    def close(self) -> None:
        """Half-close the stream and let it go."""
        self._outgoing.put(None)
        self._thread.join(10)
        self._channel.close()

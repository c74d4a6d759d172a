"""The gateway's Triton side: a few long-lived bidirectional gRPC streams (``ModelStreamInfer``)
that carry every request to ``mm_ensemble`` (default) or any model with its tensors, responses told
apart by request id.

Leaving a request's response iteration early (the HTTP client went away, the task was cancelled,
Triton sent nothing for ``response_timeout_s``) sends ``mm_llm`` a cancel for the request's id on
the same stream (``mmserve.client.cancel_tensors``): it aborts the engine request, which Triton's
ensemble scheduler would not do for a cancelled stream either (``mmserve.triton_seam``:
CANCEL_CONTROL_INPUT).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmserve.client import LLM, cancel_tensors, new_cancel_key
from mmserve.gateway.errors import (
    APIError,
    from_grpc,
    from_triton,
    internal,
    timed_out,
    unavailable,
)
from mmserve.wire import finish_reason

HEALTH_TIMEOUT_S = 5.0
RECONNECT_BACKOFF_MS = (500, 5000)
"""The channel's first and longest wait before it connects again to a Triton that went away: a Triton
that is back is found within 5 s (gRPC's defaults, 1 s growing to 120 s, bound that wait by two
minutes after a long absence). A Triton that comes back under a new address (a container restarted
on its network) is found by the name resolver's retry."""
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 2**31 - 1),  # as tritonclient sets them: a request carries its
    ("grpc.max_receive_message_length", 2**31 - 1),  # media (up to the gateway's --max-request-bytes)
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
    ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
]


@dataclass
class Delta:
    """One response of the model: a delta when streaming, the whole output otherwise."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_input_tokens: int | None
    num_output_tokens: int
    """The response's new tokens: its ``num_output_tokens`` tensor, else ``len(token_ids)``."""
    logprobs: list[dict[str, Any]] | None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    """Per prompt token (``prompt_logprobs`` asked for): in the first response only."""


_NUMERIC = {"INT64": np.int64, "INT32": np.int32, "UINT32": np.uint32, "UINT64": np.uint64, "FP32": np.float32}


def delta_from(result: Any) -> Delta:
    """A ``Delta`` from a tritonclient ``InferResult``: read from its gRPC message in one pass (the
    gateway does this for every response; ``as_numpy`` per output costs several times more), or
    through ``as_numpy`` when the outputs are not raw (or ``result`` has only ``as_numpy``)."""
    response = result.get_response() if hasattr(result, "get_response") else None
    if response is None or len(response.raw_output_contents) != len(response.outputs):
        return _delta_via_as_numpy(result)
    return delta_from_response(response)


def delta_from_response(response: Any) -> Delta:
    """A ``Delta`` from a ``ModelInferResponse`` whose outputs are raw (as Triton sends them)."""
    if len(response.raw_output_contents) != len(response.outputs):
        from tritonclient.grpc import InferResult

        return _delta_via_as_numpy(InferResult(response))
    text = finish = logprobs = prompt = None
    ids: list[int] = []
    input_tokens: int | None = None
    output_tokens: int | None = None
    for output, data in zip(response.outputs, response.raw_output_contents, strict=True):
        name = output.name
        if output.datatype == "BYTES":
            if len(data) < 4:
                continue
            first = data[4 : 4 + int.from_bytes(data[:4], "little")].decode("utf-8")  # Triton's BYTES: length, bytes
            if name == "text_output":
                text = first
            elif name == "finish_reason":
                finish = first
            elif name == "logprobs":
                logprobs = first
            elif name == "prompt_logprobs":
                prompt = first
        elif output.datatype in _NUMERIC and data:
            values = np.frombuffer(data, dtype=_NUMERIC[output.datatype])
            if name == "output_ids":
                ids = values.tolist()
            elif name == "num_input_tokens":
                input_tokens = int(values[0])
            elif name == "num_output_tokens":
                output_tokens = int(values[0])
    return Delta(
        text=text or "",
        token_ids=ids,
        finish_reason=finish_reason(finish),
        num_input_tokens=input_tokens,
        num_output_tokens=len(ids) if output_tokens is None else output_tokens,
        logprobs=None if logprobs is None else json.loads(logprobs),
        prompt_logprobs=None if prompt is None else json.loads(prompt),
    )


def _first(result: Any, name: str) -> Any:
    value = result.as_numpy(name)
    if value is None or value.size == 0:
        return None
    item = value.reshape(-1)[0]
    return item.decode("utf-8") if isinstance(item, bytes) else item.item()


def _delta_via_as_numpy(result: Any) -> Delta:
    ids = result.as_numpy("output_ids")
    token_ids = [] if ids is None else [int(i) for i in np.asarray(ids).reshape(-1)]
    logprobs = _first(result, "logprobs")
    prompt = _first(result, "prompt_logprobs")
    output_tokens = _first(result, "num_output_tokens")
    return Delta(
        text=_first(result, "text_output") or "",
        token_ids=token_ids,
        finish_reason=finish_reason(_first(result, "finish_reason")),
        num_input_tokens=_first(result, "num_input_tokens"),
        num_output_tokens=len(token_ids) if output_tokens is None else int(output_tokens),
        logprobs=None if logprobs is None else json.loads(logprobs),
        prompt_logprobs=None if prompt is None else json.loads(prompt),
    )


def _grpc_error(exc: Any) -> APIError:
    """An ``APIError`` from a grpc ``RpcError`` or tritonclient's ``InferenceServerException``."""
    code = getattr(exc, "code", None)
    if callable(code):  # grpc.aio.AioRpcError
        status = getattr(code(), "name", str(code()))
        details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
        return from_grpc(status, details or "")
    status = exc.status() if callable(getattr(exc, "status", None)) else None  # InferenceServerException
    message = exc.message() if callable(getattr(exc, "message", None)) else str(exc)
    if status:
        return from_grpc(str(status).removeprefix("StatusCode."), message or "")
    return from_triton(message or "")


def infer_request(model: str, tensors: Mapping[str, np.ndarray], request_id: str) -> Any:
    """A ``ModelInferRequest`` (gRPC) of named arrays, asking for an empty final response (so that
    a request's end is seen on a stream shared with others)."""
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, array in tensors.items():
        tensor = request.inputs.add(name=name, datatype=np_to_triton_dtype(array.dtype), shape=list(array.shape))
        if tensor.datatype == "BYTES":
            request.raw_input_contents.append(serialize_byte_tensor(array).item() if array.size else b"")
        else:
            request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


class _Broken:
    """Put in the queue of every request of a stream that broke."""

    def __init__(self, error: APIError) -> None:
        self.error = error


CLOSE_TIMEOUT_S = 2.0
"""At the gateway's stop, how long a half-closed stream may take to end before it is cancelled."""

STREAMS = 4
"""How many long-lived streams the gateway spreads its requests over (``--triton-streams``)."""


class _Stream:
    """One long-lived ``ModelStreamInfer`` call: the requests sent on it, a reader that hands each
    response to its request's queue (in ``pending``), and the ids of the requests on it."""

    def __init__(self, stub: Any, pending: dict[str, asyncio.Queue[Any]]) -> None:
        self.ids: set[str] = set()
        self.open = True
        self._outgoing: asyncio.Queue[Any] = asyncio.Queue()
        self._call = stub.ModelStreamInfer(self._requests())
        self._reader = asyncio.get_running_loop().create_task(self._read(pending))

    async def _requests(self) -> AsyncIterator[Any]:
        while (request := await self._outgoing.get()) is not None:
            yield request

    def send(self, request: Any) -> None:
        self._outgoing.put_nowait(request)

    async def _read(self, pending: dict[str, asyncio.Queue[Any]]) -> None:
        """Hand every response to its request's queue, until the stream ends; then fail the
        requests still on it."""
        try:
            async for message in self._call:
                queue = pending.get(message.infer_response.id)
                if queue is not None:
                    queue.put_nowait(message)
            failure = unavailable("Triton closed the stream")
        except Exception as exc:  # noqa: BLE001 - every request on it learns why
            failure = _grpc_error(exc) if _is_grpc(exc) else unavailable(f"Triton's stream broke ({exc})")
        self.open = False
        for request_id in self.ids:
            if (queue := pending.get(request_id)) is not None:
                queue.put_nowait(_Broken(failure))

    async def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Half-close the stream and give Triton ``timeout_s`` to end it (once its requests are
        done); cancel it only if it has not (mmserve.triton_seam STREAM_HALF_CLOSE)."""
        self.open = False
        self._outgoing.put_nowait(None)
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(self._reader), timeout_s)
        if not self._reader.done():
            self._call.cancel()
            with contextlib.suppress(BaseException):
                await self._reader


class TritonBackend:
    """One asyncio gRPC channel to Triton (``url``: ``host:port``), requests to ``model``.

    Requests travel on ``streams`` long-lived ``ModelStreamInfer`` streams, in turn, their responses
    told apart by request id (Triton sets it on every response, errors included): opening a gRPC
    stream per request cost the gateway more CPU than anything else it did, and Triton writes one
    stream's responses one at a time, so a single stream held every request's tokens in one queue.
    Since cancelling a shared stream would cancel every request on it, a request the gateway gives
    up on (its HTTP client went away, or ``response_timeout_s``) gets a ``cancel`` control request
    to ``llm`` on its stream, which aborts it on the engine (``mmserve.client.cancel_tensors``); its
    later responses are dropped. A broken stream fails the requests on it (503), and the next
    request on its turn opens a new one.

    ``response_timeout_s``: the longest wait for Triton's next response on a request (the first one
    includes queueing, preprocessing and prefill); ``None``: no limit. A Triton that hangs (the
    engine's own watcher covers a wedged engine, not a wedged server) then costs a request this
    long, not forever.

    ``start()`` and ``close()`` run on the event loop that serves the requests (grpc.aio's channel
    belongs to it).
    """

    def __init__(
        self, url: str, model: str, response_timeout_s: float | None = None, *, llm: str = LLM, streams: int = STREAMS
    ) -> None:
        if streams < 1:
            raise ValueError(f"streams: expected at least 1, found {streams}")
        self.url, self.model, self.llm = url, model, llm
        self.response_timeout_s = response_timeout_s
        self._channel: Any = None
        self._stub: Any = None
        self._streams: list[_Stream | None] = [None] * streams
        self._turn = 0
        self._pending: dict[str, asyncio.Queue[Any]] = {}

    async def start(self) -> None:
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        self._channel = grpc.aio.insecure_channel(self.url, options=CHANNEL_OPTIONS)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def close(self) -> None:
        streams, self._streams = [s for s in self._streams if s is not None], [None] * len(self._streams)
        await asyncio.gather(*(stream.close() for stream in streams))
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()

    async def ready(self) -> None:
        """Return if Triton serves ``model`` now, else raise ``APIError`` (503). Asked on the channel
        the requests use: ready means they get through too."""
        from tritonclient.grpc import service_pb2

        try:
            reply = await self._stub.ModelReady(
                service_pb2.ModelReadyRequest(name=self.model), timeout=HEALTH_TIMEOUT_S
            )
            ready = reply.ready
        except Exception as exc:  # noqa: BLE001 - any failure to ask means: not available
            raise _grpc_error(exc) if _is_grpc(exc) else unavailable(f"Triton is unavailable ({exc})") from None
        if not ready:
            raise unavailable(f"the model {self.model!r} is not ready on Triton")

    async def model_parameters(self, model: str) -> dict[str, str]:
        """The ``parameters`` of ``model``'s configuration on Triton (key -> string value)."""
        from tritonclient.grpc import service_pb2

        try:
            reply = await self._stub.ModelConfig(service_pb2.ModelConfigRequest(name=model), timeout=HEALTH_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - classified as the requests' failures are
            raise _grpc_error(exc) if _is_grpc(exc) else unavailable(f"Triton is unavailable ({exc})") from None
        return {key: value.string_value for key, value in reply.config.parameters.items()}

    async def infer(self, model: str, tensors: Mapping[str, np.ndarray], outputs: tuple[str, ...]) -> dict[str, Any]:
        """One unary request to ``model`` (not decoupled); its ``outputs`` as arrays (BYTES: object arrays)."""
        from tritonclient.grpc import InferResult

        request = infer_request(model, tensors, f"probe-{uuid.uuid4().hex}")
        del request.parameters["triton_enable_empty_final_response"]
        try:
            reply = await self._stub.ModelInfer(request, timeout=HEALTH_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - classified as the requests' failures are
            raise _grpc_error(exc) if _is_grpc(exc) else unavailable(f"Triton is unavailable ({exc})") from None
        result = InferResult(reply)
        return {name: result.as_numpy(name) for name in outputs}

    def _next_stream(self) -> _Stream:
        """The stream whose turn it is (a new one where it broke or was never opened)."""
        turn, self._turn = self._turn, (self._turn + 1) % len(self._streams)
        stream = self._streams[turn]
        if stream is None or not stream.open:
            stream = self._streams[turn] = _Stream(self._stub, self._pending)
        return stream

    # -- one request -----------------------------------------------------------------------------
    async def update_adapters(self, update: Mapping[str, Any], operator_key: str | None) -> dict[str, str]:
        """Change the LoRA adapters ``llm`` serves (its ``lora_adapters`` control request with the
        operator's key, ``mmserve.serving.lora.parse_update``): those it serves now, name -> folder."""
        from mmserve.adapters import update_tensors

        text = ""
        async for delta in self.generate(
            update_tensors(update, operator_key), f"lora-{uuid.uuid4().hex}", model=self.llm
        ):
            text += delta.text
        return json.loads(text)

    async def generate(
        self, tensors: Mapping[str, np.ndarray], request_id: str, *, model: str | None = None
    ) -> AsyncGenerator[Delta, None]:
        """``model``'s (default: ``self.model``) responses to one request; an error response raises
        ``APIError``. Closing the iterator before its end cancels the request on the engine."""
        if request_id in self._pending:
            raise internal("a request id in use", RuntimeError(request_id))
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._pending[request_id] = queue
        stream = self._next_stream()
        stream.ids.add(request_id)
        ended = False
        cancel_key = new_cancel_key()  # only a cancel that repeats it cancels the request (mm_llm)
        try:
            stream.send(
                infer_request(
                    model or self.model, {**tensors, "cancel_key": np.array([cancel_key], np.object_)}, request_id
                )
            )
            while True:
                try:
                    async with asyncio.timeout(self.response_timeout_s):
                        message = await queue.get()
                except TimeoutError:
                    raise timed_out(
                        f"the model server sent nothing for {self.response_timeout_s:g} s; the request was cancelled"
                    ) from None
                if isinstance(message, _Broken):
                    ended = True  # nothing left to cancel on this stream
                    raise message.error
                if message.error_message:
                    ended = True
                    raise from_triton(message.error_message)
                response = message.infer_response
                final = response.parameters["triton_final_response"].bool_param
                if response.outputs:
                    yield delta_from_response(response)
                if final:
                    ended = True
                    return
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified below
            if _is_grpc(exc):
                raise _grpc_error(exc) from None
            raise internal("reading Triton's responses", exc) from None
        finally:
            del self._pending[request_id]
            stream.ids.discard(request_id)
            if not ended and stream.open:  # abort it on the engine; later responses are dropped
                stream.send(infer_request(self.llm, cancel_tensors(request_id, cancel_key), f"{request_id}.cancel"))


def _is_grpc(exc: BaseException) -> bool:
    import grpc
    from tritonclient.utils import InferenceServerException

    return isinstance(exc, grpc.RpcError | InferenceServerException)

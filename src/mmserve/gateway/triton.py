"""The gateway's Triton side: ``tritonclient``'s asyncio gRPC client, one bidirectional stream per
request, to ``mm_ensemble`` (default) or any model with its tensors.

A request is sent on its own stream, which is then half-closed: Triton ends the stream after the
request's last response. Leaving the response iteration early (the HTTP client went away, the
task was cancelled, Triton sent nothing for ``response_timeout_s``) cancels the gRPC call, and
sends ``mm_llm`` a cancel for the request's id (``mmserve.client.cancel_tensors``): Triton's
ensemble scheduler does not carry a cancellation into the running ``mm_llm`` step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmserve.client import CANCEL_TIMEOUT_S, LLM, cancel_tensors, grpc_inputs
from mmserve.gateway.errors import (
    APIError,
    from_grpc,
    from_triton,
    internal,
    timed_out,
    unavailable,
)

HEALTH_TIMEOUT_S = 5.0


@dataclass
class Delta:
    """One response of the model: a delta when streaming, the whole output otherwise."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_input_tokens: int | None
    num_output_tokens: int
    logprobs: list[dict[str, Any]] | None


_NUMERIC = {"INT64": np.int64, "INT32": np.int32, "UINT32": np.uint32, "UINT64": np.uint64, "FP32": np.float32}


def delta_from(result: Any) -> Delta:
    """A ``Delta`` from a tritonclient ``InferResult``: read from its gRPC message in one pass (the
    gateway does this for every token; ``as_numpy`` per output costs several times more), or
    through ``as_numpy`` when the outputs are not raw (or ``result`` has only ``as_numpy``)."""
    response = result.get_response() if hasattr(result, "get_response") else None
    if response is None or len(response.raw_output_contents) != len(response.outputs):
        return _delta_via_as_numpy(result)
    text = finish = logprobs = None
    ids: list[int] = []
    input_tokens: int | None = None
    output_tokens = 0
    for output, data in zip(response.outputs, response.raw_output_contents, strict=True):
        name = output.name
        if output.datatype == "BYTES":
            if len(data) < 4:
                continue
            first = data[4:4 + int.from_bytes(data[:4], "little")].decode("utf-8")  # Triton's BYTES: length, bytes
            if name == "text_output":
                text = first
            elif name == "finish_reason":
                finish = first
            elif name == "logprobs":
                logprobs = first
        elif output.datatype in _NUMERIC and data:
            values = np.frombuffer(data, dtype=_NUMERIC[output.datatype])
            if name == "output_ids":
                ids = values.tolist()
            elif name == "num_input_tokens":
                input_tokens = int(values[0])
            elif name == "num_output_tokens":
                output_tokens = int(values[0])
    return Delta(text=text or "", token_ids=ids, finish_reason=finish or None, num_input_tokens=input_tokens,
                 num_output_tokens=output_tokens, logprobs=None if logprobs is None else json.loads(logprobs))


def _first(result: Any, name: str) -> Any:
    value = result.as_numpy(name)
    if value is None or value.size == 0:
        return None
    item = value.reshape(-1)[0]
    return item.decode("utf-8") if isinstance(item, bytes) else item.item()


def _delta_via_as_numpy(result: Any) -> Delta:
    ids = result.as_numpy("output_ids")
    logprobs = _first(result, "logprobs")
    output_tokens = _first(result, "num_output_tokens")
    return Delta(
        text=_first(result, "text_output") or "",
        token_ids=[] if ids is None else [int(i) for i in np.asarray(ids).reshape(-1)],
        finish_reason=_first(result, "finish_reason") or None,
        num_input_tokens=_first(result, "num_input_tokens"),
        num_output_tokens=int(output_tokens or 0),
        logprobs=None if logprobs is None else json.loads(logprobs),
    )


def _grpc_error(exc: BaseException) -> APIError:
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


class TritonBackend:
    """One asyncio gRPC channel to Triton (``url``: ``host:port``), requests to ``model``.

    ``response_timeout_s``: the longest wait for Triton's next response on a request's stream (the
    first one includes queueing, preprocessing and prefill); ``None``: no limit. A Triton that hangs
    (the engine's own watcher covers a wedged engine, not a wedged server) then costs a request
    this long, not forever.

    ``start()`` and ``close()`` run on the event loop that serves the requests (grpc.aio's channel
    belongs to it).
    """

    def __init__(self, url: str, model: str, response_timeout_s: float | None = None, *, llm: str = LLM) -> None:
        self.url, self.model, self.llm = url, model, llm
        self.response_timeout_s = response_timeout_s
        self._client: Any = None
        self._cancels: set[asyncio.Task[bool]] = set()

    async def start(self) -> None:
        import tritonclient.grpc.aio as grpcclient

        self._client = grpcclient.InferenceServerClient(self.url)

    async def close(self) -> None:
        if self._cancels:  # cancels on their way go out first
            await asyncio.wait(list(self._cancels), timeout=CANCEL_TIMEOUT_S)
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()

    async def ready(self) -> None:
        """Return if Triton serves ``model`` now, else raise ``APIError`` (503)."""
        try:
            ready = await self._client.is_model_ready(self.model, client_timeout=HEALTH_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - any failure to ask means: not available
            raise _grpc_error(exc) if _is_grpc(exc) else unavailable(f"Triton is unavailable ({exc})") from None
        if not ready:
            raise unavailable(f"the model {self.model!r} is not ready on Triton")

    async def generate(self, tensors: Mapping[str, np.ndarray], request_id: str) -> AsyncIterator[Delta]:
        """The model's responses to one request; an error response raises ``APIError``. Closing the
        iterator before its end cancels the request on Triton."""
        request = {"model_name": self.model, "inputs": grpc_inputs(tensors), "request_id": request_id}

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield request

        call = self._client.stream_infer(one_request())
        ended = False
        try:
            while True:
                try:
                    async with asyncio.timeout(self.response_timeout_s):
                        result, error = await anext(call)
                except StopAsyncIteration:
                    ended = True
                    return
                except TimeoutError:
                    raise timed_out(f"the model server sent nothing for {self.response_timeout_s:g} s; "
                                    "the request was cancelled") from None
                if error is not None:
                    raise from_triton(_message(error))
                yield delta_from(result)
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified below
            if _is_grpc(exc):
                raise _grpc_error(exc) from None
            raise internal("reading Triton's responses", exc) from None
        finally:
            call.cancel()  # no-op once the stream ended; else Triton cancels the request
            if not ended:  # and the engine's request, which the ensemble's cancellation doesn't reach
                task = asyncio.get_running_loop().create_task(self.cancel_on_engine(request_id))
                self._cancels.add(task)
                task.add_done_callback(self._cancels.discard)

    async def cancel_on_engine(self, request_id: str) -> bool:
        """Have ``llm`` cancel the engine's request for ``request_id`` (``mmserve.client.cancel_tensors``);
        False if it did not answer in ``CANCEL_TIMEOUT_S``."""
        request = {"model_name": self.llm, "inputs": grpc_inputs(cancel_tensors(request_id)),
                   "request_id": f"{request_id}.cancel"}

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield request

        call = self._client.stream_infer(one_request())
        try:
            async with asyncio.timeout(CANCEL_TIMEOUT_S):
                async for _, error in call:  # Triton ends the stream after the (empty) final response
                    if error is not None:
                        return False
            return True
        except Exception:  # noqa: BLE001 - best effort: the Triton stream is cancelled anyway
            return False
        finally:
            call.cancel()


def _is_grpc(exc: BaseException) -> bool:
    import grpc
    from tritonclient.utils import InferenceServerException

    return isinstance(exc, grpc.RpcError | InferenceServerException)


def _message(error: Any) -> str:
    message = getattr(error, "message", None)
    return message() if callable(message) else str(error)

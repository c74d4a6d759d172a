"""A small client for the served model, over gRPC (streaming) or HTTP (Triton's generate endpoints).

Library use::

    from mmserve.client import MMClient
    client = MMClient("127.0.0.1:8001")                       # gRPC, to mm_ensemble
    result = client.generate("Describe.", images=["cat.png"], max_tokens=32)
    for delta in client.stream("Describe.", images=["cat.png"]):
        print(delta, end="", flush=True)

    http = MMClient("127.0.0.1:8000", protocol="http")        # /v2/models/<model>/generate[_stream]

    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
                    {"role": "assistant", "content": "A cat."},
                    {"role": "user", "content": "And its color?"}]
    client.generate(messages=conversation, images=["cat.png"])  # a whole conversation (docs/tensors.md)

    with client.start("Count.", max_tokens=3000) as generation:  # gRPC: a handle on the request
        for response in generation:                           # Result per streamed delta
            if enough(response):
                generation.cancel()                           # the server stops generating too

Leaving a ``stream()`` loop early cancels the request on the server as well. ``start_tensors`` and
``infer_tensors`` send named tensors as they are (e.g. to ``mm_llm``, or to ``preprocess`` to see
the token ids and features the server makes of a request).

``entry`` picks the served model (default ``mm_ensemble``). A request the client cancels (or leaves
early) is cancelled on its gRPC stream and on the engine: ``cancel_on_engine`` sends ``mm_llm`` a
control request naming the request's id and repeating its ``cancel_key`` (a random token each
request carries: only its owner can cancel it), since Triton's ensemble scheduler does not carry a
cancellation into a running step (docs/tensors.md). ``direct=True`` preprocesses on the client's side (the model's own HF processor, ``model`` = the checkpoint
directory) and calls ``mm_llm`` with the processed tensors; the result is the same.

Errors raise ``ClientError``, whose ``code`` is the server's class of error: ``INVALID_ARG`` (fix the
request), ``UNAVAILABLE`` (retry later), ``CANCELLED``, ``INTERNAL`` (``None``: not said).
"""

from __future__ import annotations

import base64
import contextlib
import json
import mimetypes
import queue
import secrets
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import numpy as np

from mmserve.wire import code_of, finish_reason

ENSEMBLE = "mm_ensemble"
LLM = "mm_llm"
Media = str | Path | bytes
Messages = Sequence[Mapping[str, Any]] | str
"""A conversation: chat messages (serialized as JSON here), or their JSON text."""


@dataclass
class Result:
    """A finished generation (streamed deltas joined), or one response of it.

    ``num_output_tokens``: the server's count where a response carries one, else ``len(output_ids)``.
    """

    text: str
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    """Per prompt token, when ``prompt_logprobs`` is asked for: None for the first, then
    ``{token id: {"logprob", "rank", "decoded_token"}}`` (the first response carries them)."""


class ClientError(RuntimeError):
    """The server answered with an error (its message is kept as is).

    ``code``: ``INVALID_ARG``, ``UNAVAILABLE``, ``CANCELLED`` or ``INTERNAL`` as the server tagged the
    message (``[CODE] ...``; Triton 2.51 carries no status code for decoupled models: ``mmserve.triton_seam``
    ERROR_CODE_TAG), ``UNAVAILABLE``
    for Triton's own "model not available" answers, else ``None``.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = code_of(message)


def _read(media: Media) -> bytes:
    return media if isinstance(media, bytes) else Path(media).read_bytes()


def _messages_json(messages: Messages) -> str:
    """The ``messages`` tensor's text: the conversation as JSON (a ``str`` is taken as JSON already)."""
    return messages if isinstance(messages, str) else json.dumps(list(messages), ensure_ascii=False)


def _data_url(media: Media) -> str:
    mime = "application/octet-stream"
    if not isinstance(media, bytes):
        mime = mimetypes.guess_type(str(media))[0] or mime
    return f"data:{mime};base64,{base64.b64encode(_read(media)).decode()}"


class MMClient:
    """Client of the ``mm_ensemble`` (or, with ``direct``, ``mm_llm``) model.

    Args:
        url: ``host:port`` of Triton's gRPC or HTTP endpoint.
        protocol: ``"grpc"`` or ``"http"``.
        entry: the model that takes raw requests (``mm_ensemble``).
        direct: preprocess locally and call ``mm_llm`` (gRPC only); needs ``model``.
        model: local checkpoint directory for ``direct``.
        timeout: seconds to wait for each response before giving up (``ClientError``).
    """

    def __init__(
        self,
        url: str,
        protocol: str = "grpc",
        *,
        entry: str = ENSEMBLE,
        direct: bool = False,
        model: str | Path | None = None,
        timeout: float = 600.0,
    ):
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol must be 'grpc' or 'http', not {protocol!r}")
        if direct and protocol != "grpc":
            raise ValueError("direct mode sends tensors: use protocol='grpc'")
        self.url, self.protocol, self.direct, self.entry = url, protocol, direct, entry
        self.timeout = timeout
        self._preprocessor = None
        if direct:
            if model is None:
                raise ValueError("direct mode needs the checkpoint directory (model=...)")
            from mmserve.serving.preprocess import Preprocessor

            self._preprocessor = Preprocessor(model)

    # -- public API ----------------------------------------------------------------------------
    def stream(
        self, text: str = "", images: Sequence[Media] = (), audios: Sequence[Media] = (), **options: Any
    ) -> Iterator[str]:
        """Yield text deltas as the server streams them (``videos=``: as for ``generate``)."""
        for response in self._responses(text, images, audios, stream=True, **options):
            yield response.text

    def generate(
        self,
        text: str = "",
        images: Sequence[Media] = (),
        audios: Sequence[Media] = (),
        *,
        stream: bool = False,
        **options: Any,
    ) -> Result:
        """Generate to completion; with ``stream`` the deltas are joined.

        ``messages=`` (here, in ``stream`` and ``start``): a whole conversation instead of ``text``;
        its image, audio and video parts refer, in order, to ``images``, ``audios`` and ``videos=``
        (video files, for models that take video). ``tools=`` (OpenAI function tools, with
        ``tool_choice=`` and ``parallel_tool_calls=``) go to the chat template and to the engine,
        which holds the model's calls to them (``<tool_call>`` blocks in the text)."""
        result = Result(text="")
        for response in self._responses(text, images, audios, stream=stream, **options):
            result.text += response.text
            result.output_ids += response.output_ids
            result.finish_reason = response.finish_reason or result.finish_reason
            result.num_input_tokens = response.num_input_tokens or result.num_input_tokens
            result.prompt_logprobs = result.prompt_logprobs or response.prompt_logprobs
            if response.num_output_tokens is not None:
                result.num_output_tokens = (result.num_output_tokens or 0) + response.num_output_tokens
        return result

    def start(
        self,
        text: str = "",
        images: Sequence[Media] = (),
        audios: Sequence[Media] = (),
        *,
        stream: bool = True,
        messages: Messages | None = None,
        videos: Sequence[Media] = (),
        **options: Any,
    ) -> Generation:
        """Send a request (gRPC) and return at once: iterate the ``Generation`` for its responses (a
        ``Result`` per delta; one in all without ``stream``), or ``cancel()`` it from any thread."""
        if self.protocol != "grpc":
            raise ValueError("start() streams over gRPC: use protocol='grpc'")
        params, flags, apply_chat_template = self._options(stream, **options)
        audio_in_video = flags.pop("use_audio_in_video", False)
        tensors = self._tensors(
            text, images, audios, apply_chat_template, messages, videos, params.get("tools"), audio_in_video
        )
        tensors["sampling_parameters"] = np.array([json.dumps(params).encode()], dtype=np.object_)
        for name, value in flags.items():
            tensors[name] = np.array([value])
        return self.start_tensors(tensors)

    def start_tensors(self, tensors: Mapping[str, np.ndarray], *, model: str | None = None) -> Generation:
        """Send named tensors as they are to a decoupled ``model`` (default: the entry, or ``mm_llm``
        with ``direct``) over a gRPC stream; see ``start``."""
        if self.protocol != "grpc":
            raise ValueError("tensors travel over gRPC: use protocol='grpc'")
        return Generation(self.url, model or (LLM if self.direct else self.entry), tensors, timeout=self.timeout)

    def infer_tensors(self, tensors: Mapping[str, np.ndarray], *, model: str) -> dict[str, np.ndarray]:
        """One plain gRPC infer of a non-decoupled ``model`` (``preprocess``): its outputs by name."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        if self.protocol != "grpc":
            raise ValueError("tensors travel over gRPC: use protocol='grpc'")
        client = grpcclient.InferenceServerClient(self.url)
        try:
            result = client.infer(model, grpc_inputs(tensors), client_timeout=self.timeout)
        except InferenceServerException as exc:
            raise ClientError(_message(exc)) from None
        finally:
            client.close()
        return {output.name: result.as_numpy(output.name) for output in result.get_response().outputs}

    # -- request building ----------------------------------------------------------------------
    @staticmethod
    def sampling_parameters(**options: Any) -> dict[str, Any]:
        """Sampling options (``max_tokens``, ``temperature``, ``top_p``, ``seed``, ...) without Nones."""
        return {k: v for k, v in options.items() if v is not None}

    def _options(
        self,
        stream: bool,
        *,
        exclude_input_in_output: bool = True,
        apply_chat_template: bool = True,
        use_audio_in_video: bool = False,
        **sampling: Any,
    ) -> tuple[dict[str, Any], dict[str, bool], bool]:
        """(sampling parameters, the request's flags, apply_chat_template) of a request's options;
        ``use_audio_in_video``: each video's audio track is heard too (Qwen2.5-Omni)."""
        flags = {
            "stream": stream,
            "exclude_input_in_output": exclude_input_in_output,
            "return_finish_reason": True,
            "return_num_input_tokens": True,
        }  # not num_output_tokens: a tensor in every response for len(output_ids) (``Result``)
        if use_audio_in_video:
            flags["use_audio_in_video"] = True
        return self.sampling_parameters(**sampling), flags, apply_chat_template

    def _responses(
        self,
        text: str,
        images: Sequence[Media],
        audios: Sequence[Media],
        *,
        stream: bool,
        messages: Messages | None = None,
        videos: Sequence[Media] = (),
        **options: Any,
    ) -> Iterator[Result]:
        if self.protocol == "http":
            yield from self._http(text, images, audios, *self._options(stream, **options), messages, videos)
        else:
            with self.start(
                text, images, audios, stream=stream, messages=messages, videos=videos, **options
            ) as generation:
                yield from generation

    def _tensors(
        self,
        text: str,
        images: Sequence[Media],
        audios: Sequence[Media],
        apply_chat_template: bool,
        messages: Messages | None = None,
        videos: Sequence[Media] = (),
        tools: Sequence[Mapping[str, Any]] | None = None,
        use_audio_in_video: bool = False,
    ) -> dict[str, np.ndarray]:
        conversation = None if messages is None else _messages_json(messages)
        tools_json = None if tools is None else json.dumps(list(tools), ensure_ascii=False)
        if self._preprocessor is not None:
            processed = self._preprocessor(
                text,
                [_read(m) for m in images],
                [_read(m) for m in audios],
                apply_chat_template=apply_chat_template,
                messages=conversation,
                videos=[_read(m) for m in videos],
                tools=tools_json,
                use_audio_in_video=use_audio_in_video,
            )
            processed["text_input"] = np.array([text.encode()], dtype=np.object_)
            return processed
        tensors = {
            "text_input": np.array([text.encode()], dtype=np.object_),
            "apply_chat_template": np.array([apply_chat_template]),
        }
        if conversation is not None:
            tensors["messages"] = np.array([conversation.encode()], dtype=np.object_)
            if not text:
                del tensors["text_input"]
        if images:
            tensors["image"] = np.array([_read(m) for m in images], dtype=np.object_)
        if audios:
            tensors["audio"] = np.array([_read(m) for m in audios], dtype=np.object_)
        if videos:
            tensors["video"] = np.array([_read(m) for m in videos], dtype=np.object_)
        if tools_json is not None:  # for the chat template; sampling_parameters carries them for the engine
            tensors["tools"] = np.array([tools_json.encode()], dtype=np.object_)
        if use_audio_in_video:
            tensors["use_audio_in_video"] = np.array([True])
        return tensors

    # -- HTTP: the generate endpoints (JSON, so media travel as data URLs) --------------------------
    def _http(
        self, text, images, audios, params, flags, apply_chat_template, messages=None, videos=()
    ) -> Iterator[Result]:
        import requests

        body: dict[str, Any] = {
            "text_input": text,
            "apply_chat_template": apply_chat_template,
            "sampling_parameters": json.dumps(params),
            **flags,
        }
        if messages is not None:
            body["messages"] = _messages_json(messages)
            if not text:
                del body["text_input"]
        if images:
            body["image"] = [_data_url(m) for m in images]
        if audios:
            body["audio"] = [_data_url(m) for m in audios]
        if videos:
            body["video"] = [_data_url(m) for m in videos]
        if "tools" in params:
            body["tools"] = json.dumps(params["tools"], ensure_ascii=False)
        endpoint = "generate_stream" if flags["stream"] else "generate"
        url = f"http://{self.url}/v2/models/{self.entry}/{endpoint}"
        with requests.post(url, json=body, stream=flags["stream"], timeout=self.timeout) as reply:
            if reply.status_code != 200:
                raise ClientError(_http_error(reply))
            if not flags["stream"]:
                yield _result_from_json(reply.json())
                return
            for line in reply.iter_lines():  # bytes: json reads them as UTF-8 (requests would guess Latin-1)
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[len(b"data:") :])
                if "error" in event:
                    raise ClientError(event["error"])
                yield _result_from_json(event)


class Generation:
    """One request in flight on its own gRPC stream (the model is decoupled), from ``MMClient.start``.

    Iterate it for the responses, a ``Result`` each, until the final one (once: the iteration is
    single-use); an error response raises ``ClientError``. ``cancel()``, from any thread, stops the
    request on the server and ends the iteration. As a context manager, leaving it (or an iteration
    left early) cancels the request unless it ended (its final response, or an error, came).

    ``tensors`` are sent as they are, with a ``cancel_key`` of the request's own added (unless they
    hold one): the secret its cancel repeats.
    """

    def __init__(
        self,
        url: str,
        model: str,
        tensors: Mapping[str, np.ndarray],
        *,
        timeout: float = 600.0,
        request_id: str | None = None,
        llm: str = LLM,
    ) -> None:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        self.url, self.model, self.timeout, self.llm = url, model, timeout, llm
        self.request_id = request_id or uuid.uuid4().hex
        if "cancel_key" not in tensors:
            tensors = {**tensors, "cancel_key": np.array([new_cancel_key()], dtype=np.object_)}
        sent = tensors["cancel_key"].reshape(-1)
        self.cancel_key: bytes = sent[0] if sent.size else b""  # empty: sent without one (not cancellable)
        inputs = grpc_inputs(tensors)
        self._answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self._finished = False
        self._lock = threading.Lock()
        self._client: Any = grpcclient.InferenceServerClient(url)
        self._results = self._read()
        self._cancel_id = f"{self.request_id}.cancel"
        self._cancel_answered = threading.Event()
        self._ended = threading.Event()  # the request's final response (or error) arrived
        try:
            self._client.start_stream(callback=self._on_answer)
            self._client.async_stream_infer(model, inputs, request_id=self.request_id, enable_empty_final_response=True)
        except InferenceServerException as exc:  # the stream broke first: its callback has why
            try:
                _, cause = self._answers.get(timeout=5)
            except queue.Empty:
                cause = exc
            self._finished = True  # nothing in flight to cancel
            self.close()
            raise ClientError(_message(cause if cause is not None else exc)) from None

    def __iter__(self) -> Iterator[Result]:
        return self._results

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def cancel(self) -> None:
        """Cancel the request on the server; an iteration ends (after the responses already here)."""
        self._answers.put((None, None))  # wakes an iteration waiting for the next response
        self.close()

    def close(self) -> None:
        """Close the stream, cancelling the request unless it ended: on the engine (a
        ``cancel_tensors`` control request to ``llm`` on this stream, its answer awaited); the
        request's own end (``CANCELLED``) is then awaited, and only if it does not come within
        ``CANCEL_TIMEOUT_S`` is the gRPC stream's request cancelled (Triton 2.51 can leave an
        ensemble request cancelled mid-step counted in flight: ``mmserve.triton_seam`` CANCEL_CONTROL_INPUT)."""
        with self._lock:
            client, self._client = self._client, None
        if client is None:
            return
        finished = self._finished or self._ended.is_set()
        if not finished:
            try:
                client.async_stream_infer(
                    self.llm,
                    grpc_inputs(cancel_tensors(self.request_id, self.cancel_key)),
                    request_id=self._cancel_id,
                    enable_empty_final_response=True,
                )
                sent = True
            except Exception:  # noqa: BLE001 - the stream broke: a stream of its own, below
                sent = False
            if not (sent and self._cancel_answered.wait(CANCEL_TIMEOUT_S)):
                cancel_on_engine(self.url, self.request_id, self.cancel_key, llm=self.llm)
            finished = self._ended.wait(CANCEL_TIMEOUT_S)
        client.stop_stream(cancel_requests=not finished)  # mmserve.triton_seam STREAM_HALF_CLOSE
        client.close()

    def _on_answer(self, result: Any, error: Any) -> None:
        """The stream's callback: the control request's answer, or the request's."""
        if result is not None and result.get_response().id == self._cancel_id:
            self._cancel_answered.set()
            return
        self._answers.put((result, error))
        if error is not None:  # errors carry no id: the control's, or the request's end; no more waiting
            self._cancel_answered.set()
            self._ended.set()
        elif result.get_response().parameters["triton_final_response"].bool_param:
            self._ended.set()

    def _read(self) -> Iterator[Result]:
        try:
            while True:
                try:
                    result, error = self._answers.get(timeout=self.timeout)
                except queue.Empty:
                    raise ClientError(f"no response from the server within {self.timeout:.0f} s") from None
                if result is None and error is None:  # cancelled
                    return
                if error is not None:  # the request's end (its error is the final response)
                    self._finished = True
                    raise ClientError(_message(error))
                response = result.get_response()
                self._finished = response.parameters["triton_final_response"].bool_param
                if response.outputs:
                    yield _result_from(result.as_numpy)
                if self._finished:
                    return
        finally:
            self.close()


CANCEL_TIMEOUT_S = 5.0
"""How long ``cancel_on_engine`` waits for ``mm_llm``'s answer."""


def new_cancel_key() -> bytes:
    """A fresh ``cancel_key`` for one request: 192 random bits (``mmserve.serving.owners``)."""
    return secrets.token_urlsafe(24).encode()


def cancel_tensors(request_id: str, cancel_key: bytes) -> dict[str, np.ndarray]:
    """The control request that has ``mm_llm`` cancel the request in flight whose Triton request id
    is ``request_id`` and whose ``cancel_key`` is ``cancel_key`` (docs/tensors.md): Triton's
    ensemble gives each step the ensemble request's id (and passes the key on), so this reaches an
    ``mm_ensemble`` request too, whose running step the ensemble scheduler can't cancel. A cancel
    that overtakes its request (still in ``preprocess``) waits for it in ``mm_llm``."""
    return {
        "input_ids": np.zeros(0, dtype=np.int64),
        "cancel": np.array([request_id.encode()], dtype=np.object_),
        "cancel_key": np.array([cancel_key], dtype=np.object_),
    }


def cancel_on_engine(
    url: str, request_id: str, cancel_key: bytes, *, llm: str = LLM, timeout: float = CANCEL_TIMEOUT_S
) -> bool:
    """Send ``cancel_tensors(request_id, cancel_key)`` to ``llm`` (decoupled: over a gRPC stream of
    its own) and wait for its answer; False if none came in ``timeout`` or the server refused it."""
    import tritonclient.grpc as grpcclient

    answered = threading.Event()
    outcome: list[Any] = []

    def on_answer(result: Any, error: Any) -> None:
        outcome.append(error)
        answered.set()

    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=on_answer)
        client.async_stream_infer(
            llm,
            grpc_inputs(cancel_tensors(request_id, cancel_key)),
            request_id=f"{request_id}.cancel",
            enable_empty_final_response=True,
        )
        return answered.wait(timeout) and outcome[0] is None
    except Exception:  # noqa: BLE001 - best effort: the server may be gone; the stream was cancelled anyway
        return False
    finally:
        with contextlib.suppress(Exception):
            # Half-closed once answered: a stream cancelled after its request ended can keep its
            # model loaded for good (mmserve.triton_seam STREAM_HALF_CLOSE).
            client.stop_stream(cancel_requests=not answered.is_set())
            client.close()


def grpc_inputs(tensors: Mapping[str, np.ndarray]) -> list[Any]:
    """tritonclient gRPC inputs (for its blocking and asyncio clients alike) from named arrays."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in tensors.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _message(error: Any) -> str:
    """The server's message of a tritonclient error (its str() adds a status prefix, or none)."""
    message = getattr(error, "message", None)
    return message() if callable(message) else str(error)


def _http_error(reply: Any) -> str:
    try:
        return reply.json().get("error", reply.text)
    except ValueError:
        return reply.text


def _scalar(value: Any) -> Any:
    array = np.asarray(value).reshape(-1)
    if array.size == 0:
        return None
    item = array[0]
    return item.decode() if isinstance(item, bytes) else item.item() if hasattr(item, "item") else item


def _result_from(get: Any) -> Result:
    def optional(name: str) -> Any:
        try:
            value = get(name)
        except Exception:  # noqa: BLE001 - tritonclient raises for outputs not in the response
            return None
        return None if value is None else _scalar(value)

    ids = get("output_ids")
    output_ids = [] if ids is None else [int(i) for i in np.asarray(ids).reshape(-1)]
    output_tokens = optional("num_output_tokens")
    prompt = optional("prompt_logprobs")
    return Result(
        text=optional("text_output") or "",
        output_ids=output_ids,
        finish_reason=finish_reason(optional("finish_reason")),
        num_input_tokens=optional("num_input_tokens"),
        num_output_tokens=len(output_ids) if output_tokens is None else output_tokens,
        prompt_logprobs=None if prompt is None else json.loads(prompt),
    )


def _result_from_json(event: Mapping[str, Any]) -> Result:
    def first(name: str) -> Any:
        value = event.get(name)
        return value[0] if isinstance(value, list) and value and name != "output_ids" else value

    ids = event.get("output_ids") or []
    output_ids = [int(i) for i in (ids if isinstance(ids, list) else [ids])]
    output_tokens = first("num_output_tokens")
    prompt = first("prompt_logprobs")
    return Result(
        text=first("text_output") or "",
        output_ids=output_ids,
        finish_reason=finish_reason(first("finish_reason")),
        num_input_tokens=first("num_input_tokens"),
        num_output_tokens=len(output_ids) if output_tokens is None else output_tokens,
        prompt_logprobs=None if prompt is None else json.loads(prompt),
    )

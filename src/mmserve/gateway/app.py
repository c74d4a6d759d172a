"""The FastAPI app: ``POST /v1/chat/completions`` (streamed as server-sent events, or not),
``GET /v1/models``, ``GET /health``.

A request: the JSON body read (bounded), validated (``protocol``), converted to Triton tensors
(``convert``; media decoded from base64 or fetched), sent on the shared gRPC stream (``triton``).
The HTTP status is chosen once the model's first response (or error) is in: an error that Triton
answers at once (a bad image, too many images, a bad sampling value, the engine down) is a proper
400/503, not a broken stream. A client that goes away (streaming or not) cancels the Triton
request and the engine's (``triton.TritonBackend``).

With ``api_keys`` (``--api-key``), every path under ``/v1`` (and vLLM's other guarded prefixes)
needs ``Authorization: Bearer <one of them>``, as ``vllm serve --api-key`` asks it
(``AuthenticationMiddleware``); ``/health`` stays open, for probes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmserve import operator
from mmserve.gateway import tools
from mmserve.gateway.convert import FETCHES_IN_FLIGHT, MEDIA_LIMITS, conversation, openai_logprobs, request_tensors
from mmserve.gateway.direct import DirectText, direct_tensors
from mmserve.gateway.errors import APIError, internal, invalid, logger, unavailable
from mmserve.gateway.media import MediaFetcher
from mmserve.gateway.protocol import ChatCompletionRequest, parse_request
from mmserve.gateway.triton import STREAMS, Delta, TritonBackend
from mmserve.operator import OPERATOR_HEADER

DEFAULT_MODEL = "mm_ensemble"


@dataclass(frozen=True)
class GatewayConfig:
    triton_url: str = "127.0.0.1:8001"
    model: str = DEFAULT_MODEL
    """The Triton model requests go to (``mm_ensemble``, or any model with its tensors)."""
    llm_model: str = "mm_llm"
    """The model that runs the engine behind ``model``: a cancelled request is cancelled there too."""
    served_model_name: str | None = None
    """The ``model`` name clients use and ``/v1/models`` lists (default: ``model``)."""
    allow_remote_media: bool = False
    allowed_media_domains: tuple[str, ...] | None = None
    """With ``allow_remote_media``: the only hosts media are fetched from (``None``: any public host)."""
    allow_private_media: bool = False
    """With ``allow_remote_media``: also fetch from loopback, private and link-local addresses."""
    media_max_bytes: int = 20 * 1024 * 1024
    media_timeout_s: float = 10.0
    limit_mm_per_prompt: Mapping[str, int] = field(default_factory=lambda: dict(MEDIA_LIMITS))
    """The most media items of each modality in one request (vLLM's ``limit_mm_per_prompt``),
    counted before anything is decoded or fetched; a modality absent is left to the model."""
    media_fetches_in_flight: int = FETCHES_IN_FLIGHT
    """With ``allow_remote_media``: the most items of one request fetched at once."""
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    """Keys one of which a request to ``/v1`` must bear (``Authorization: Bearer``); none: open."""
    max_request_bytes: int = 128 * 1024 * 1024
    response_timeout_s: float | None = 300.0
    """The longest wait for Triton's next response on a request (``None``: no limit); then the
    request is cancelled and answered 504 (``mmserve.gateway.triton.TritonBackend``)."""
    triton_streams: int = STREAMS
    """The long-lived gRPC streams to Triton that requests take in turn (``TritonBackend``)."""
    tool_call_parser: str = "hermes"
    """How ``tool_choice: "auto"`` reads calls in the text (``mmserve.gateway.tools``); ``none``
    refuses ``auto``, as ``vllm serve`` without ``--enable-auto-tool-choice``."""
    lora_modules: tuple[str, ...] = ()
    """LoRA adapters of ``mm_llm``'s ``multi_lora.json`` that clients name as ``model`` (``vllm serve
    --lora-modules``): such a request is answered by that adapter (``sampling_parameters``'
    ``lora_name``); ``/v1/models`` lists each with the base model as its ``parent``."""
    runtime_lora_updating: bool = False
    """vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (``vllm serve`` with
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): off by default; each call must carry the operator's key
    (header ``mmserve-operator-key``, as Triton's restricted APIs), which the gateway passes on to
    ``mm_llm``'s ``lora_adapters`` control request."""
    operator_key: str | None = field(default=None, repr=False)
    """The operator's key (``mmserve.operator``), for ``runtime_lora_updating``."""
    tokenizer: str | None = None
    """The served checkpoint's folder: a request without media is rendered and tokenized here and
    goes to ``llm_model`` directly, once checked to give Triton's ``preprocess`` ids
    (``mmserve.gateway.direct``); None: every request goes to ``model``."""

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


class _ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


def create_app(config: GatewayConfig, backend: Any = None) -> FastAPI:
    """The app; ``backend`` (default: a ``TritonBackend`` on ``config.triton_url``) for tests."""
    backend = (
        backend
        if backend is not None
        else TritonBackend(
            config.triton_url,
            config.model,
            config.response_timeout_s,
            llm=config.llm_model,
            streams=config.triton_streams,
        )
    )
    fetcher = (
        MediaFetcher(
            config.media_max_bytes,
            config.media_timeout_s,
            allowed_domains=config.allowed_media_domains,
            allow_private=config.allow_private_media,
        )
        if config.allow_remote_media
        else None
    )
    direct = DirectText(config.tokenizer, config.limit_mm_per_prompt) if config.tokenizer else None
    created = int(time.time())
    served = Served(list(config.lora_modules))  # the adapters clients may name: runtime updates change it

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        if direct is not None:
            direct.ready(backend)  # its check (a processor to load, probes to compare) starts now
        try:
            yield
        finally:
            if direct is not None:
                await direct.close()
            await backend.close()
            if fetcher is not None:
                await fetcher.close()

    app = FastAPI(title="mmserve OpenAI-compatible gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    if config.api_keys:
        app.add_middleware(AuthenticationMiddleware, tokens=config.api_keys)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(error.body(), status_code=exc.status_code)

    @app.get("/health")
    async def health() -> Response:
        try:
            await backend.ready()
        except APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        return JSONResponse({"status": "ok", "model": config.model})

    def model_card(adapter: str | None = None) -> dict[str, Any]:
        card = {"id": adapter or config.name, "object": "model", "created": created, "owned_by": "mmserve"}
        if adapter is not None:  # as vllm serve lists an adapter: its base model as parent
            card.update(root=adapter, parent=config.name)
        return card

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(), *(model_card(name) for name in served.adapters)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        if model in served.adapters:
            return JSONResponse(model_card(model))
        if model not in (config.name, config.model):
            return JSONResponse(_model_not_found(model, config, served).body(), status_code=404)
        return JSONResponse(model_card())

    if config.runtime_lora_updating:

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            return await _answered(_update_adapter(request, config, backend, served, load=True), "a LoRA load")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            return await _answered(_update_adapter(request, config, backend, served, load=False), "a LoRA unload")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _answered(_chat(request, config, backend, fetcher, served, direct))

    return app


async def _answered(work: Awaitable[Response], what: str = "chat completion") -> Response:
    """``work``'s response; its ``APIError`` as the client sees one, never a traceback."""
    try:
        return await work
    except APIError as exc:
        return JSONResponse(exc.body(), status_code=exc.status)
    except _ClientGone:
        return Response(status_code=499)
    except Exception as exc:  # noqa: BLE001 - never a traceback to the client
        error = internal(what, exc)
        return JSONResponse(error.body(), status_code=error.status)


@dataclass
class Served:
    """The LoRA adapters clients may name as ``model``: ``--lora-modules``, then what the operator
    loaded or unloaded through the gateway (replaced whole: a request reads one list)."""

    adapters: list[str]


MAX_ADAPTER_REQUEST_BYTES = 1 << 16


async def _update_adapter(
    request: Request, config: GatewayConfig, backend: Any, served: Served, *, load: bool
) -> Response:
    """vLLM's ``/v1/load_lora_adapter`` (``{"lora_name", "lora_path", "load_inplace"}``) and
    ``/v1/unload_lora_adapter`` (``{"lora_name"}``), their checks and messages, the operator's only."""
    given = request.headers.get(OPERATOR_HEADER)
    if not operator.is_operator(config.operator_key, given):
        raise APIError(401, f"this endpoint needs the operator's key (header {OPERATOR_HEADER})", code="unauthorized")
    body = await _read_json(request, MAX_ADAPTER_REQUEST_BYTES)
    if not isinstance(body, dict):
        raise invalid("the request body: expected a JSON object")
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name or (load and (not isinstance(path, str) or not path)):
        raise invalid(
            "Both 'lora_name' and 'lora_path' must be provided."
            if load
            else "'lora_name' needs to be provided to unload a LoRA adapter."
        )
    if load:
        if name in (config.name, config.model):
            raise invalid(f"The lora adapter '{name}' conflicts with a served base model.")
        if name in served.adapters and not body.get("load_inplace"):
            raise invalid(
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                "place, set 'load_inplace' to True."
            )
        await backend.update_adapters({"load": {name: path}}, config.operator_key)
        served.adapters = [*(a for a in served.adapters if a != name), name]
        logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")
    if name not in served.adapters:
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", code="not_found", type="NotFoundError")
    served.adapters = [a for a in served.adapters if a != name]  # no new request names it from now
    await backend.update_adapters({"unload": [name]}, config.operator_key)
    logger.info("Removed LoRA adapter: name '%s'", name)
    return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")


GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
"""The paths an API key guards: ``vllm serve``'s (``vllm.entrypoints.serve.middleware.authenticate``);
the others (``/health``) stay open."""


class AuthenticationMiddleware:
    """As ``vllm serve --api-key`` checks a request (vLLM 0.32's ``AuthenticationMiddleware``): a
    path under ``GUARDED_PREFIXES`` needs ``Authorization: Bearer <key>`` with one of ``tokens``,
    else it is answered 401 ``{"error": "Unauthorized"}`` before the app reads the body; ``OPTIONS``
    (CORS preflight) and other paths pass. Keys are compared as SHA-256 digests with
    ``secrets.compare_digest``, every key every time: the time taken says nothing about them."""

    def __init__(self, app: Any, tokens: Sequence[str]) -> None:
        self.app = app
        self.digests = [hashlib.sha256(token.encode()).digest() for token in tokens]

    def authorized(self, scope: Any) -> bool:
        value = next((v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), None)
        if not value:
            return False
        scheme, _, token = value.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode()).digest()
        match = False
        for known in self.digests:
            match |= secrets.compare_digest(digest, known)
        return match

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if path.startswith(GUARDED_PREFIXES) and not self.authorized(scope):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _model_not_found(model: str, config: GatewayConfig, served: Served) -> APIError:
    adapters = f" and its LoRA adapters {served.adapters}" if served.adapters else ""
    return APIError(
        404,
        f"the model {model!r} does not exist; this server serves {config.name!r}{adapters}",
        param="model",
        code="model_not_found",
    )


async def _read_json(request: Request, limit: int) -> Any:
    size = int(request.headers.get("content-length") or 0)
    too_large = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    if size > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return _decode_json(body)


def _decode_json(body: bytes | bytearray) -> Any:
    """The request body as Python values, exactly as ``json.loads`` (what ``vllm serve`` parses
    with) reads it. msgspec reads it first: 6x faster on a body of base64 media (0.2 ms against
    1.3 for an 800-kB image); what it refuses (``NaN``, a byte-order mark, lone surrogates, nesting
    past the recursion limit, malformed JSON) goes to ``json.loads``, whose verdict and message stand."""
    try:
        return _JSON.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        pass
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise invalid(f"the request body is not valid JSON ({exc})", code="invalid_json") from None


_JSON = msgspec.json.Decoder()


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """``await work``, unless the HTTP client disconnects first: then ``work`` is cancelled."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled (the server stops)
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise _ClientGone
    return task.result()


async def _chat(
    request: Request,
    config: GatewayConfig,
    backend: Any,
    fetcher: MediaFetcher | None,
    served: Served,
    direct: DirectText | None = None,
) -> Response:
    chat = parse_request(await _read_json(request, config.max_request_bytes))
    lora_name = chat.model if chat.model in served.adapters else None
    if lora_name is None and chat.model not in (config.name, config.model):
        raise _model_not_found(chat.model, config, served)
    if tools.mode_of(chat) == "auto" and config.tool_call_parser == "none":
        raise invalid(
            '"auto" tool choice needs a tool call parser; this gateway runs with --tool-call-parser none',
            param="tool_choice",
        )
    conv = await conversation(
        chat,
        fetcher,
        config.media_max_bytes,
        limits=config.limit_mm_per_prompt,
        fetches_in_flight=config.media_fetches_in_flight,
    )
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    answer = _Answer(chat, completion_id, config.name)
    choices = request_tensors(chat, conv, lora_name=lora_name)
    model = config.model
    preprocessor = None if direct is None or conv.images or conv.audios or conv.videos else direct.ready(backend)
    if preprocessor is not None:  # text only: rendered here, straight to the engine (mmserve.gateway.direct)
        first = await direct_tensors(preprocessor, choices[0])  # the choices differ in their sampling only
        choices = [{**first, "sampling_parameters": c["sampling_parameters"]} for c in choices]
        model = config.llm_model
    ids = [completion_id] if len(choices) == 1 else [f"{completion_id}-{index}" for index in range(len(choices))]
    deltas = _merged(
        [backend.generate(tensors, request_id, model=model) for tensors, request_id in zip(choices, ids, strict=True)]
    )
    try:
        if not chat.stream:

            async def collect() -> dict[str, Any]:
                async for index, delta in deltas:
                    answer.add(index, delta)
                return answer.completion()

            return JSONResponse(await _unless_disconnected(request, collect()))
        first = await _unless_disconnected(request, _next(deltas))
    except BaseException:
        await deltas.aclose()
        raise
    if first is None:
        await deltas.aclose()
        raise internal("the model's stream ended without a response")
    return EventStream(
        _events(answer, first, deltas),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _merged(streams: list[AsyncGenerator[Delta, None]]) -> AsyncGenerator[tuple[int, Delta], None]:
    """The responses of a request's choices as they come, each with its choice's index; every
    stream is read to its end (``READ_STREAM_TO_END``). An error on one ends them all (closing a
    stream cancels its request); so does closing this iterator."""
    if len(streams) == 1:  # the common case: no task, no queue
        try:
            async for delta in streams[0]:
                yield 0, delta
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[Delta, None]) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
            await queue.put((index, None))
        except Exception as exc:  # noqa: BLE001 - raised to the reader below
            await queue.put((index, exc))

    pumps = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def _next(deltas: AsyncGenerator[tuple[int, Delta], None]) -> tuple[int, Delta] | None:
    async for item in deltas:
        return item
    return None


class _Choice:
    """One choice as it comes in: text, token ids, logprobs, token count, finish reason."""

    def __init__(self, index: int, reader: tools.ToolCallReader | None) -> None:
        self.index = index
        self.tools = reader  # None: the request has no tools
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict[str, Any]] = []
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.content_frame: tuple[str, str] | None = None  # _Answer.content_event's


class _Answer:
    """One completion (its ``n`` choices) as it comes in; OpenAI's objects of it."""

    def __init__(self, chat: ChatCompletionRequest, completion_id: str, model: str) -> None:
        self.chat, self.id, self.model = chat, completion_id, model
        self.created = int(time.time())
        self.choices = [_Choice(index, tools.reader(chat)) for index in range(chat.n or 1)]
        self.prompt_tokens = 0
        self.prompt_logprobs: list[dict[str, Any] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(choice.finish_reason is not None for choice in self.choices)

    def add(self, index: int, delta: Delta) -> list[dict[str, Any]] | None:
        """Take one response of choice ``index``; its logprobs entries (OpenAI's) when asked for."""
        choice = self.choices[index]
        if delta.num_input_tokens is not None:
            self.prompt_tokens = delta.num_input_tokens  # the same prompt for every choice: counted once
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        choice.completion_tokens += delta.num_output_tokens
        choice.text.append(delta.text)
        choice.token_ids += delta.token_ids
        entries = None
        if self.chat.logprobs:
            entries = openai_logprobs(delta.logprobs or [], delta.token_ids, self.chat.top_logprobs or 0)
            choice.logprobs += entries
        if delta.finish_reason:
            if delta.finish_reason not in ("stop", "length"):  # abort: the server dropped the request
                raise unavailable(f"the request ended early ({delta.finish_reason}); retry later")
            choice.finish_reason = delta.finish_reason
        return entries

    def usage(self) -> dict[str, int]:
        completion_tokens = sum(choice.completion_tokens for choice in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def completion(self) -> dict[str, Any]:
        if not self.finished:
            raise internal("the model's responses ended without a finish reason")
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": choice.index,
                    **self._message(choice),
                    "logprobs": {"content": choice.logprobs, "refusal": None} if self.chat.logprobs else None,
                    **({"token_ids": choice.token_ids} if self.chat.return_token_ids else {}),
                }
                for choice in self.choices
            ],
            "usage": self.usage(),
            **({"prompt_logprobs": self.prompt_logprobs} if self.chat.prompt_logprobs is not None else {}),
        }

    @staticmethod
    def _message(choice: _Choice) -> dict[str, Any]:
        """A whole choice's ``message`` and ``finish_reason``."""
        text = "".join(choice.text)
        assert choice.finish_reason is not None
        if choice.tools is None:
            return {
                "message": {"role": "assistant", "content": text, "refusal": None},
                "finish_reason": choice.finish_reason,
            }
        content, calls = choice.tools.message(text)
        return {
            "message": {"role": "assistant", "content": content, "refusal": None, "tool_calls": calls},
            "finish_reason": choice.tools.finish_reason(choice.finish_reason, calls=len(calls), streamed=False),
        }

    def chunk(
        self,
        delta: dict[str, Any],
        *,
        index: int = 0,
        finish_reason: str | None = None,
        logprobs: list[dict[str, Any]] | None = None,
        token_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
            "finish_reason": finish_reason,
        }
        if token_ids is not None:
            choice["token_ids"] = token_ids
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [choice],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def content_event(self, index: int, text: str) -> bytes:
        """``_sse(self.chunk({"content": text}, index=index))``, the event of every streamed token,
        with the JSON around the text serialized once per choice instead of once per token."""
        choice = self.choices[index]
        if choice.content_frame is None:
            marker = json.dumps({"content": ""}, ensure_ascii=False)
            head, tail = json.dumps(self.chunk({"content": ""}, index=index), ensure_ascii=False).split(marker)
            choice.content_frame = (f"data: {head}", f"{tail}\n\n")
        head, tail = choice.content_frame
        return f"{head}{json.dumps({'content': text}, ensure_ascii=False)}{tail}".encode()

    @property
    def include_usage(self) -> bool:
        return bool(self.chat.stream_options and self.chat.stream_options.include_usage)


def _tool_events(answer: _Answer, choice: _Choice, delta: Delta) -> list[bytes]:
    """The events of one response of a choice whose text is read for tool calls: the content and
    calls it brings (``tools.ToolCallReader``), then, when it is the last, the finish reason."""
    assert choice.tools is not None
    entries = answer.add(choice.index, delta)
    message = choice.tools.feed(delta.text)
    token_ids = delta.token_ids if answer.chat.return_token_ids else None
    events = []
    if message is not None or entries or token_ids:
        events.append(_sse(answer.chunk(message or {}, index=choice.index, logprobs=entries, token_ids=token_ids)))
    if choice.finish_reason is not None:
        reason = choice.tools.finish_reason(choice.finish_reason, calls=choice.tools.calls_sent, streamed=True)
        events.append(_sse(answer.chunk({}, index=choice.index, finish_reason=reason)))
    return events


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def _events(
    answer: _Answer, first: tuple[int, Delta], deltas: AsyncGenerator[tuple[int, Delta], None]
) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed completion (each choice's role first, as vLLM sends
    them); an error after the first event is sent as an ``{"error": ...}`` event (the HTTP status is
    200 by then), which the SDKs raise."""
    try:
        for choice in answer.choices:
            yield _sse(answer.chunk({"role": "assistant", "content": ""}, index=choice.index))
        # Every stream is read to its end, a finished choice's too: closing one early would cancel
        # a request Triton is completing, which crashes Triton 2.51 (triton_seam: READ_STREAM_TO_END).
        item: tuple[int, Delta] | None = first
        while item is not None:
            index, delta = item
            choice = answer.choices[index]
            if choice.finish_reason is None and choice.tools is not None:
                for event in _tool_events(answer, choice, delta):
                    yield event
            elif choice.finish_reason is None:
                entries = answer.add(index, delta)
                if answer.chat.return_token_ids:
                    if delta.text or delta.token_ids:
                        yield _sse(
                            answer.chunk(
                                {"content": delta.text}, index=index, logprobs=entries, token_ids=delta.token_ids
                            )
                        )
                elif entries is None and delta.text:
                    yield answer.content_event(index, delta.text)
                elif delta.text or entries:
                    yield _sse(answer.chunk({"content": delta.text}, index=index, logprobs=entries))
                if (reason := answer.choices[index].finish_reason) is not None:
                    yield _sse(answer.chunk({}, index=index, finish_reason=reason))
            item = await _next(deltas)
        if not answer.finished:
            raise internal("the model's stream ended without a finish reason")
        if answer.include_usage:
            yield _sse(
                {
                    "id": answer.id,
                    "object": "chat.completion.chunk",
                    "created": answer.created,
                    "model": answer.model,
                    "system_fingerprint": None,
                    "choices": [],
                    "usage": answer.usage(),
                }
            )
        yield _sse("[DONE]")
    except APIError as exc:
        yield _sse(exc.body())
    except Exception as exc:  # noqa: BLE001
        logger.debug("stream failed", exc_info=True)
        yield _sse(internal("streaming a completion", exc).body())
    finally:
        await deltas.aclose()  # cancels the Triton requests that still run


class EventStream(StreamingResponse):
    """A streamed response that stops as soon as the client disconnects (whatever the ASGI server's
    spec version), and always closes its body iterator, so that the Triton request is cancelled
    then and not when the generator is garbage-collected."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the connection broke while sending
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(watch)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]

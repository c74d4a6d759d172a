"""What the ``mm_llm`` Triton model runs: read a request's tensors, generate with vLLM, shape the
responses the way Triton's vLLM backend does.

``model.py`` adapts Triton to three things here: ``LLMConfig`` (from ``model.json``),
``parse_request`` (input tensors -> ``GenerateRequest``) and ``LLMService`` (runs requests on the
engine and answers through a ``ResponseSink``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from vllm import SamplingParams
from vllm.exceptions import VLLMClientError
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind

from mmserve.engine import EngineRunner
from mmserve.families import FamilySpec
from mmserve.inputs import family_of_checkpoint, processed_prompt, resolve_model
from mmserve.serving.contract import FEATURE_TENSORS, INPUT_IDS

logger = logging.getLogger(__name__)

FLAG_INPUTS = (
    "stream",
    "exclude_input_in_output",
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
)


CANCEL_POLL_S = 0.1
"""How often each request in flight checks whether its client cancelled it."""


class RequestError(ValueError):
    """A request ``mm_llm`` rejects before it reaches the engine (Triton INVALID_ARG)."""


@dataclass(frozen=True)
class LLMConfig:
    """``model.json``: vLLM engine arguments, ``model`` resolved to a checkpoint directory."""

    engine_args: dict[str, Any]

    @classmethod
    def from_file(cls, path: str | Path) -> LLMConfig:
        path = Path(path)
        args = json.loads(path.read_text())
        args["model"] = resolve_model(args.get("model"), path.parent)
        return cls(args)

    @property
    def model(self) -> str:
        return self.engine_args["model"]


@dataclass
class GenerateRequest:
    """One ``mm_llm`` request, read and checked."""

    prompt: dict[str, Any]
    sampling_params: SamplingParams
    flags: dict[str, bool] = field(default_factory=dict)
    text_input: str | None = None

    @property
    def stream(self) -> bool:
        return self.flags.get("stream", False)


# -- reading a request ---------------------------------------------------------------------------
@functools.cache
def _sampling_fields() -> dict[str, type]:
    """SamplingParams' scalar fields and their types (JSON strings are converted to them)."""
    scalar: dict[str, type] = {}
    for name, hint in typing.get_type_hints(SamplingParams).items():
        kinds = set(typing.get_args(hint)) or {hint}
        scalar_kind = next((kind for kind in (bool, int, float) if kind in kinds), None)
        if scalar_kind is not None:
            scalar[name] = scalar_kind
    return scalar


def parse_sampling_parameters(text: str | None, *, stream: bool, logprobs: bool) -> SamplingParams:
    """``sampling_parameters`` JSON -> ``SamplingParams`` (strings of numbers/bools accepted, as
    genai-perf and the vLLM backend's clients send them)."""
    try:
        params = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        raise RequestError(f"sampling_parameters: invalid JSON ({exc})") from None
    if not isinstance(params, dict):
        raise RequestError(f"sampling_parameters: expected a JSON object, found {type(params).__name__}")
    scalar = _sampling_fields()
    unknown = sorted(set(params) - set(typing.get_type_hints(SamplingParams)))
    if unknown:
        raise RequestError(f"sampling_parameters: unknown parameter(s) {unknown}")
    for key, kind in scalar.items():
        value = params.get(key)
        if isinstance(value, str):
            try:
                params[key] = (value.lower() in ("1", "true", "yes")) if kind is bool else kind(value)
            except ValueError:
                raise RequestError(f"sampling_parameters: {key}: expected {kind.__name__}, found {value!r}") from None
    if params.get("n", 1) != 1:
        raise RequestError(f"sampling_parameters: n: only 1 completion per request is served, found {params['n']}")
    if logprobs and params.get("logprobs") is None:
        params["logprobs"] = 1
    params["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        return SamplingParams(**params)
    except (TypeError, ValueError, VLLMClientError) as exc:
        raise RequestError(f"sampling_parameters: {exc}") from None


def parse_request(family: FamilySpec, get: Callable[[str], np.ndarray | None]) -> GenerateRequest:
    """Read one request through ``get(name) -> array | None`` (None: optional input not sent)."""
    ids = get(INPUT_IDS.name)
    if ids is None or ids.size == 0:
        raise RequestError("input_ids: expected a non-empty INT64 tensor of prompt token ids")
    ids = ids.reshape(-1)
    if not np.issubdtype(ids.dtype, np.integer):
        raise RequestError(f"input_ids: expected integer token ids, found dtype {ids.dtype}")

    accepted = {name for spec in family.modalities for name in spec.field_names}
    features: dict[str, np.ndarray] = {}
    for spec in FEATURE_TENSORS:
        value = get(spec.name)
        if value is None or value.size == 0:
            continue
        if spec.name not in accepted:
            raise RequestError(f"{spec.name}: the {family.name} model takes no such input "
                               f"(it takes {sorted(accepted)})")
        features[spec.name] = value

    flags = {}
    for name in FLAG_INPUTS:
        value = get(name)
        flags[name] = bool(value.reshape(-1)[0]) if value is not None and value.size else False
    sampling = get("sampling_parameters")
    sampling_text = _first_string(sampling)
    text = _first_string(get("text_input"))
    return GenerateRequest(
        prompt=processed_prompt(family, ids, features),
        sampling_params=parse_sampling_parameters(
            sampling_text, stream=flags["stream"], logprobs=flags["return_logprobs"]
        ),
        flags=flags,
        text_input=text,
    )


def _first_string(value: np.ndarray | None) -> str | None:
    if value is None or value.size == 0:
        return None
    item = value.reshape(-1)[0]
    return item.decode("utf-8", errors="replace") if isinstance(item, bytes) else str(item)


# -- answering -----------------------------------------------------------------------------------
class ResponseSink(Protocol):
    """Where one request's responses go (a Triton response sender, in ``model.py``)."""

    def send(self, outputs: Mapping[str, np.ndarray], *, final: bool) -> None: ...

    def send_error(self, message: str, *, client_error: bool) -> None:
        """Send a final error response."""

    def send_final(self) -> None:
        """Close the stream with an empty final response."""

    def is_cancelled(self) -> bool: ...


def response_tensors(request: GenerateRequest, output: RequestOutput) -> dict[str, np.ndarray]:
    """The output tensors of one response (a delta when streaming), as the vLLM backend names them."""
    completion = output.outputs[0]
    text = completion.text
    if not request.stream and not request.flags["exclude_input_in_output"]:
        text = (request.text_input or "") + text
    tensors: dict[str, np.ndarray] = {
        "text_output": np.array([text.encode("utf-8")], dtype=np.object_),
        "output_ids": np.asarray(completion.token_ids, dtype=np.int64),
    }
    flags = request.flags
    if flags["return_finish_reason"]:
        reason = completion.finish_reason or ""
        tensors["finish_reason"] = np.array([str(reason).encode()], dtype=np.object_)
    if flags["return_cumulative_logprob"]:
        tensors["cumulative_logprob"] = np.array([completion.cumulative_logprob or 0.0], dtype=np.float32)
    if flags["return_logprobs"]:
        logprobs = [
            {str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token, lp in step.items()}
            for step in (completion.logprobs or [])
        ]
        tensors["logprobs"] = np.array([json.dumps(logprobs).encode()], dtype=np.object_)
    if flags["return_num_input_tokens"]:
        tensors["num_input_tokens"] = np.array([len(output.prompt_token_ids or [])], dtype=np.uint32)
    if flags["return_num_output_tokens"]:
        tensors["num_output_tokens"] = np.array([len(completion.token_ids)], dtype=np.uint32)
    return tensors


class LLMService:
    """The engine and the requests in flight on it.

    Args:
        runner: the engine (``LLMService.start`` creates it from ``model.json``'s arguments).
    """

    def __init__(self, runner: EngineRunner) -> None:
        self.runner = runner
        self.family = family_of_checkpoint(runner.engine_args["model"])
        self._in_flight: set[asyncio.Future[Any]] = set()
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()

    @classmethod
    def start(cls, config: LLMConfig, stat_loggers: list[Any] | None = None) -> LLMService:
        """Start an engine for ``config`` (``stat_loggers``: vLLM stat logger factories)."""
        engine_args = {k: v for k, v in config.engine_args.items() if k != "model"}
        return cls(EngineRunner(config.model, stat_loggers=stat_loggers, **engine_args))

    def submit(self, request: GenerateRequest, sink: ResponseSink, request_id: str) -> None:
        """Start ``request`` on the engine; responses go to ``sink`` (from the engine's thread)."""
        future = self.runner.submit(self._run(request, sink, request_id))
        with self._lock:
            self._in_flight.add(future)
            self._idle.clear()
        future.add_done_callback(self._done)

    def _done(self, future: Any) -> None:
        with self._lock:
            self._in_flight.discard(future)
            if not self._in_flight:
                self._idle.set()

    async def _run(self, request: GenerateRequest, sink: ResponseSink, request_id: str) -> None:
        cancelled = asyncio.Event()
        watchdog = asyncio.create_task(self._abort_when_cancelled(sink, request_id, cancelled))
        try:
            last: dict[str, np.ndarray] | None = None
            async for output in self.runner.stream(request.prompt, request.sampling_params, request_id):
                if cancelled.is_set():  # the client is gone: nothing more to say
                    break
                tensors = response_tensors(request, output)
                if request.stream:
                    sink.send(tensors, final=output.finished)
                    if output.finished:
                        return
                else:
                    last = tensors
            if cancelled.is_set() or request.stream:  # cancelled, or the stream ended unfinished
                sink.send_final()
            elif last is not None:
                sink.send(last, final=True)
            else:
                sink.send_error("the engine returned no output", client_error=False)
        except (ValueError, VLLMClientError) as exc:  # bad request, found by vLLM's input processing
            sink.send_error(str(exc), client_error=True)
        except asyncio.CancelledError:
            sink.send_error("request cancelled: the model is shutting down", client_error=False)
            raise
        except Exception as exc:  # noqa: BLE001 - the engine's own failure, answered, not raised
            cause = exc.__cause__ or exc
            logger.exception("request %s failed", request_id)
            sink.send_error(f"{type(cause).__name__}: {cause}", client_error=False)
        finally:
            watchdog.cancel()

    async def _abort_when_cancelled(self, sink: ResponseSink, request_id: str, cancelled: asyncio.Event) -> None:
        """Poll the client's cancellation (Triton has no callback for it) and abort the engine
        request then; works for non-streaming requests too, which produce no output to check on."""
        while not sink.is_cancelled():
            await asyncio.sleep(CANCEL_POLL_S)
        cancelled.set()
        await self.runner.engine.abort(request_id)

    def shutdown(self, timeout: float = 60.0) -> None:
        """Let in-flight requests finish (up to ``timeout``), then stop the engine."""
        if not self._idle.wait(timeout):
            logger.warning("shutting down with %d request(s) in flight", len(self._in_flight))
        self.runner.shutdown()

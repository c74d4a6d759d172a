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
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from vllm import SamplingParams
from vllm.exceptions import VLLMClientError
from vllm.outputs import RequestOutput

from mmserve import vllm_seam, wire
from mmserve.engine import SHUTDOWN_GRACE_S, EngineRunner
from mmserve.errors import CancelledError, InputError, ServiceError, UnavailableError, public_error
from mmserve.families import FamilySpec
from mmserve.families.base import WireDecoder
from mmserve.inputs import family_of_checkpoint, processed_prompt, read_engine_config
from mmserve.serving.contract import ENCODED_TENSORS, FEATURE_TENSORS, INPUT_IDS
from mmserve.serving.lora import AdapterError, Adapters
from mmserve.serving.outbox import Outbox
from mmserve.serving.owners import Owner, Owners
from mmserve.serving.sampling import STRUCTURED_KINDS, ToolCalling, parse_generation_parameters

logger = logging.getLogger(__name__)

FLAG_INPUTS = wire.names(wire.FLAG_INPUTS)


CANCEL_POLL_S = 0.25
"""How often the watcher asks Triton whether the clients of the requests in flight cancelled them
(each ask is a round trip to tritonserver per request; it matters to clients of ``mm_llm`` itself
that only cancel their stream: through the ensemble the ``cancel`` control request does it)."""

STOP_WAIT_S = 2.0
"""At a stop or a drain, the longest wait for each step: the requests cancelled to answer, the
responses to go out, the watcher to end (the engine's own stop: ``mmserve.engine.SHUTDOWN_GRACE_S``)."""
STOPPING = "the server is stopping; retry on another replica or later"
"""What a request refused or ended by a drain or a stop is told (``UNAVAILABLE``)."""

STREAM_FLUSH_MS = 150.0
"""A stream's shortest interval between two responses after its first (``mm_llm``'s
``stream_flush_ms`` parameter; per request in ``sampling_parameters``): the deltas of a busy
engine's steps travel as one response (docs/PERFORMANCE.md: "The cost of a streamed token"). 0: a
response per engine output."""


class RequestError(InputError):
    """A request ``mm_llm`` rejects before it reaches the engine (Triton INVALID_ARG)."""


@dataclass(frozen=True)
class HealthConfig:
    """How ``LLMService`` watches its engine (``mm_llm``'s config.pbtxt ``parameters``).

    Args:
        check_interval_s: how often the watcher looks at the engine.
        stall_timeout_s: an engine with requests in flight that produces no output and finishes no
            step for this long is wedged. Size it above the longest prefill step of the model.
    """

    check_interval_s: float = 0.5
    stall_timeout_s: float = 20.0


@dataclass(frozen=True)
class LLMConfig:
    """``model.json``: vLLM engine arguments, ``model`` resolved to a checkpoint directory."""

    engine_args: dict[str, Any]
    adapters: Adapters = field(default_factory=lambda: Adapters({}))
    """The LoRA adapters served (``multi_lora.json`` beside ``model.json``; none: LoRA off)."""

    @classmethod
    def from_file(cls, path: str | Path) -> LLMConfig:
        """``model.json`` at ``path``, and its ``multi_lora.json`` where it enables LoRA."""
        engine_args = read_engine_config(path)
        adapters = Adapters.from_model_dir(Path(path).parent, engine_args)
        if adapters.enabled:  # the vLLM backend takes "true" as well
            engine_args["enable_lora"] = True
        return cls(engine_args, adapters)

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
    stream_flush_ms: float | None = None
    """The request's own ``stream_flush_ms`` (``sampling_parameters``); None: the model's."""
    tool_calling: ToolCalling | None = None
    """The request's tools (``sampling_parameters``): the engine's constraint of its calls."""
    lora_request: Any = None
    """The adapter that answers (``sampling_parameters``' ``lora_name``): vLLM's ``LoRARequest``; None: the base model."""
    logprobs_asked: bool = False
    """``sampling_parameters`` asks for ``logprobs`` (else the ``logprobs`` output is null)."""

    @property
    def stream(self) -> bool:
        return self.flags.get("stream", False)


# -- reading a request ---------------------------------------------------------------------------
def parse_request(
    family: FamilySpec,
    get: Callable[[str], np.ndarray | None],
    *,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
    wire_decoders: Mapping[str, WireDecoder] | None = None,
    adapters: Adapters | None = None,
) -> GenerateRequest:
    """Read one request through ``get(name) -> array | None`` (None: optional input not sent).

    ``vocab_size`` bounds the prompt's token ids (an id past the embedding table would fail inside
    the model, in the engine process); ``max_model_len`` bounds ``max_tokens`` (as ``vllm serve``
    does: more is refused, not cut to the context length). ``wire_decoders``
    (``FamilySpec.wire_decoders``) turn the family's wire fields (``pixel_values_uint8``) back into
    its fields; without them those are refused. ``adapters``: the LoRA adapters a request may name
    (``lora_name``); without them a name is refused.
    """
    ids = get(INPUT_IDS.name)
    if ids is None or ids.size == 0:
        raise RequestError("input_ids: expected a non-empty INT64 tensor of prompt token ids")
    ids = ids.reshape(-1)
    if not np.issubdtype(ids.dtype, np.integer):
        raise RequestError(f"input_ids: expected integer token ids, found dtype {ids.dtype}")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = low if low < 0 else high
        where = int(np.flatnonzero(ids == bad)[0])
        raise RequestError(
            f"input_ids: expected token ids in [0, {vocab_size or 'vocab size'}), found {bad} at position {where}"
        )

    wire_decoders = wire_decoders or {}
    accepted = {name for spec in family.specs for name in spec.field_names}
    accepted |= {name for spec in family.specs if spec.modality in wire_decoders for name in spec.wire_field_names}
    features: dict[str, np.ndarray] = {}
    for spec in (*FEATURE_TENSORS, *ENCODED_TENSORS):
        value = get(spec.name)
        if value is None or value.size == 0:
            continue
        if spec.name not in accepted:
            raise RequestError(
                f"{spec.name}: the {family.name} model takes no such input (it takes {sorted(accepted)})"
            )
        features[spec.name] = value
    item_ids: dict[str, list[str]] = {}  # the wire items' identities: vLLM hashes no decoded item
    features = family.decode_wire(features, wire_decoders, item_ids=item_ids)

    flags = {}
    for name in FLAG_INPUTS:
        value = get(name)
        flags[name] = bool(value.reshape(-1)[0]) if value is not None and value.size else False
    if flags["stream"] and get("exclude_input_in_output") is not None and not flags["exclude_input_in_output"]:
        # The vLLM backend's rule: a stream sends the generated text only, in deltas.
        raise RequestError("exclude_input_in_output: When streaming, `exclude_input_in_output` = False is not allowed.")
    sampling = parse_generation_parameters(
        first_string(get("sampling_parameters"), "sampling_parameters"),
        stream=flags["stream"],
        cumulative_logprob=flags["return_cumulative_logprob"],
    )
    max_tokens = sampling.params.max_tokens
    if max_model_len is not None and max_tokens is not None and max_tokens > max_model_len:
        raise RequestError(
            f"sampling_parameters: max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}; "
            "request fewer output tokens"
        )
    return GenerateRequest(
        prompt=processed_prompt(family, ids, features, item_ids=item_ids),
        sampling_params=sampling.params,
        flags=flags,
        text_input=first_string(get("text_input"), "text_input"),
        stream_flush_ms=sampling.stream_flush_ms,
        tool_calling=sampling.tool_calling,
        lora_request=(adapters or Adapters({})).resolve(sampling.lora_name),
        logprobs_asked=sampling.logprobs_asked,
    )


def first_string(value: np.ndarray | None, name: str) -> str | None:
    """The first element of a BYTES tensor as text; ``InputError`` if it is not UTF-8."""
    if value is None or value.size == 0:
        return None
    item = value.reshape(-1)[0]
    if not isinstance(item, bytes):
        return str(item)
    try:
        return item.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"{name}: not valid UTF-8 (byte 0x{item[exc.start]:02x} at offset {exc.start})") from None


# -- answering -----------------------------------------------------------------------------------
class ResponseSink(Protocol):
    """Where one request's responses go (a Triton response sender, in ``model.py``)."""

    def send(self, outputs: Mapping[str, np.ndarray], *, final: bool) -> None: ...

    def send_error(self, error: ServiceError) -> None:
        """Send a final error response (``error`` is fit for the client: see ``public_error``)."""

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
    # As Triton's vLLM backend answers: finish_reason "None" before the last response, the
    # output's cumulative logprob so far, logprobs null unless sampling_parameters asked for them.
    if flags["return_finish_reason"]:
        tensors["finish_reason"] = np.array([str(completion.finish_reason).encode()], dtype=np.object_)
    if flags["return_cumulative_logprob"]:
        tensors["cumulative_logprob"] = np.array([completion.cumulative_logprob], dtype=np.float32)
    if flags["return_logprobs"]:
        logprobs = (
            [
                {
                    str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                    for token, lp in step.items()
                }
                for step in (completion.logprobs or [])
            ]
            if request.logprobs_asked
            else None
        )
        tensors["logprobs"] = np.array([json.dumps(logprobs).encode()], dtype=np.object_)
    if output.prompt_logprobs:  # asked for (sampling_parameters.prompt_logprobs): the first output has them
        tensors["prompt_logprobs"] = np.array(
            [json.dumps(prompt_logprobs(output.prompt_logprobs)).encode()], np.object_
        )
    if flags["return_num_input_tokens"]:
        tensors["num_input_tokens"] = np.array([len(output.prompt_token_ids or [])], dtype=np.uint32)
    if flags["return_num_output_tokens"]:
        tensors["num_output_tokens"] = np.array([len(completion.token_ids)], dtype=np.uint32)
    return tensors


def prompt_logprobs(steps: Sequence[Mapping[int, Any] | None]) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt logprobs as JSON: per prompt token null (the first) or ``{token id: {logprob,
    rank, decoded_token}}``, -inf as -9999.0 (as ``vllm serve`` answers them)."""

    def value(logprob: float) -> float:
        return -9999.0 if logprob == float("-inf") else logprob

    return [
        None
        if step is None
        else {
            str(token): {"logprob": value(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token, lp in step.items()
        }
        for step in steps
    ]


@dataclass
class _InFlight:
    """One request on the engine: its future on the loop, where its responses go, and whether it was
    cancelled (by its client, or by a ``cancel`` control request)."""

    sink: ResponseSink
    flush_s: float = 0.0  # a stream's shortest interval between two responses (after its first)
    future: Any = None  # done once _run has posted the request's final response
    # On the engine's loop only: _run's task once it runs, and whether it is to stop (``_stop``).
    task: asyncio.Task[None] | None = None
    stopping: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    # What waits for the outbox: engine outputs and calls (final, error), in order.
    pending: list[RequestOutput | Callable[[], None]] = field(default_factory=list)
    scheduled: bool = False  # a drain of ``pending`` is queued in the outbox
    sent_at: float | None = None  # when the last response went out (None: none yet)
    timer: asyncio.TimerHandle | None = None  # a drain held back until flush_s after sent_at
    lock: threading.Lock = field(default_factory=threading.Lock)


class LLMService:
    """The engine, the requests in flight on it, and a watcher of the engine's health.

    The engine's asyncio loop does engine work only: it reads the engine's outputs and hands them
    to an ``Outbox``, whose thread builds the response tensors and sends them to Triton (a blocking
    call into the server). When the outbox falls behind (many streams, few cores), the deltas of a
    stream that queued up meanwhile go out as one response (``RequestOutput.add``, as vLLM's own
    output collector merges them): fewer, larger responses instead of a growing backlog. After
    its first response a stream gets at most one per ``stream_flush_ms`` (its last at once). One
    watcher thread checks the clients' cancellations of every request in flight
    (``CANCEL_POLL_S``) and the engine's health (``health.check_interval_s``).

    A dead engine (its core process gone) or a wedged one (requests in flight, no progress for
    ``health.stall_timeout_s``) fails the service: every request in flight and every later one is
    answered ``UnavailableError``, the engine is killed, and ``on_failure(reason)`` is called once
    (``mm_llm`` asks Triton to reload the model there: a new engine, readiness false meanwhile).

    Args:
        runner: the engine (``LLMService.start`` creates it from ``model.json``'s arguments).
        health: the watcher's settings.
        stream_flush_ms: the default of a stream's shortest interval between two responses after
            its first (``STREAM_FLUSH_MS``); a request's ``sampling_parameters`` may set its own.
        on_failure: called once, from the watcher's thread, after the service failed; not once
            ``shutdown`` began, and ``shutdown`` waits for a call in progress (in ``mm_llm`` it is
            ``pb_utils.unload_model``: a stub that makes that call while its model is being
            finalized crashes tritonserver 2.51: ``mmserve.triton_seam`` NO_UNLOAD_WHILE_FINALIZING).
    """

    def __init__(
        self,
        runner: EngineRunner,
        *,
        health: HealthConfig | None = None,
        on_failure: Callable[[str], None] | None = None,
        stream_flush_ms: float = STREAM_FLUSH_MS,
        adapters: Adapters | None = None,
    ) -> None:
        self.runner = runner
        self.adapters = Adapters({})  # replaced whole by an update: a request reads one set
        self._adapters_lock = threading.Lock()  # one update at a time
        try:
            self.update_adapters(adapters or Adapters({}))  # loaded now: vLLM checks each against the model
        except AdapterError:
            runner.shutdown()
            raise
        self.stream_flush_ms = stream_flush_ms
        self.family = family_of_checkpoint(runner.engine_args["model"])
        self.wire_decoders = self.family.wire_decoders(runner.engine_args["model"])
        self.vocab_size: int | None = runner.vocab_size
        self.max_model_len: int | None = runner.max_model_len
        self.health = health or HealthConfig()
        self._on_failure = on_failure
        self._in_flight: dict[str, _InFlight] = {}
        self._owners = Owners()  # who may cancel which request (mmserve.serving.owners)
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._failure: str | None = None
        self._stopping = threading.Event()
        self._draining = threading.Event()  # drain(): no new requests
        self._reporting = threading.RLock()  # held around on_failure; shutdown waits for it
        self._last_progress = time.monotonic()
        self._outbox = Outbox("mmserve-responses")
        vllm_seam.install_output_hold()  # a stream's task wakes once per response, not per engine step
        self._watcher = threading.Thread(target=self._watch, name="mmserve-engine-watch", daemon=True)
        self._watcher.start()

    @classmethod
    def start(cls, config: LLMConfig, stat_loggers: list[Any] | None = None, **kwargs: Any) -> LLMService:
        """Start an engine for ``config`` (``stat_loggers``: vLLM stat logger factories; ``kwargs``
        go to ``LLMService``)."""
        engine_args = {k: v for k, v in config.engine_args.items() if k != "model"}
        runner = EngineRunner(config.model, stat_loggers=stat_loggers, **engine_args)
        return cls(runner, adapters=config.adapters, **kwargs)

    def update_adapters(self, adapters: Adapters) -> Adapters:
        """Serve ``adapters`` (``Adapters.updated``) from now on: each new one is loaded into the
        engine first (``AdapterError`` naming the first it refuses; then nothing changes); requests
        in flight keep theirs. Returns the set served."""
        with self._adapters_lock:
            for adapter in self.adapters.new_in(adapters):
                try:
                    self.runner.submit(self.runner.engine.add_lora(adapter.request())).result()
                except Exception as exc:  # noqa: BLE001 - vLLM's reasons are many; each is the adapter's
                    raise AdapterError(
                        f"adapter {adapter.name!r} ({adapter.path}): the engine refused it: {exc}"
                    ) from None
            self.adapters = adapters
            return adapters

    # -- state ---------------------------------------------------------------------------------
    def note_progress(self) -> None:
        """The engine did work (an output arrived, a step's statistics came in)."""
        self._last_progress = time.monotonic()

    def _unavailable(self) -> UnavailableError | None:
        if self._failure is not None:
            return UnavailableError(f"the engine failed ({self._failure}); the model is being restarted, retry shortly")
        if self._stopping.is_set() or self._draining.is_set():
            return UnavailableError(STOPPING)
        return None

    # -- requests ------------------------------------------------------------------------------
    def submit(
        self, request: GenerateRequest, sink: ResponseSink, request_id: str, *, owner: Owner | None = None
    ) -> None:
        """Start ``request`` on the engine as ``request_id`` (unique); responses go to ``sink`` (from
        the outbox's thread). ``owner``: who may ``cancel`` it (None: no one, but its client through
        its own stream)."""
        flush_ms = self.stream_flush_ms if request.stream_flush_ms is None else request.stream_flush_ms
        entry = _InFlight(sink, flush_s=flush_ms / 1000 if request.stream else 0.0)
        with self._lock:
            refused: ServiceError | None = self._unavailable()
            if refused is None and not self._owners.add(owner, request_id):
                refused = CancelledError("the request was cancelled")
            if refused is None:
                if not self._in_flight:
                    self._last_progress = time.monotonic()  # the stall clock starts with the work
                self._in_flight[request_id] = entry
                self._idle.clear()
        if refused is not None:
            sink.send_error(refused)
            return
        entry.future = self.runner.submit(self._run(request, entry, request_id))
        entry.future.add_done_callback(lambda _: self._done(request_id, owner))

    def cancel(self, owner: Owner) -> int:
        """Cancel ``owner``'s requests in flight; returns how many (0: the cancel is remembered for
        its request, which may still be on its way: ``mmserve.serving.owners``)."""
        with self._lock:
            entries = [(rid, self._in_flight[rid]) for rid in self._owners.cancel(owner) if rid in self._in_flight]
        for request_id, entry in entries:
            self._abort(request_id, entry)
        return len(entries)

    def _abort(self, request_id: str, entry: _InFlight) -> None:
        """Stop a cancelled request on the engine (once); its stream then ends with a final
        ``CANCELLED`` error response."""
        if entry.cancelled.is_set():
            return
        entry.cancelled.set()
        engine = self.runner.engine
        if engine is not None:
            self.runner.submit(engine.abort(request_id))

    def _done(self, request_id: str, owner: Owner | None) -> None:
        with self._lock:
            self._in_flight.pop(request_id, None)
            self._owners.remove(owner, request_id)
            if not self._in_flight:
                self._idle.set()

    async def _run(self, request: GenerateRequest, entry: _InFlight, request_id: str) -> None:
        """On the engine's loop: read the engine's outputs, queue the responses (never call Triton here)."""
        sink, cancelled = entry.sink, entry.cancelled

        def post(item: RequestOutput | Callable[[], None]) -> None:
            self._post(entry, request, item)

        try:
            entry.task = asyncio.current_task()
            if entry.stopping:  # stopped before it ran: answered below like any stopped request
                raise asyncio.CancelledError
            last: RequestOutput | None = None
            hold = vllm_seam.OutputHold()  # a stream's next output: wanted flush_s after its last response
            if request.tool_calling is not None:  # vLLM's own constraint of the calls, as vllm serve's
                request.sampling_params = vllm_seam.tool_call_params(
                    self.runner.engine, self.family.tool_call_parser, request.sampling_params, request.tool_calling
                )
            with vllm_seam.holding(hold):
                async for output in self.runner.stream(
                    request.prompt, request.sampling_params, request_id, lora_request=request.lora_request
                ):
                    self._last_progress = hold.until = time.monotonic()
                    if cancelled.is_set():  # the client is gone: nothing more to say
                        break
                    if request.stream:
                        post(output)
                        if output.finished:
                            return
                        hold.until += entry.flush_s
                    else:
                        last = output
            if cancelled.is_set():
                post(functools.partial(sink.send_error, CancelledError("the request was cancelled")))
            elif request.stream:  # the stream ended unfinished (vLLM aborted it)
                post(sink.send_final)
            elif last is not None:
                post(last)
            else:
                post(
                    functools.partial(
                        sink.send_error, public_error(RuntimeError("the engine returned no output"), context=request_id)
                    )
                )
        except asyncio.CancelledError:  # the service failed or stops: this request can't finish
            post(functools.partial(sink.send_error, self._unavailable() or UnavailableError("the request was stopped")))
            raise
        except (ValueError, VLLMClientError) as exc:  # bad request, found by vLLM's input processing
            if self.runner.engine is None or self.runner.engine.errored:
                error: ServiceError = self._unavailable() or UnavailableError("the engine is not running")
            elif isinstance(exc, ServiceError):
                error = public_error(exc)
            elif detail := vllm_seam.structured_outputs_error(self.runner.engine, request.sampling_params):
                constraint = request.sampling_params.structured_outputs
                kinds = (*STRUCTURED_KINDS, "structural_tag")  # the tag: of tool calls (ToolCalling)
                kind = next(k for k in kinds if getattr(constraint, k, None) is not None)
                error = public_error(InputError(f"sampling_parameters: structured_outputs.{kind}: {detail}"))
            else:
                error = public_error(InputError(str(exc)))
            post(functools.partial(sink.send_error, error))
        except Exception as exc:  # noqa: BLE001 - the engine's own failure, answered, not raised
            if self.runner.engine is None or self.runner.engine.errored:
                logger.warning("request %s: the engine failed (%s)", request_id, type(exc).__name__)
                error = self._unavailable() or UnavailableError(
                    "the engine failed; the model is being restarted, retry shortly"
                )
            else:
                error = public_error(exc, context=request_id)
            post(functools.partial(sink.send_error, error))

    def _post(self, entry: _InFlight, request: GenerateRequest, item: RequestOutput | Callable[[], None]) -> None:
        """On the engine's loop: queue an engine output or a call (final, error) of one request for
        the outbox.

        A stream's first response, its last and any call go out at once; the outputs in between
        wait until ``entry.flush_s`` after the stream's previous response (a timer on the loop), and
        whatever queued up meanwhile goes out as one response. The engine's collector holds them
        until ``flush_s`` after they were posted (``_run``'s ``OutputHold``: one wake-up of the task
        per response); this timer keeps the interval counted from the end of the previous send."""
        held = isinstance(item, RequestOutput) and not item.finished and entry.flush_s > 0
        with entry.lock:
            entry.pending.append(item)
            if entry.scheduled:  # a drain is queued already: it will take this one too
                return
            if held and entry.sent_at is not None:
                if entry.timer is not None:  # the held drain will take this one too
                    return
                delay = entry.sent_at + entry.flush_s - time.monotonic()
                if delay > 0:
                    entry.timer = self.runner.loop.call_later(delay, self._release, entry, request)
                    return
            if entry.timer is not None:
                entry.timer.cancel()
                entry.timer = None
            entry.scheduled = True
        self._outbox.put(functools.partial(self._drain, entry, request))

    def _release(self, entry: _InFlight, request: GenerateRequest) -> None:
        """On the engine's loop: a held drain is due."""
        with entry.lock:
            entry.timer = None
            if entry.scheduled or not entry.pending:
                return
            delay = entry.sent_at + entry.flush_s - time.monotonic() if entry.sent_at is not None else 0.0
            if delay > 0:  # the previous send ended after the timer was set (it counts from there)
                entry.timer = self.runner.loop.call_later(delay, self._release, entry, request)
                return
            entry.scheduled = True
        self._outbox.put(functools.partial(self._drain, entry, request))

    @staticmethod
    def _drain(entry: _InFlight, request: GenerateRequest) -> None:
        """On the outbox's thread: send what one request has pending, consecutive outputs merged."""
        with entry.lock:
            items, entry.pending, entry.scheduled = entry.pending, [], False
            entry.sent_at = time.monotonic()
        merged: RequestOutput | None = None
        for item in items:
            if isinstance(item, RequestOutput):
                if merged is None:
                    merged = item
                else:
                    merged.add(item, aggregate=True)
                continue
            if merged is not None:
                _send_output(entry.sink, request, merged)
                merged = None
            item()
        if merged is not None:
            _send_output(entry.sink, request, merged)
        with entry.lock:
            # the interval counts from the end of this send: a slow send can't bring the next closer
            entry.sent_at = time.monotonic()

    # -- the watcher: cancellations and health -------------------------------------------------
    def _watch(self) -> None:
        next_health_check = time.monotonic() + self.health.check_interval_s
        while not self._stopping.wait(CANCEL_POLL_S) and self._failure is None:
            self._check_cancellations()
            if time.monotonic() >= next_health_check:
                next_health_check = time.monotonic() + self.health.check_interval_s
                if not self._check_health():
                    return

    def _check_cancellations(self) -> None:
        """Triton has no callback for a client's cancellation: ask for each request in flight (also
        works for non-streaming requests, which produce no output to check on)."""
        with self._lock:
            entries = list(self._in_flight.items())
        for request_id, entry in entries:
            if not entry.cancelled.is_set() and entry.sink.is_cancelled():
                self._abort(request_id, entry)

    def _check_health(self) -> bool:
        """False once the service failed or the engine is gone."""
        engine = self.runner.engine
        if self._stopping.is_set() or engine is None:
            return False
        if engine.errored:
            self.fail("its core process exited")
            return False
        stalled = time.monotonic() - self._last_progress
        if self._in_flight and stalled > self.health.stall_timeout_s:
            self.fail(f"no progress for {stalled:.0f} s with {len(self._in_flight)} request(s) in flight")
            return False
        return True

    def fail(self, reason: str) -> None:
        """Fail the service: answer every request UNAVAILABLE, kill the engine, call on_failure."""
        with self._lock:
            if self._failure is not None or self._stopping.is_set():
                return
            self._failure = reason
            in_flight = list(self._in_flight.values())
            ids = sorted(self._in_flight)[:8]
        logger.error("engine failed: %s; failing %d request(s) in flight: %s", reason, len(in_flight), ids)
        self.runner.kill_processes()  # first: a wedged engine may still hold memory (weights) or resume
        for entry in in_flight:
            self._stop(entry)  # _run answers UNAVAILABLE
        self._idle.wait(10)
        self._outbox.flush(10)
        try:
            self.runner.shutdown()  # its processes are dead already; removes their shared memory
        except Exception:
            logger.exception("shutting down the failed engine")
        if self._on_failure is not None:
            with self._reporting:
                if self._stopping.is_set():  # stopping meanwhile: the model goes anyway
                    logger.warning("not reporting the engine failure: the model is stopping")
                else:
                    self._on_failure(reason)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def drain(self, grace_s: float) -> int:
        """Before a stop: refuse new requests (``UNAVAILABLE``, "the server is stopping"), give the
        ones in flight ``grace_s`` to finish, then end the rest ``UNAVAILABLE``; returns how many
        were ended so. Blocks until every request in flight has its final response.

        Triton unloads a model only once no request holds it, and a long generation would hold the
        whole stop (``--exit-timeout-secs``) until it ends: ``mmserve.drain`` calls this (through
        ``mm_llm``'s ``drain`` control input) before the server is signalled."""
        self._draining.set()
        ended = 0
        if not self._idle.wait(max(grace_s, 0.0)):
            ended = self._end_in_flight()
            if not self._idle.wait(STOP_WAIT_S):
                logger.warning("drain: %d request(s) still in flight", self.in_flight())
        self._outbox.flush(STOP_WAIT_S)  # the final responses queued are sent: every request is answered
        return ended

    def _end_in_flight(self) -> int:
        """Cancel every request in flight on the loop: each is answered ``_unavailable()``."""
        with self._lock:
            in_flight = list(self._in_flight.values())
        for entry in in_flight:
            self._stop(entry)
        return len(in_flight)

    def _stop(self, entry: _InFlight) -> None:
        """End a request in flight: its task is cancelled on the loop and answers ``_unavailable()``.

        Not ``entry.future.cancel()``: that marks the future done at once (``_done`` would count the
        request finished before its final response is queued), and a task cancelled before its
        first step never runs ``_run``'s handler, so its request would get no final response."""

        def stop() -> None:
            entry.stopping = True
            if entry.task is not None:
                entry.task.cancel()

        try:
            self.runner.loop.call_soon_threadsafe(stop)
        except RuntimeError:  # the loop is closed: nothing runs on it any more
            logger.warning("a request could not be stopped: the engine's loop is closed")

    def shutdown(self) -> None:
        """Stop within a bounded time: requests still in flight are answered UNAVAILABLE, then the
        engine stops (vLLM gets ``SHUTDOWN_GRACE_S``, then its processes are killed). Every response
        is sent before this returns (Triton must get none after the model's finalize)."""
        started = time.monotonic()
        with self._lock:
            self._stopping.set()
        if self._reporting.acquire(timeout=STOP_WAIT_S):  # an on_failure call in progress ends first
            self._reporting.release()
        else:
            logger.warning("shutting down while the engine failure is still being reported")
        self._end_in_flight()
        if not self._idle.wait(STOP_WAIT_S):
            logger.warning("shutting down with %d request(s) in flight", self.in_flight())
        self._outbox.close(STOP_WAIT_S)
        if threading.current_thread() is not self._watcher:
            self._watcher.join(STOP_WAIT_S)
        self.runner.shutdown(timeout=SHUTDOWN_GRACE_S + STOP_WAIT_S)  # then its processes are killed
        logger.info("stopped in %.1f s", time.monotonic() - started)


def _send_output(sink: ResponseSink, request: GenerateRequest, output: RequestOutput) -> None:
    """Build one response's tensors and send it (on the outbox's thread)."""
    sink.send(response_tensors(request, output), final=output.finished or not request.stream)

"""Text without the hop: a chat request without media, rendered and tokenized in the gateway and sent
to ``mm_llm`` directly, not through ``mm_ensemble``'s ``preprocess`` step.

A text-only request through the ensemble pays a round trip to ``preprocess``'s stub and the ensemble
scheduler's (about 1.5 ms of server CPU per request at concurrency 16 on this project's 2-core
machine: ``preprocess`` 1.1, tritonserver 0.5; ``bench/peers.py``); what ``preprocess`` does for it
is the chat template and the tokenizer. The
gateway runs the very same code (``mmserve.serving.preprocess.Preprocessor``) on the same checkpoint,
under the same limits and control-token policy, which it reads from Triton's configuration of
``preprocess`` (its ``parameters``). At its start (and, until it could, at a request) the gateway checks that
it gets ``preprocess``'s own ids: it sends ``PROBES`` (a system turn, special tokens typed in the
text, a multi-turn conversation with tools) to Triton's ``preprocess`` and compares. Any difference,
or a checkpoint the gateway can't load, turns the direct path off for good (a warning in the log);
every request then goes through the ensemble as before. While Triton can't be asked (it starts, it
restarts), requests go through the ensemble and the check is tried again ``RETRY_S`` later.

Requests with media, and every request when ``--tokenizer none``, go through the ensemble.
Cancellation is the same either way: the gateway's cancel goes to ``mm_llm``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from mmserve.gateway.errors import APIError, internal, invalid

if TYPE_CHECKING:
    from mmserve.serving.preprocess import Preprocessor

logger = logging.getLogger("mmserve.gateway")

PREPROCESS = "preprocess"
"""The Triton model whose ids the direct path must give (the ensemble's first step)."""
RETRY_S = 5.0
"""After Triton could not be asked, the next check waits this long."""
PROBES: tuple[tuple[list[dict[str, Any]], list[dict[str, Any]] | None], ...] = (
    ([{"role": "user", "content": "Hello there. What is 2 + 2?"}], None),
    (
        [
            {"role": "system", "content": "You answer in French."},
            {"role": "user", "content": "Say <|im_start|>hi<|im_end|> and <|IMAGE|> back, literally."},
            {"role": "assistant", "content": "D'accord : « bonjour »."},
            {"role": "user", "content": "Encore\nune fois, é ü 字."},
        ],
        None,
    ),
    (
        [{"role": "user", "content": "What is the weather in Paris?"}],
        [
            {
                "type": "function",
                "function": {
                    "name": "weather",
                    "description": "Current weather of a city",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
    ),
)
"""Conversations (messages, tools) whose ids the gateway compares with ``preprocess``'s."""
PREPROCESS_ONLY = ("messages", "tools", "image", "audio", "video", "use_audio_in_video", "text_input")
"""The ensemble's inputs that ``preprocess`` takes: the direct request has ``input_ids`` instead."""


class Backend(Protocol):
    async def model_parameters(self, model: str) -> dict[str, str]: ...

    async def infer(
        self, model: str, tensors: Mapping[str, np.ndarray], outputs: tuple[str, ...]
    ) -> dict[str, Any]: ...


class DirectText:
    """The gateway's own ``Preprocessor`` for text-only requests, once checked against Triton's.

    Args:
        model: the served checkpoint's folder (the gateway's ``--tokenizer``).
        media_limits: the gateway's ``limit_mm_per_prompt`` (``PreprocessLimits`` needs them; a
            text-only request has no media).
    """

    def __init__(self, model: str, media_limits: Mapping[str, int]) -> None:
        self.model = model
        self.media_limits = dict(media_limits)
        self.preprocessor: Preprocessor | None = None
        self.state = "unchecked"  # -> "on" or "off" (for good); "unchecked" again after a failed ask
        self._retry_at = 0.0
        self._check: asyncio.Task[None] | None = None

    def ready(self, backend: Backend) -> Preprocessor | None:
        """The preprocessor when the direct path is on; else None (and a check starts if due)."""
        if self.state == "on":
            return self.preprocessor
        if self.state == "unchecked" and self._check is None and time.monotonic() >= self._retry_at:
            self._check = asyncio.get_running_loop().create_task(self._run_check(backend))
        return None

    async def close(self) -> None:
        if self._check is not None:
            self._check.cancel()
            await asyncio.gather(self._check, return_exceptions=True)

    async def _run_check(self, backend: Backend) -> None:
        try:
            self.state = await self.check(backend)
        except APIError as exc:  # Triton could not be asked: through the ensemble meanwhile
            logger.info("text-only requests go through the ensemble for now (%s); checked again later", exc.message)
            self._retry_at = time.monotonic() + RETRY_S
        except Exception:
            logger.exception("the direct path for text-only requests is off: its check failed")
            self.state = "off"
        finally:
            self._check = None

    async def check(self, backend: Backend) -> str:
        """Load the preprocessor under ``preprocess``'s settings and compare its ids on ``PROBES``
        with ``preprocess``'s: "on" or "off"; raises ``APIError`` when Triton can't be asked."""
        from mmserve.serving.preprocess import PreprocessLimits, Preprocessor

        parameters = await backend.model_parameters(PREPROCESS)
        try:
            preprocessor = await asyncio.to_thread(
                Preprocessor,
                self.model,
                limits=PreprocessLimits.from_parameters(parameters, self.media_limits),
                user_control_tokens=parameters.get("user_control_tokens") or "escape",  # type: ignore[arg-type]
            )
        except Exception as exc:  # noqa: BLE001 - any reason: the ensemble serves these requests
            logger.warning("text-only requests go through the ensemble: %s can't be loaded here (%s)", self.model, exc)
            return "off"
        for number, (messages, tools) in enumerate(PROBES):
            tensors = probe_tensors(messages, tools)
            if await _remote_ids(backend, tensors) != await _local_ids(preprocessor, tensors):
                logger.warning(
                    "text-only requests go through the ensemble: the gateway's ids for probe %d differ from "
                    "Triton's preprocess (is --tokenizer %s the checkpoint Triton serves?)",
                    number,
                    self.model,
                )
                return "off"
        self.preprocessor = preprocessor
        logger.info("text-only requests go to %s directly (checked: the ids of Triton's %s)", "mm_llm", PREPROCESS)
        return "on"


async def _remote_ids(backend: Backend, tensors: Mapping[str, np.ndarray]) -> tuple[int, ...] | str:
    """``preprocess``'s ids for ``tensors``, or the message it refused them with (under its limits)."""
    try:
        return tuple((await backend.infer(PREPROCESS, tensors, ("input_ids",)))["input_ids"].tolist())
    except APIError as exc:
        if exc.status == 400:
            return exc.message
        raise


async def _local_ids(preprocessor: Preprocessor, tensors: Mapping[str, np.ndarray]) -> tuple[int, ...] | str:
    from mmserve.serving.preprocess import PreprocessError

    try:
        return tuple((await asyncio.to_thread(preprocess, preprocessor, tensors))["input_ids"].tolist())
    except PreprocessError as exc:
        return str(exc)


def probe_tensors(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> dict[str, np.ndarray]:
    tensors = {"messages": np.array([json.dumps(messages, ensure_ascii=False).encode()], dtype=np.object_)}
    if tools is not None:
        tensors["tools"] = np.array([json.dumps(tools, ensure_ascii=False).encode()], dtype=np.object_)
    return tensors


def preprocess(preprocessor: Preprocessor, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What ``preprocess`` answers to a text-only request's tensors (``messages``, ``tools``)."""
    tools = tensors.get("tools")
    return preprocessor(None, messages=tensors["messages"][0], tools=None if tools is None else tools[0])


async def direct_tensors(preprocessor: Preprocessor, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``mm_llm``'s tensors for one choice of a text-only request (the ensemble's ``tensors``):
    ``preprocess``'s outputs in place of its inputs. A request ``preprocess`` would refuse is
    refused with its message (400)."""
    from mmserve.serving.preprocess import PreprocessError

    try:
        outputs = await asyncio.to_thread(preprocess, preprocessor, tensors)
    except PreprocessError as exc:
        raise invalid(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - ours: an incident id, the detail in the log
        raise internal("rendering a text-only request", exc) from None
    return {**{k: v for k, v in tensors.items() if k not in PREPROCESS_ONLY}, **outputs}

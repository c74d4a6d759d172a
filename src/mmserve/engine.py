"""One vLLM ``AsyncLLM`` (V1) on its own asyncio loop thread.

Used by the Triton ``mm_llm`` model (whose ``execute`` runs on Triton's threads), by the tests and
by the benchmarks: callers on any thread submit coroutines with ``submit``; the engine's output
handler keeps running on the loop thread between calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.outputs import RequestOutput
from vllm.renderers.inputs.preprocess import parse_model_prompt
from vllm.v1.engine.async_llm import AsyncLLM

from mmserve.inputs import engine_kwargs

T = TypeVar("T")


class EngineRunner:
    """An ``AsyncLLM`` serving ``model`` through its family's pass-through architecture.

    Args:
        model: local checkpoint directory.
        stat_loggers: vLLM stat logger factories (e.g. Triton metrics); with them, vLLM's own
            periodic stats logging stays off unless ``disable_log_stats=False`` is passed.
        **overrides: vLLM engine arguments (``max_model_len``, ``dtype``, ...).
    """

    def __init__(self, model: str, *, stat_loggers: list[Any] | None = None, **overrides: Any) -> None:
        self.engine_args = engine_kwargs(model, **overrides)
        self._stat_loggers = stat_loggers
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mmserve-engine", daemon=True)
        self._thread.start()
        try:
            self.engine: AsyncLLM = self.submit(self._create()).result()
        except BaseException:
            self._stop_loop()
            raise

    async def _create(self) -> AsyncLLM:
        args = AsyncEngineArgs(**self.engine_args)
        if self._stat_loggers:
            return AsyncLLM.from_engine_args(args, stat_loggers=self._stat_loggers)
        return AsyncLLM.from_engine_args(args)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the engine's loop; returns a thread-safe future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def render(self, prompt: dict[str, Any]) -> Any:
        """Prompt dict -> engine input: tokenization and multimodal processing (the pass-through
        processor's validation included), off the loop in vLLM's renderer."""
        parsed = parse_model_prompt(self.engine.model_config, prompt)
        (engine_input,) = await self.engine.renderer.render_cmpl_async([parsed])
        return engine_input

    async def stream(
        self, prompt: dict[str, Any], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """The engine's output stream for one request (call on the loop)."""
        engine_input = await self.render(prompt)
        async for output in self.engine.generate(engine_input, params, request_id or self.new_request_id()):
            yield output

    async def generate(
        self, prompt: dict[str, Any], params: SamplingParams, request_id: str | None = None
    ) -> RequestOutput:
        """Run one request to completion (call on the loop); returns the final output."""
        final: RequestOutput | None = None
        async for output in self.stream(prompt, params, request_id):
            final = output
        assert final is not None and final.finished
        return final

    def generate_sync(
        self, prompt: dict[str, Any], params: SamplingParams, timeout: float | None = None
    ) -> RequestOutput:
        """Blocking ``generate`` from any thread other than the loop's."""
        return self.submit(self.generate(prompt, params)).result(timeout)

    def shutdown(self) -> None:
        """Stop the engine (its core process included) and the loop thread."""
        if getattr(self, "engine", None) is not None and self._loop.is_running():
            self.submit(self._close()).result(timeout=120)
        self._stop_loop()

    async def _close(self) -> None:
        # On the loop, so the engine's output handler is cancelled before its core goes away.
        engine, self.engine = self.engine, None  # type: ignore[assignment]
        engine.shutdown()
        current = asyncio.current_task()
        pending = [task for task in asyncio.all_tasks() if task is not current]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()

    def __enter__(self) -> EngineRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

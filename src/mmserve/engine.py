"""One vLLM ``AsyncLLM`` (V1) on its own asyncio loop thread.

Used by the Triton ``mm_llm`` model (whose ``execute`` runs on Triton's threads), by the tests and
by the benchmarks: callers on any thread submit coroutines with ``submit``; the engine's output
handler keeps running on the loop thread between calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput

from mmserve import vllm_seam
from mmserve.inputs import engine_kwargs
from mmserve.vllm_seam import AsyncLLM

T = TypeVar("T")
logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 1.0
"""How long the engine's processes get to exit on shutdown before they are killed."""


class EngineRunner:
    """An ``AsyncLLM`` serving ``model`` through its family's pass-through architecture.

    Args:
        model: local checkpoint directory.
        stat_loggers: vLLM stat logger factories (e.g. Triton metrics); with them, vLLM's own
            periodic stats logging stays off unless ``disable_log_stats=False`` is passed, and its
            Prometheus logger is left out (``vllm_seam.silent_prometheus_logger``: nothing serves it).
        **overrides: vLLM engine arguments (``max_model_len``, ``dtype``, ...).
    """

    def __init__(self, model: str, *, stat_loggers: list[Any] | None = None, **overrides: Any) -> None:
        self.engine_args = engine_kwargs(model, **overrides)
        self._stat_loggers = stat_loggers
        self._ids = itertools.count()
        self._processes: list[Any] = []  # psutil.Process of the core(s) and workers
        self._shm_files: set[Path] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mmserve-engine", daemon=True)
        self._thread.start()
        try:
            self.engine: AsyncLLM = self.submit(self._create()).result()
        except BaseException:
            self._stop_loop()
            raise
        self._record_processes()

    async def _create(self) -> AsyncLLM:
        args = AsyncEngineArgs(**self.engine_args)
        if self._stat_loggers:
            loggers = [*self._stat_loggers, vllm_seam.silent_prometheus_logger()]
            return AsyncLLM.from_engine_args(args, stat_loggers=loggers)
        return AsyncLLM.from_engine_args(args)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def vocab_size(self) -> int:
        """Rows of the model's embedding table: every prompt token id must be below it."""
        return self.engine.model_config.get_vocab_size()

    @property
    def max_model_len(self) -> int:
        """The context length: prompt and output tokens together."""
        return self.engine.model_config.max_model_len

    def core_pids(self) -> list[int]:
        """Process ids of the engine's core process(es) (empty once they are gone)."""
        return vllm_seam.engine_core_pids(self.engine)

    def _record_processes(self) -> None:
        """Remember the engine's processes (core and workers) and the /dev/shm files they map, once
        it runs: a core that dies leaves orphaned workers (which hold the weights) and shared memory
        behind, which ``kill`` and ``shutdown`` then remove."""
        import psutil

        processes: list[psutil.Process] = []
        for pid in self.core_pids():
            with contextlib.suppress(psutil.Error):
                core = psutil.Process(pid)
                processes += [core, *core.children(recursive=True)]
        self._processes = processes
        self._shm_files = set()
        for process in processes:
            with contextlib.suppress(OSError), open(f"/proc/{process.pid}/maps") as maps:
                self._shm_files.update(Path(line.split()[-1]) for line in maps if " /dev/shm/" in line)

    def kill_processes(self, timeout: float = 10.0) -> None:
        """SIGKILL the engine's processes (a wedged or stopped process ignores polite requests) and
        wait until they are gone."""
        import psutil

        killed = []
        for process in self._processes:
            with contextlib.suppress(psutil.Error):  # gone already (or its pid reused: is_running checks)
                if process.is_running():
                    process.kill()
                    killed.append(process)

        def alive(process: psutil.Process) -> bool:
            try:
                return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                return False

        deadline = time.monotonic() + timeout
        while any(alive(p) for p in killed) and time.monotonic() < deadline:
            time.sleep(0.02)
        if any(alive(p) for p in killed):
            logger.error("engine processes still alive after SIGKILL: %s", [p.pid for p in killed if alive(p)])

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the engine's loop; returns a thread-safe future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def render(self, prompt: dict[str, Any]) -> Any:
        """Prompt dict -> engine input: tokenization and multimodal processing (the pass-through
        processor's validation included), off the loop in vLLM's renderer."""
        return await vllm_seam.render_prompt(self.engine, prompt)

    async def stream(
        self,
        prompt: dict[str, Any],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The engine's output stream for one request (call on the loop); ``lora_request``: the
        adapter that answers (None: the base model)."""
        engine_input = await self.render(prompt)
        request_id = request_id or self.new_request_id()
        async for output in self.engine.generate(engine_input, params, request_id, lora_request=lora_request):
            yield output

    async def generate(
        self,
        prompt: dict[str, Any],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutput:
        """Run one request to completion (call on the loop); returns the final output."""
        final: RequestOutput | None = None
        async for output in self.stream(prompt, params, request_id, lora_request=lora_request):
            final = output
        assert final is not None and final.finished
        return final

    def generate_sync(
        self,
        prompt: dict[str, Any],
        params: SamplingParams,
        timeout: float | None = None,
        *,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutput:
        """Blocking ``generate`` from any thread other than the loop's."""
        return self.submit(self.generate(prompt, params, lora_request=lora_request)).result(timeout)

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop the engine (its core process included) and the loop thread; idempotent. Core
        processes still alive after ``timeout`` seconds are killed."""
        try:
            if getattr(self, "engine", None) is not None and self._loop.is_running():
                try:
                    self.submit(self._close()).result(timeout=timeout)
                except concurrent.futures.TimeoutError:
                    logger.error("the engine did not stop within %.0f s; killing its processes", timeout)
        finally:
            self.kill_processes()  # what vLLM's shutdown left (none, normally)
            self._stop_loop()
            self._remove_shm()

    def kill(self) -> None:
        """SIGKILL the engine's processes and remove their shared memory, now (no graceful stop):
        for when this process is about to go (its tritonserver died)."""
        self.kill_processes()
        self._remove_shm()

    def _remove_shm(self) -> None:
        # Processes that were killed (by us, by vLLM after SHUTDOWN_GRACE_S, or by a fault) leave
        # their shared memory behind: vLLM's message queues, 160 MB each.
        for path in self._shm_files:
            with contextlib.suppress(OSError):
                path.unlink()

    async def _close(self) -> None:
        # On the loop, so the engine's output handler is cancelled before its core goes away.
        engine, self.engine = self.engine, None
        # vLLM waits this long for its processes before it kills them (its default, 5 s, is most of
        # a 15-s stop budget); what they leave in /dev/shm is removed by shutdown().
        engine.shutdown(timeout=SHUTDOWN_GRACE_S)
        current = asyncio.current_task()
        pending = [task for task in asyncio.all_tasks() if task is not current]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()

    def __enter__(self) -> EngineRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

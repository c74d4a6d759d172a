"""What the ``mm_pipeline`` Triton model runs: ``preprocess`` then ``mm_llm`` through BLS, with the
client's cancellation carried to the engine.

``mm_ensemble`` chains the same two models, but Triton's ensemble scheduler checks a request's
cancellation only between steps: once ``mm_llm`` runs, a client that cancels is not seen and the
engine generates to the end. Here the pipeline model itself holds the client's request, so it sees
the cancellation; Triton 2.51's BLS can't cancel a stream it opened (``InferenceResponseIterator``
has no ``cancel`` before 2.52), so the pipeline sends ``mm_llm`` a control request
(``cancel`` = the BLS request's id) and ``mm_llm`` aborts the engine request.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import numpy as np

from mmserve import wire
from mmserve.errors import InputError, InternalError, ServiceError, UnavailableError
from mmserve.serving.contract import FEATURE_TENSORS, INPUT_IDS
from mmserve.serving.embedded import IDLE_COLLECT_S, collect_response_senders
from mmserve.serving.triton import error_response, triton_error
from mmserve.wire import TAG, TRITON_UNAVAILABLE

logger = logging.getLogger(__name__)

PREPROCESS_INPUTS = wire.names(wire.PREPROCESS_INPUTS)
LLM_INPUTS = wire.names((wire.TEXT_INPUT, *wire.GENERATION_INPUTS))  # passed on to mm_llm as they came
OUTPUTS = wire.names(wire.OUTPUTS)
CANCEL_POLL_S = 0.1


class _Client:
    """The response sender of one client request, safe to poll from another thread.

    Triton 2.51 crashes (SIGSEGV in ``TRITONBACKEND_ResponseFactoryIsCancelled``) when
    ``is_cancelled()`` is called once the final response is sent, so the final send and every poll
    hold one lock, and a finished request is never polled.
    """

    def __init__(self, sender: Any, final_flag: int) -> None:
        self._sender = sender
        self._final = final_flag
        self._lock = threading.Lock()
        self._finished = False

    def send(self, response: Any) -> None:
        self._sender.send(response)

    def finish(self, response: Any = None) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
            if response is None:
                self._sender.send(flags=self._final)
            else:
                self._sender.send(response, flags=self._final)

    def is_cancelled(self) -> bool:
        with self._lock:
            return not self._finished and self._sender.is_cancelled()


class Pipeline:
    """Serves ``mm_pipeline`` requests, each on a thread of its own (responses stream from it).

    Args:
        pb_utils: ``triton_python_backend_utils``.
        preprocess, llm: the names of the two models it calls.
    """

    def __init__(self, pb_utils: Any, *, preprocess: str = "preprocess", llm: str = "mm_llm") -> None:
        self.pb = pb_utils
        self.preprocess, self.llm = preprocess, llm
        self._clients: dict[str, _Client] = {}  # BLS request id -> the client's request
        self._running = 0  # requests being served
        self._ended_at: float | None = None  # when the last one ended, if none ran since the last collect
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch_cancellations, name="mm_pipeline-cancel", daemon=True)
        self._watcher.start()

    def submit(self, request: Any) -> None:
        client = _Client(request.get_response_sender(), self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        with self._lock:
            self._running += 1
        threading.Thread(target=self._serve, args=(request, client), name="mm_pipeline-request", daemon=True).start()

    def _serve(self, request: Any, client: _Client) -> None:
        request_id = uuid.uuid4().hex
        try:
            self._serve_one(request, client, request_id)
        finally:
            with self._lock:
                self._clients.pop(request_id, None)
                self._running -= 1
                if not self._running:
                    self._ended_at = time.monotonic()

    def _serve_one(self, request: Any, client: _Client, request_id: str) -> None:
        pb = self.pb
        try:
            given = {name: pb.get_input_tensor_by_name(request, name) for name in (*PREPROCESS_INPUTS, *LLM_INPUTS)}
            if given["text_input"] is None and given["messages"] is None:  # not every frontend checks inputs
                raise InputError("text_input: required (BYTES [1], the prompt), or messages (BYTES [1], a conversation)")
            processed = pb.InferenceRequest(
                model_name=self.preprocess,
                inputs=[given[n] for n in PREPROCESS_INPUTS if given[n] is not None],
                requested_output_names=[INPUT_IDS.name, *(spec.name for spec in FEATURE_TENSORS)],
            ).exec()
            if processed.has_error():
                client.finish(pb.InferenceResponse(error=self._error(processed.error(), self.preprocess)))
                return
            inputs = processed.output_tensors() + [given[n] for n in LLM_INPUTS if given[n] is not None]
            with self._lock:
                self._clients[request_id] = client
            responses = pb.InferenceRequest(
                model_name=self.llm, inputs=inputs, requested_output_names=list(OUTPUTS), request_id=request_id,
            ).exec(decoupled=True)
            for response in responses:
                if response.has_error():
                    client.finish(pb.InferenceResponse(error=self._error(response.error(), self.llm)))
                    return
                tensors = response.output_tensors()
                if tensors:
                    client.send(pb.InferenceResponse(output_tensors=tensors))
            client.finish()
        except Exception as exc:  # noqa: BLE001 - answered, the detail logged (error_response)
            client.finish(error_response(pb, exc, context=f"mm_pipeline {request_id}"))

    def _error(self, error: Any, model: str) -> Any:
        """An error of a called model, as the client gets it: the models' own errors carry their
        ``[CODE]`` tag already; Triton's own (a model not loaded, an input that fails the model's
        config) are classified here by their code."""
        message = error.message()
        if TAG.search(message):
            return error
        code = error.code()
        if code == self.pb.TritonError.INVALID_ARG:
            failure: ServiceError = InputError(message)
        elif code in (self.pb.TritonError.UNAVAILABLE, self.pb.TritonError.NOT_FOUND) or any(
                marker in message for marker in TRITON_UNAVAILABLE):
            failure = UnavailableError(f"{model} is not available (restarting?); retry shortly")
        else:
            logger.error("%s answered: %s", model, message)
            failure = InternalError(f"{model} failed; the server log has the detail")
        return triton_error(self.pb, failure)

    def _watch_cancellations(self) -> None:
        """Every ``CANCEL_POLL_S``: carry new cancellations to the engine; once idle, collect cycles.

        Why collect: see ``collect_response_senders`` (a stop that hung in CI had the model held
        by something: no ``finalize``, no request in flight; docs/RELIABILITY.md).
        """
        cancelled: set[str] = set()
        while not self._stopping.wait(CANCEL_POLL_S):
            with self._lock:
                idle = self._ended_at is not None and time.monotonic() - self._ended_at >= IDLE_COLLECT_S
                if idle:
                    self._ended_at = None
            if idle:
                collect_response_senders("mm_pipeline")
            with self._lock:
                clients = list(self._clients.items())
            cancelled &= {request_id for request_id, _ in clients}
            for request_id, client in clients:
                if request_id not in cancelled and client.is_cancelled():
                    cancelled.add(request_id)
                    self._cancel(request_id)

    def _cancel(self, request_id: str) -> None:
        pb = self.pb
        started = time.monotonic()
        control = pb.InferenceRequest(
            model_name=self.llm,
            inputs=[pb.Tensor(INPUT_IDS.name, np.zeros(0, dtype=np.int64)),
                    pb.Tensor("cancel", np.array([request_id.encode()], dtype=np.object_))],
            requested_output_names=[],
        )
        try:
            for _ in control.exec(decoupled=True):
                pass
        except Exception:  # the request then runs to its end; nothing else breaks
            logger.exception("cancelling %s on %s", request_id, self.llm)
        logger.info("cancelled %s on %s in %.3f s", request_id, self.llm, time.monotonic() - started)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the cancellation watcher and wait for it: a call into Triton still in flight when the
        stub tears down crashes tritonserver 2.51 (``boost::interprocess::lock_exception``)."""
        self._stopping.set()
        self._watcher.join(timeout)
        busy = [t.name for t in threading.enumerate() if t.name.startswith("mm_pipeline-") and t.is_alive()]
        if busy:  # nothing should be in flight any more: say what is, for the log
            logger.warning("mm_pipeline stops with threads still running: %s (requests registered: %d)",
                           busy, len(self._clients))

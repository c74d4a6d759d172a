"""mm_llm's request handling (mmserve.serving.llm) on a real engine, the Triton response sender
replaced by a recorder.

Cancellation is injected here: Triton 2.51 delivers a client's cancellation to the model only some
of the time (a race in its gRPC stream handler), so the end-to-end test cannot make it happen on
demand; this test covers what mm_llm does once Triton has flagged a request as cancelled.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
import pytest

from utils import ENGINE_ARGS, make_request

if TYPE_CHECKING:
    from mmserve.errors import ServiceError

pytestmark = pytest.mark.engine


class RecordingSink:
    """A ResponseSink that records; cancelled after ``cancel_after`` responses or seconds."""

    def __init__(
        self,
        *,
        cancel_after_responses: int | None = None,
        cancel_after_s: float | None = None,
        send_delay_s: float = 0.0,
    ):
        self.send_delay_s = send_delay_s  # a slow Triton: responses queue up behind each send
        self.responses: list[dict[str, np.ndarray]] = []
        self.sent_at: list[float] = []  # time.monotonic() of each response
        self.errors: list[ServiceError] = []
        self.closed_empty = False
        self.closed = threading.Event()
        self._cancel_after_responses = cancel_after_responses
        self._cancel_at = None if cancel_after_s is None else time.monotonic() + cancel_after_s
        self.threads: set[str] = set()  # the threads that called this sink (Triton calls block)

    def _called(self):
        self.threads.add(threading.current_thread().name)

    def send(self, outputs, *, final):
        self._called()
        time.sleep(self.send_delay_s)
        assert not self.closed.is_set(), "response after the final one"
        self.responses.append(dict(outputs))
        self.sent_at.append(time.monotonic())
        if final:
            self.closed.set()

    def send_error(self, error):
        self._called()
        self.errors.append(error)
        self.closed.set()

    def send_final(self):
        self._called()
        self.closed_empty = True
        self.closed.set()

    def is_cancelled(self):
        self._called()
        if self._cancel_after_responses is not None and len(self.responses) >= self._cancel_after_responses:
            return True
        return self._cancel_at is not None and time.monotonic() >= self._cancel_at

    def output_ids(self) -> list[int]:
        return [int(i) for r in self.responses for i in r["output_ids"]]


class GeneratedTokens:
    """A vLLM stat logger counting the tokens the engine generated (all requests)."""

    total = 0

    def __init__(self, vllm_config, engine_index: int = 0):
        pass

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if iteration_stats is not None:
            GeneratedTokens.total += iteration_stats.num_generation_tokens

    def log_engine_initialized(self):
        pass


@pytest.fixture(scope="module")
def service(tiny_models):
    from mmserve.engine import EngineRunner
    from mmserve.serving.llm import LLMService

    with EngineRunner(str(tiny_models["qwen2_5_omni"]), stat_loggers=[GeneratedTokens], **ENGINE_ARGS) as runner:
        yield LLMService(runner)


def _request(
    service, request, *, stream: bool, max_tokens: int, ignore_eos: bool = False, sampling: dict | None = None, **flags
):
    from mmserve.serving.llm import parse_request

    tensors = {name: np.asarray(value) for name, value in request.hf_inputs.items()}
    tensors["input_ids"] = tensors["input_ids"][0]
    tensors["stream"] = np.array([stream])
    params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": ignore_eos, **(sampling or {})}
    tensors["sampling_parameters"] = np.array([json.dumps(params).encode()], dtype=object)
    for name, value in flags.items():
        tensors[name] = np.array([value])
    return parse_request(service.family, tensors.get)


def _run(service, parsed, sink, request_id):
    service.submit(parsed, sink, request_id)
    assert sink.closed.wait(120), "the request never closed"


def test_streamed_deltas_are_the_reference_tokens(service, omni_workload):
    request, reference = next((r, t) for r, t in omni_workload if r.name == "image_audio#2")
    sink = RecordingSink()
    _run(
        service,
        _request(
            service,
            request,
            stream=True,
            max_tokens=len(reference),
            sampling={"stream_flush_ms": 0},
            return_finish_reason=True,
            return_num_output_tokens=True,
        ),
        sink,
        "stream-1",
    )
    assert sink.output_ids() == reference
    assert len(sink.responses) > 1 and not sink.errors
    assert sink.responses[-1]["finish_reason"][0] in (b"length", b"stop")
    assert sum(int(r["num_output_tokens"][0]) for r in sink.responses) == len(reference)
    # The engine's loop never blocks on Triton: responses and cancellation checks run elsewhere.
    assert sink.threads and service.runner._thread.name not in sink.threads, sink.threads


def test_wire_images_are_cached_by_their_own_identities(service, omni_reference):
    """Two requests with the same prompt ids and different images, sent as ``preprocess`` sends them
    (uint8 patches, their identities given to vLLM as ``multi_modal_uuids``), one after the other:
    each gets its own HF reference, so the first's cached prefix and encoder output never serve the
    second; the first again gets its reference from the caches."""
    from mmserve.serving.llm import parse_request

    def wire(request):
        raw = omni_reference.processor(
            text=request.text, images=request.images, return_tensors="np", do_rescale=False, do_normalize=False
        )
        assert raw["pixel_values"].dtype == np.uint8
        params = {"max_tokens": 12, "temperature": 0}
        tensors = {
            "input_ids": raw["input_ids"][0],
            "pixel_values_uint8": raw["pixel_values"],
            "image_grid_thw": raw["image_grid_thw"],
            "sampling_parameters": np.array([json.dumps(params).encode()], dtype=object),
        }
        parsed = parse_request(service.family, tensors.get, wire_decoders=service.wire_decoders)
        assert len(parsed.prompt["multi_modal_uuids"]["image"]) == 1
        return parsed

    a = make_request(omni_reference, "a", ["image"], seed=7)
    b = make_request(omni_reference, "b", ["image"], seed=8)
    assert a.hf_inputs["input_ids"].tolist() == b.hf_inputs["input_ids"].tolist()
    references = [omni_reference.generate(r.text, r.images, r.audios, max_new_tokens=12) for r in (a, b)]
    assert references[0] != references[1], "test images must lead to different outputs"
    for index, request in enumerate((a, b, a)):
        sink = RecordingSink()
        _run(service, wire(request), sink, f"wire-{index}")
        assert not sink.errors and sink.output_ids() == references[index % 2], request.name


def test_deltas_queued_behind_a_slow_sender_go_out_merged(service, omni_workload):
    """When sending falls behind the engine, a stream's waiting deltas leave as one response: the
    same tokens, text and counts, in fewer responses."""
    request, reference = next((r, t) for r, t in omni_workload if r.name == "image_audio#2")
    fast, slow = RecordingSink(), RecordingSink(send_delay_s=0.05)
    for sink, request_id in ((fast, "merge-fast"), (slow, "merge-slow")):
        _run(
            service,
            _request(
                service,
                request,
                stream=True,
                max_tokens=len(reference),
                sampling={"stream_flush_ms": 0},
                return_num_output_tokens=True,
                return_finish_reason=True,
            ),
            sink,
            request_id,
        )
    assert fast.output_ids() == slow.output_ids() == reference
    assert len(slow.responses) < len(fast.responses)
    for sink in (fast, slow):
        assert sum(int(r["num_output_tokens"][0]) for r in sink.responses) == len(reference)
        assert sink.responses[-1]["finish_reason"][0] in (b"length", b"stop")
    text = [b"".join(r["text_output"][0] for r in sink.responses) for sink in (fast, slow)]
    assert text[0] == text[1] and text[0]


@pytest.mark.parametrize("flush_ms", [30, 120])
def test_a_stream_gets_at_most_one_response_per_flush_interval(service, omni_workload, flush_ms, monkeypatch):
    """stream_flush_ms: the first response at once, then at least flush_ms between two responses
    (the last one excepted: it goes at once); the same tokens, text and counts as one response per
    engine output. The engine's outputs reach the request's task merged: once per response, not
    once per engine step (``vllm_seam.install_output_hold``)."""
    request, reference = next((r, t) for r, t in omni_workload if r.name == "image_audio#2")
    tokens = 4 * len(reference)
    every, held = RecordingSink(), RecordingSink()
    taken: collections.Counter[str] = collections.Counter()
    stream = service.runner.stream

    async def counted(prompt, params, request_id=None, **kwargs):
        async for output in stream(prompt, params, request_id, **kwargs):
            taken[request_id] += 1
            yield output

    monkeypatch.setattr(service.runner, "stream", counted)
    for sink, flush, request_id in ((every, 0, "flush-0"), (held, flush_ms, f"flush-{flush_ms}")):
        _run(
            service,
            _request(
                service,
                request,
                stream=True,
                max_tokens=tokens,
                ignore_eos=True,
                sampling={"stream_flush_ms": flush},
                return_num_output_tokens=True,
            ),
            sink,
            request_id,
        )
    assert every.output_ids() == held.output_ids() and every.output_ids()[: len(reference)] == reference
    # Not held: a response per engine output, one token each unless vLLM's output collector merged
    # outputs the loop had not taken yet (it does on a busy machine).
    counts = [int(r["num_output_tokens"][0]) for r in every.responses]
    assert sum(counts) == tokens and min(counts) >= 1 and len(every.responses) >= tokens // 2, counts
    text = [b"".join(r["text_output"][0] for r in sink.responses) for sink in (every, held)]
    assert text[0] == text[1]
    assert sum(int(r["num_output_tokens"][0]) for r in held.responses) == tokens
    gaps = np.diff(held.sent_at[:-1])  # between responses before the last
    assert len(held.responses) >= 2 and (gaps >= flush_ms / 1000 - 0.002).all(), gaps
    span = held.sent_at[-1] - held.sent_at[0]
    assert len(held.responses) <= span / (flush_ms / 1000) + 2
    assert taken["flush-0"] == len(every.responses)
    assert taken[f"flush-{flush_ms}"] <= len(held.responses) + 1, (taken, len(held.responses))


@pytest.mark.parametrize("stream", [True, False])
def test_cancelled_request_is_aborted_on_the_engine(service, omni_workload, stream):
    request, _ = next((r, t) for r, t in omni_workload if r.name == "text_only#0")
    sink = RecordingSink(cancel_after_responses=3) if stream else RecordingSink(cancel_after_s=0.5)
    before = GeneratedTokens.total
    max_tokens = ENGINE_ARGS["max_model_len"] - 100  # runs to this length unless aborted
    _run(
        service,
        _request(service, request, stream=stream, max_tokens=max_tokens, ignore_eos=True),
        sink,
        f"cancel-{stream}",
    )
    assert [error.triton_code for error in sink.errors] == ["CANCELLED"] and not sink.closed_empty
    deadline = time.monotonic() + 120
    while service.runner.engine.get_num_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert service.runner.engine.get_num_unfinished_requests() == 0
    generated = GeneratedTokens.total - before
    assert generated < max_tokens, f"the request ran to its end ({generated} tokens): it was not aborted"


def test_bad_request_gets_a_client_error(service, omni_workload):
    request, reference = next((r, t) for r, t in omni_workload if r.name == "image_only#1")
    parsed = _request(service, request, stream=False, max_tokens=4)
    grid = parsed.prompt["multi_modal_data"]["image"]["image_grid_thw"]
    parsed.prompt["multi_modal_data"]["image"]["image_grid_thw"] = grid * 2
    sink = RecordingSink()
    _run(service, parsed, sink, "bad-1")
    [error] = sink.errors
    assert error.triton_code == "INVALID_ARG" and "image, pixel_values: expected" in str(error)
    good = RecordingSink()
    _run(service, _request(service, request, stream=False, max_tokens=len(reference)), good, "good-1")
    assert good.output_ids() == reference


def test_a_failed_engine_fails_every_request_unavailable_and_is_killed(service, omni_workload):
    """Last in this module: it kills the module's engine. A failure (what the watcher calls on a
    dead or wedged engine) answers the request in flight and every later one UNAVAILABLE, kills the
    engine's processes, removes their shared memory, and asks for a reload once."""
    import psutil

    from mmserve.serving.llm import LLMService

    request, _ = next((r, t) for r, t in omni_workload if r.name == "text_only#0")
    failures: list[str] = []
    failing = LLMService(service.runner, on_failure=failures.append)
    processes = [psutil.Process(pid) for pid in service.runner.core_pids()]
    processes += [child for p in processes for child in p.children(recursive=True)]
    shm = set(service.runner._shm_files)
    assert processes and shm
    in_flight = RecordingSink()
    failing.submit(_request(service, request, stream=True, max_tokens=1500, ignore_eos=True), in_flight, "doomed")
    assert wait_for_responses(in_flight, 3)
    failing.fail("injected for the test")
    assert in_flight.closed.wait(30)
    assert [e.triton_code for e in in_flight.errors] == ["UNAVAILABLE"]
    assert "injected for the test" in str(in_flight.errors[0])
    late = RecordingSink()
    failing.submit(_request(service, request, stream=False, max_tokens=4), late, "late")
    assert [e.triton_code for e in late.errors] == ["UNAVAILABLE"]
    assert failures == ["injected for the test"]
    assert not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not [path for path in shm if path.exists()]


def wait_for_responses(sink: RecordingSink, count: int, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while len(sink.responses) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(sink.responses) >= count

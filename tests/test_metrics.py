"""mm_llm's Triton metrics (mmserve.serving.metrics) against a recording stand-in for pb_utils'
metric API: what reaches tritonserver, in how many calls."""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Callable

from mmserve.serving.metrics import StepStats, TritonMetrics


class _Metric:
    def __init__(self, family: _Family, gate: threading.Event | None) -> None:
        self.family, self.gate = family, gate

    def _call(self, kind: str, value: float) -> None:
        if self.gate is not None:
            self.gate.wait(10)
        self.family.calls.append((kind, value))

    def set(self, value: float) -> None:
        self._call("set", value)

    def increment(self, value: float) -> None:
        self._call("increment", value)

    def observe(self, value: float) -> None:
        self._call("observe", value)


class _Family:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created: dict[str, _Family] = {}
    gate: threading.Event | None = None  # every metric call waits for it

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.kind = name, kind
        self.calls: list[tuple[str, float]] = []
        _Family.created[name] = self

    def Metric(self, labels: dict[str, str], **kwargs: object) -> _Metric:  # noqa: N802 - pb_utils' name
        return _Metric(self, _Family.gate)


def _pb_utils(gate: threading.Event | None = None) -> types.SimpleNamespace:
    _Family.created, _Family.gate = {}, gate
    return types.SimpleNamespace(MetricFamily=_Family)


def _calls(name: str) -> list[tuple[str, float]]:
    return _Family.created[name].calls


STEP = StepStats(
    running=3,
    waiting=1,
    prompt_tokens=10,
    generation_tokens=3,
    ttfts=(0.02,),
    inter_token_latencies=(0.004, 0.005),
    e2e_latencies=(0.3,),
    request_tpots=(0.0045,),
)


def test_a_step_updates_each_metric_once_and_the_per_token_histogram_is_opt_in():
    metrics = TritonMetrics(_pb_utils(), {"model": "mm_llm", "version": "1"})
    assert "vllm:time_per_output_token_seconds" not in _Family.created
    metrics.post(STEP)
    metrics.close()
    assert _calls("vllm:num_requests_running") == [("set", 3)]
    assert _calls("vllm:num_requests_waiting") == [("set", 1)]
    assert _calls("vllm:prompt_tokens_total") == [("increment", 10)]
    assert _calls("vllm:generation_tokens_total") == [("increment", 3)]
    assert _calls("vllm:request_success_total") == [("increment", 1)]
    metrics = TritonMetrics(_pb_utils(), {"model": "mm_llm", "version": "1"}, inter_token_latency=True)
    metrics.post(STEP)
    metrics.close()
    assert _calls("vllm:time_per_output_token_seconds") == [("observe", 0.004), ("observe", 0.005)]


def test_a_gauge_is_set_when_it_changes_and_again_every_refresh_interval(monkeypatch):
    """Setting a gauge holds the stub's GIL through a round trip to tritonserver: once per change,
    and again every ``GAUGE_REFRESH_S`` (a gauge Triton recreated at a reload gets its value back)."""
    from mmserve.serving import metrics as metrics_module

    monkeypatch.setattr(metrics_module, "GAUGE_REFRESH_S", 3600.0)
    metrics = TritonMetrics(_pb_utils(), {"model": "mm_llm", "version": "1"}, interval_s=0.0)
    steps = [(3, 1), (3, 1), (3, 0), (2, 0), (2, 0)]
    for running, waiting in steps:
        metrics.post(StepStats(running=running, waiting=waiting))
        metrics._outbox.flush(10)  # one update per step
    assert _calls("vllm:num_requests_running") == [("set", 3), ("set", 2)]
    assert _calls("vllm:num_requests_waiting") == [("set", 1), ("set", 0)]
    monkeypatch.setattr(metrics_module, "GAUGE_REFRESH_S", 0.0)
    for _ in range(2):
        metrics.post(StepStats(running=2, waiting=0))
        metrics._outbox.flush(10)
    metrics.close()
    assert _calls("vllm:num_requests_running") == [("set", 3), ("set", 2), ("set", 2), ("set", 2)]
    assert _calls("vllm:num_requests_waiting") == [("set", 1), ("set", 0), ("set", 0), ("set", 0)]


def test_steps_posted_while_an_update_runs_go_out_merged():
    gate = threading.Event()
    metrics = TritonMetrics(_pb_utils(gate), {"model": "mm_llm", "version": "1"}, inter_token_latency=True)
    metrics.post(STEP)  # its update starts and waits at the gate (a slow tritonserver)
    later = [
        StepStats(running=5, waiting=0, generation_tokens=5, inter_token_latencies=(0.006,)),
        StepStats(generation_tokens=2, ttfts=(0.05,)),  # no scheduler stats: the gauges stay
        StepStats(
            running=4,
            waiting=2,
            prompt_tokens=7,
            generation_tokens=4,
            e2e_latencies=(0.4, 0.5),
            request_tpots=(0.01, 0.02),
        ),
    ]
    for step in later:
        metrics.post(step)
    gate.set()
    metrics.close()
    running = _calls("vllm:num_requests_running")
    if len(running) == 2:  # the first update took only STEP (the usual case: it started before the rest)
        assert running == [("set", 3), ("set", 4)]
        assert _calls("vllm:num_requests_waiting") == [("set", 1), ("set", 2)]
        assert _calls("vllm:request_success_total") == [("increment", 1), ("increment", 2)]
        assert _calls("vllm:generation_tokens_total") == [("increment", 3), ("increment", 11)]
        assert _calls("vllm:prompt_tokens_total") == [("increment", 10), ("increment", 7)]
    else:  # all four in one update
        assert running == [("set", 4)]
        assert _calls("vllm:generation_tokens_total") == [("increment", 14)]
    # Histograms take every value, in order; the counters add up to the steps' totals.
    assert [v for _, v in _calls("vllm:time_per_output_token_seconds")] == [0.004, 0.005, 0.006]
    assert [v for _, v in _calls("vllm:time_to_first_token_seconds")] == [0.02, 0.05]
    assert [v for _, v in _calls("vllm:e2e_request_latency_seconds")] == [0.3, 0.4, 0.5]
    assert [v for _, v in _calls("vllm:request_time_per_output_token_seconds")] == [0.0045, 0.01, 0.02]
    assert sum(v for _, v in _calls("vllm:request_success_total")) == 3
    assert sum(v for _, v in _calls("vllm:generation_tokens_total")) == 14


def test_merged_of_one_step_is_that_step():
    assert StepStats.merged([STEP]) == STEP


def test_a_busy_engine_updates_the_metrics_at_most_once_per_interval():
    """Steps every few milliseconds (a busy engine): one update per ``interval_s``, the steps
    between merged, nothing lost; ``close`` does not wait out the interval."""
    metrics = TritonMetrics(_pb_utils(), {"model": "mm_llm", "version": "1"}, interval_s=60.0)
    metrics.post(STEP)
    assert _wait(lambda: _calls("vllm:num_requests_running") == [("set", 3)])
    for running in range(10):
        metrics.post(StepStats(running=running, waiting=0, generation_tokens=1))
        time.sleep(0.005)
    assert _calls("vllm:num_requests_running") == [("set", 3)]  # the rest wait for the interval
    started = time.monotonic()
    metrics.close()
    assert time.monotonic() - started < 30  # not the interval's 60 s
    assert _calls("vllm:num_requests_running") == [("set", 3), ("set", 9)]
    assert _calls("vllm:generation_tokens_total") == [("increment", 3), ("increment", 10)]


def _wait(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_per_adapter_metrics_count_requests_and_follow_the_schedulers_gauges():
    """With LoRA adapters: each request that names one counts once (on the metrics' thread), and the
    scheduler's running and waiting requests per adapter set its gauges, only when they change (an
    adapter the step does not mention is at 0)."""
    metrics = TritonMetrics(_pb_utils(), {"model": "mm_llm", "version": "1"}, interval_s=0.0, adapters=("a", "b"))
    metrics.adapter_request("a")
    metrics.adapter_request("a")
    metrics.adapter_request("unknown")  # not an adapter of the model (refused before): not counted
    for step in (
        StepStats(running=2, waiting=1, lora_running={"a": 2}, lora_waiting={"b": 1}),
        StepStats(running=2, waiting=1, lora_running={"a": 2}, lora_waiting={"b": 1}),
        StepStats(running=0, waiting=0, lora_running={}, lora_waiting={}),
    ):
        metrics.post(step)
        time.sleep(0.05)
    metrics.close()
    assert _calls("mmserve:lora_requests_total") == [("increment", 1), ("increment", 1)]
    # two metrics (a, b) per family: the first step sets both, the repeat nothing, the last both
    assert _calls("vllm:lora_requests_running") == [("set", 2), ("set", 0), ("set", 0), ("set", 0)]
    assert _calls("vllm:lora_requests_waiting") == [("set", 0), ("set", 1), ("set", 0), ("set", 0)]
    plain = TritonMetrics(_pb_utils(), {"model": "mm_llm", "version": "1"})
    assert not any(name.startswith(("mmserve:lora", "vllm:lora")) for name in _Family.created)
    plain.close()

"""vLLM engine statistics as Triton custom metrics (served on Triton's ``/metrics``), with the names
Triton's vLLM backend uses, labelled by model and version.

vLLM calls its stat loggers on the engine's event loop after every step, and each metric update is a
blocking call into tritonserver: ``TritonStatLogger`` only reads the figures there, and the updates
run on the metrics' own ``Outbox`` thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mmserve.serving.outbox import Outbox
from mmserve.vllm_seam import StatLoggerBase, VllmConfig

# Latency buckets (seconds) as vLLM's Prometheus logger uses them.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]


@dataclass(frozen=True)
class StepStats:
    """The figures of one engine step, read on the engine's loop."""

    running: int | None = None
    waiting: int | None = None
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttfts: tuple[float, ...] = ()
    inter_token_latencies: tuple[float, ...] = ()
    e2e_latencies: tuple[float, ...] = ()

    @classmethod
    def read(cls, scheduler_stats: Any, iteration_stats: Any) -> StepStats:
        running = waiting = None
        if scheduler_stats is not None:
            running, waiting = scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs
        if iteration_stats is None:
            return cls(running, waiting)
        return cls(
            running, waiting,
            prompt_tokens=iteration_stats.prompt_token_stats.total,
            generation_tokens=iteration_stats.num_generation_tokens,
            ttfts=tuple(iteration_stats.time_to_first_tokens_iter),
            inter_token_latencies=tuple(iteration_stats.inter_token_latencies_iter),
            e2e_latencies=tuple(finished.e2e_latency for finished in iteration_stats.finished_requests),
        )


class TritonMetrics:
    """The metric families, created once per model instance through ``pb_utils``; updated from
    their own thread (``post``)."""

    def __init__(self, pb_utils: Any, labels: dict[str, str]) -> None:
        self._outbox = Outbox("mmserve-metrics")
        family = pb_utils.MetricFamily
        # A MetricFamily must outlive its Metric objects (Triton refuses updates otherwise).
        self._families: list[Any] = []

        def metric(name: str, description: str, kind: Any, **kwargs: Any) -> Any:
            self._families.append(family(name=name, description=description, kind=kind))
            return self._families[-1].Metric(labels=labels, **kwargs)

        self.prompt_tokens = metric("vllm:prompt_tokens_total", "Number of prefill tokens processed.", family.COUNTER)
        self.generation_tokens = metric(
            "vllm:generation_tokens_total", "Number of generation tokens processed.", family.COUNTER
        )
        self.requests_success = metric(
            "vllm:request_success_total", "Number of finished requests.", family.COUNTER
        )
        self.running = metric("vllm:num_requests_running", "Requests running on the engine.", family.GAUGE)
        self.waiting = metric("vllm:num_requests_waiting", "Requests waiting to be scheduled.", family.GAUGE)
        self.time_to_first_token = metric(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            family.HISTOGRAM, buckets=TTFT_BUCKETS,
        )
        self.time_per_output_token = metric(
            "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
            family.HISTOGRAM, buckets=TPOT_BUCKETS,
        )
        self.e2e_request_latency = metric(
            "vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
            family.HISTOGRAM, buckets=E2E_BUCKETS,
        )


    def post(self, stats: StepStats) -> None:
        """Apply ``stats`` on the metrics' thread (returns at once)."""
        self._outbox.put(lambda: self.apply(stats))

    def apply(self, stats: StepStats) -> None:
        if stats.running is not None:
            self.running.set(stats.running)
            self.waiting.set(stats.waiting)
        if stats.prompt_tokens:
            self.prompt_tokens.increment(stats.prompt_tokens)
        if stats.generation_tokens:
            self.generation_tokens.increment(stats.generation_tokens)
        for ttft in stats.ttfts:
            self.time_to_first_token.observe(ttft)
        for itl in stats.inter_token_latencies:
            self.time_per_output_token.observe(itl)
        for latency in stats.e2e_latencies:
            self.requests_success.increment(1)
            self.e2e_request_latency.observe(latency)

    def close(self) -> None:
        """Apply what is queued, then release the metrics and their families while the stub can
        still talk to Triton (left to interpreter teardown, the families' destructors crash the stub)."""
        self._outbox.close()
        for name in [n for n in vars(self) if n not in ("_families", "_outbox")]:
            delattr(self, name)
        self._families.clear()


class TritonStatLogger(StatLoggerBase):
    """A vLLM V1 stat logger that feeds ``TritonMetrics`` (pass it as a factory with
    ``functools.partial(TritonStatLogger, metrics=...)``)."""

    def __init__(self, vllm_config: VllmConfig, engine_index: int = 0, *, metrics: TritonMetrics,
                 on_record: Callable[[], None] | None = None) -> None:
        self.metrics = metrics
        self.on_record = on_record

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:  # noqa: ANN001
        if self.on_record is not None:  # an engine step finished: progress for the health watcher
            self.on_record()
        self.metrics.post(StepStats.read(scheduler_stats, iteration_stats))

    def log_engine_initialized(self) -> None:
        pass

"""vLLM engine statistics as Triton custom metrics (served on Triton's ``/metrics``), with the names
Triton's vLLM backend uses, labelled by model and version.

vLLM calls its stat loggers on the engine's event loop after every step, and each metric update is a
blocking round trip to tritonserver: ``TritonStatLogger`` only reads the figures there; the
updates run on the metrics' own ``Outbox`` thread, at most one every ``UPDATE_INTERVAL_S`` (a busy
engine runs a hundred steps a second and more, each worth three calls), the steps that queued up
meanwhile merged into one update of each counter and gauge (a gauge set only when it changes, and
every ``GAUGE_REFRESH_S``). A histogram takes one call per value,
so the per-token histogram (``vllm:time_per_output_token_seconds``, 32 calls for a 32-token
request) is opt-in (``report_inter_token_latency``); the per-request one
(``vllm:request_time_per_output_token_seconds``, vLLM's name) costs one call per request
(docs/PERFORMANCE.md).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mmserve.serving.outbox import Outbox
from mmserve.vllm_seam import StatLoggerBase, VllmConfig

# Latency buckets (seconds) as vLLM's Prometheus logger uses them.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]

UPDATE_INTERVAL_S = 0.1
"""The shortest time between two updates of the metrics: far below any scrape interval."""

GAUGE_REFRESH_S = 1.0
"""A gauge is set when its value changes, and at least this often: a gauge Triton recreated (a model
reload) has its value again within this time. Setting one is the one metric call that holds the
stub's GIL through its round trip to tritonserver (python_backend's ``Metric::SendSetValueRequest``;
``observe`` and ``increment`` release it): every other thread of ``mm_llm`` waits meanwhile."""


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
    request_tpots: tuple[float, ...] = ()
    """Each finished request's mean time per output token."""
    lora_running: Mapping[str, int] | None = None
    """Requests running per LoRA adapter (the scheduler's; None: not in this step's stats)."""
    lora_waiting: Mapping[str, int] | None = None
    lora_requests: tuple[str, ...] = ()
    """The adapter of each request started since the last step (``TritonMetrics.adapter_request``)."""

    @classmethod
    def read(cls, scheduler_stats: Any, iteration_stats: Any) -> StepStats:
        running = waiting = lora_running = lora_waiting = None
        if scheduler_stats is not None:
            running, waiting = scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs
            lora_running = dict(scheduler_stats.running_lora_adapters)
            lora_waiting = dict(scheduler_stats.waiting_lora_adapters)
        if iteration_stats is None:
            return cls(running, waiting, lora_running=lora_running, lora_waiting=lora_waiting)
        return cls(
            running,
            waiting,
            lora_running=lora_running,
            lora_waiting=lora_waiting,
            prompt_tokens=iteration_stats.prompt_token_stats.total,
            generation_tokens=iteration_stats.num_generation_tokens,
            ttfts=tuple(iteration_stats.time_to_first_tokens_iter),
            inter_token_latencies=tuple(iteration_stats.inter_token_latencies_iter),
            e2e_latencies=tuple(finished.e2e_latency for finished in iteration_stats.finished_requests),
            request_tpots=tuple(finished.mean_time_per_output_token for finished in iteration_stats.finished_requests),
        )

    @classmethod
    def merged(cls, steps: list[StepStats]) -> StepStats:
        """One update for several steps: the last gauges, the counters summed, every observation."""
        gauges = next((step for step in reversed(steps) if step.running is not None), cls())
        return cls(
            gauges.running,
            gauges.waiting,
            lora_running=gauges.lora_running,
            lora_waiting=gauges.lora_waiting,
            lora_requests=tuple(name for step in steps for name in step.lora_requests),
            prompt_tokens=sum(step.prompt_tokens for step in steps),
            generation_tokens=sum(step.generation_tokens for step in steps),
            ttfts=tuple(value for step in steps for value in step.ttfts),
            inter_token_latencies=tuple(value for step in steps for value in step.inter_token_latencies),
            e2e_latencies=tuple(value for step in steps for value in step.e2e_latencies),
            request_tpots=tuple(value for step in steps for value in step.request_tpots),
        )


class TritonMetrics:
    """The metric families, created once per model instance through ``pb_utils``; updated from
    their own thread (``post``).

    Args:
        inter_token_latency: also the per-token histogram ``vllm:time_per_output_token_seconds``
            (one call into tritonserver per generated token).
        adapters: the LoRA adapters served: per adapter (label ``lora_name``), the requests that
            named it (``mmserve:lora_requests_total``) and the engine's running and waiting requests
            on it (``vllm:lora_requests_running``, ``vllm:lora_requests_waiting``).
        interval_s: the shortest time between two updates (the steps posted meanwhile wait, merged).
    """

    def __init__(
        self,
        pb_utils: Any,
        labels: dict[str, str],
        *,
        inter_token_latency: bool = False,
        interval_s: float = UPDATE_INTERVAL_S,
        adapters: Sequence[str] = (),
    ) -> None:
        self._outbox = Outbox("mmserve-metrics")
        self._steps: list[StepStats] = []  # posted, not yet applied
        self._steps_lock = threading.Lock()
        self._interval_s = interval_s
        self._closing = threading.Event()  # cuts the pause after an update short
        self._gauges: tuple[int | None, int | None] = (None, None)  # (running, waiting) as last set
        self._gauges_set_at = -math.inf
        family = pb_utils.MetricFamily
        # A MetricFamily must outlive its Metric objects (Triton refuses updates otherwise).
        self._families: list[Any] = []

        def metric(name: str, description: str, kind: Any, **kwargs: Any) -> Any:
            self._families.append(family(name=name, description=description, kind=kind))
            return self._families[-1].Metric(labels=labels, **kwargs)

        # Per adapter (label lora_name), made as adapters come (add_adapters); each table is replaced
        # whole, never changed in place: the metrics' thread reads them meanwhile.
        self._pb_family, self._labels = family, labels
        self._lora_families: dict[str, Any] = {}
        self._lora_lock = threading.Lock()
        self.lora_requests: dict[str, Any] = {}
        self.lora_running: dict[str, Any] = {}
        self.lora_waiting: dict[str, Any] = {}
        self._lora_gauges: dict[str, tuple[int, int]] = {}  # adapter -> (running, waiting) as last set
        self.add_adapters(adapters)

        self.prompt_tokens = metric("vllm:prompt_tokens_total", "Number of prefill tokens processed.", family.COUNTER)
        self.generation_tokens = metric(
            "vllm:generation_tokens_total", "Number of generation tokens processed.", family.COUNTER
        )
        self.requests_success = metric("vllm:request_success_total", "Number of finished requests.", family.COUNTER)
        self.running = metric("vllm:num_requests_running", "Requests running on the engine.", family.GAUGE)
        self.waiting = metric("vllm:num_requests_waiting", "Requests waiting to be scheduled.", family.GAUGE)
        self.time_to_first_token = metric(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            family.HISTOGRAM,
            buckets=TTFT_BUCKETS,
        )
        self.request_time_per_output_token = metric(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            family.HISTOGRAM,
            buckets=TPOT_BUCKETS,
        )
        self.time_per_output_token = (
            metric(
                "vllm:time_per_output_token_seconds",
                "Histogram of time per output token in seconds.",
                family.HISTOGRAM,
                buckets=TPOT_BUCKETS,
            )
            if inter_token_latency
            else None
        )
        self.e2e_request_latency = metric(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            family.HISTOGRAM,
            buckets=E2E_BUCKETS,
        )

    def add_adapters(self, adapters: Sequence[str]) -> None:
        """The per-adapter metrics of each of ``adapters`` not yet counted (an adapter no longer
        served keeps its: its count stays)."""
        family = self._pb_family
        with self._lora_lock:
            for attribute, name, description, kind in (
                (
                    "lora_requests",
                    "mmserve:lora_requests_total",
                    "Requests that named this LoRA adapter.",
                    family.COUNTER,
                ),
                ("lora_running", "vllm:lora_requests_running", "Requests running on this adapter.", family.GAUGE),
                ("lora_waiting", "vllm:lora_requests_waiting", "Requests waiting for this adapter.", family.GAUGE),
            ):
                table: dict[str, Any] = getattr(self, attribute)
                new = [adapter for adapter in adapters if adapter not in table]
                if not new:
                    continue
                if name not in self._lora_families:
                    self._lora_families[name] = family(name=name, description=description, kind=kind)
                    self._families.append(self._lora_families[name])
                made = {a: self._lora_families[name].Metric(labels={**self._labels, "lora_name": a}) for a in new}
                setattr(self, attribute, {**table, **made})

    def adapter_request(self, adapter: str) -> None:
        """A request named ``adapter`` (counted on the metrics' thread)."""
        if adapter in self.lora_requests:
            self.post(StepStats(lora_requests=(adapter,)))

    def post(self, stats: StepStats) -> None:
        """Apply ``stats`` on the metrics' thread (returns at once); steps posted while an update is
        queued join it."""
        with self._steps_lock:
            self._steps.append(stats)
            if len(self._steps) > 1:  # an update is queued: it takes this step too
                return
        self._outbox.put(self._apply_posted)

    def _apply_posted(self) -> None:
        with self._steps_lock:
            steps, self._steps = self._steps, []
        self.apply(StepStats.merged(steps))
        # The outbox's thread waits before its next update: the steps posted meanwhile queue one
        # update and join it (``post``).
        self._closing.wait(self._interval_s)

    def apply(self, stats: StepStats) -> None:
        if stats.running is not None:
            now = time.monotonic()
            refresh = now - self._gauges_set_at >= GAUGE_REFRESH_S
            if refresh or stats.running != self._gauges[0]:
                self.running.set(stats.running)
            if refresh or stats.waiting != self._gauges[1]:
                self.waiting.set(stats.waiting)
            self._gauges = (stats.running, stats.waiting)
            if refresh:
                self._gauges_set_at = now
        if stats.prompt_tokens:
            self.prompt_tokens.increment(stats.prompt_tokens)
        if stats.generation_tokens:
            self.generation_tokens.increment(stats.generation_tokens)
        for ttft in stats.ttfts:
            self.time_to_first_token.observe(ttft)
        if self.time_per_output_token is not None:
            for itl in stats.inter_token_latencies:
                self.time_per_output_token.observe(itl)
        for tpot in stats.request_tpots:
            self.request_time_per_output_token.observe(tpot)
        if stats.e2e_latencies:
            self.requests_success.increment(len(stats.e2e_latencies))
        for latency in stats.e2e_latencies:
            self.e2e_request_latency.observe(latency)
        for adapter in stats.lora_requests:
            self.lora_requests[adapter].increment(1)
        if stats.lora_running is not None and self.lora_running:
            for adapter in self.lora_running:
                counts = (stats.lora_running.get(adapter, 0), (stats.lora_waiting or {}).get(adapter, 0))
                if self._lora_gauges.get(adapter) != counts:
                    self.lora_running[adapter].set(counts[0])
                    self.lora_waiting[adapter].set(counts[1])
                    self._lora_gauges[adapter] = counts

    def close(self) -> None:
        """Apply what is queued, then let the metrics be: never deleted, neither now nor at the
        stub's exit (``never_free``; ``mmserve.triton_seam`` SHARED_METRIC_FAMILIES), since another
        instance of the model may be using the same families and series."""
        from mmserve.serving.embedded import never_free

        self._closing.set()
        self._outbox.close()
        adapters = (m for d in (self.lora_requests, self.lora_running, self.lora_waiting) for m in d.values())
        never_free(
            *self._families, *(value for name, value in vars(self).items() if not name.startswith("_")), *adapters
        )


class TritonStatLogger(StatLoggerBase):
    """A vLLM V1 stat logger that feeds ``TritonMetrics`` (pass it as a factory with
    ``functools.partial(TritonStatLogger, metrics=...)``)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_index: int = 0,
        *,
        metrics: TritonMetrics,
        on_record: Callable[[], None] | None = None,
    ) -> None:
        self.metrics = metrics
        self.on_record = on_record

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:  # noqa: ANN001
        if self.on_record is not None:  # an engine step finished: progress for the health watcher
            self.on_record()
        self.metrics.post(StepStats.read(scheduler_stats, iteration_stats))

    def log_engine_initialized(self) -> None:
        pass

"""``bench/token_rates.py``'s capacity model: the fit recovers known costs, the cores a GPU node needs
follow its formula, and each pacing reaches the systems it applies to with the fields they take.

The model is what docs/PERFORMANCE.md's deployment table comes from; a wrong fit or formula would
publish wrong core counts without any run failing.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def rates() -> Iterator[Any]:
    sys.path.insert(0, str(BENCH))
    try:
        import token_rates

        yield token_rates
    finally:
        sys.path.remove(str(BENCH))


def measurement(rates, system: str, kind: str, cpu_s: float, tokens: int, responses: int, requests: int) -> Any:
    return rates.Measurement(
        system=system,
        pacing="flush=150",
        workload="text",
        streams=64,
        max_tokens=tokens // requests,
        requests=requests,
        wall_s=1.0,
        tokens=tokens,
        responses=responses,
        cpu_s={kind: cpu_s},
        client_cpu_s=0.0,
        answers={},
    )


def test_the_fit_recovers_the_costs_that_made_the_runs(rates):
    """Runs made from known costs (per token, response, request) give those costs back, and a cost
    the runs can't tell from zero comes out zero, never negative (non-negative least squares)."""
    truth = rates.Costs(per_token=25e-6, per_response=320e-6, per_request=0.0)
    shapes = [(16384, 900, 64), (16384, 5000, 64), (65536, 5700, 64), (65536, 35000, 64), (8192, 600, 32)]
    runs = [measurement(rates, "mm_ensemble", "mm_llm", truth.cpu_s(*shape), *shape) for shape in shapes]
    (fitted,) = rates.fit(runs).values()
    assert fitted.per_token == pytest.approx(truth.per_token, rel=1e-6)
    assert fitted.per_response == pytest.approx(truth.per_response, rel=1e-6)
    assert fitted.per_request == pytest.approx(0.0, abs=1e-9) and fitted.per_request >= 0
    assert rates.predict({("mm_ensemble", "mm_llm"): fitted}, runs[0]) == pytest.approx(runs[0].cpu_s["mm_llm"])


def test_the_cores_a_node_needs(rates):
    """64 streams at 40 tokens/s each, 512-token answers: 150 ms of pacing gives each stream 6.67
    responses/s (427 in all) plus a first and last per request (5/s); 0 ms a response per token."""
    costs = rates.Costs(per_token=20e-6, per_response=300e-6, per_request=1e-3)
    requests = 2560 / 512
    paced = 20e-6 * 2560 + 300e-6 * (64 * 1000 / 150 + requests) + 1e-3 * requests
    assert rates.cores_needed(costs, 2560, 64, 150, 512) == pytest.approx(paced)
    per_token = 20e-6 * 2560 + 300e-6 * (2560 + requests) + 1e-3 * requests
    assert rates.cores_needed(costs, 2560, 64, 0, 512) == pytest.approx(per_token)
    # a stream slower than the pacing: a response per token still
    assert rates.cores_needed(costs, 64 * 5, 64, 150, 512) == pytest.approx(
        20e-6 * 320 + 300e-6 * (320 + 320 / 512) + 1e-3 * 320 / 512
    )


def test_a_pacing_reaches_each_system_as_it_takes_it(rates):
    """mm_ensemble takes stream_flush_ms per request; the gateway and vllm serve run at their
    shipped flush / per-token default (a flush pacing other than the shipped one skips them)."""
    shipped = rates.Pacing.parse(f"flush={rates.SHIPPED_FLUSH_MS:g}")
    assert shipped.sampling("mm_ensemble") == {"stream_flush_ms": rates.SHIPPED_FLUSH_MS}
    assert shipped.sampling("gateway") == {} and shipped.sampling("vllm-serve") == {}
    zero = rates.Pacing.parse("flush=0")
    assert zero.sampling("gateway") is None and zero.sampling("vllm-serve") is None
    interval = rates.Pacing.parse("interval=10")
    assert interval.sampling("mm_ensemble") == {"stream_interval": 10, "stream_flush_ms": 0.0}
    assert interval.sampling("vllm-serve") == {"stream_interval": 10} and interval.name == "interval=10"
    with pytest.raises(ValueError, match="flush=MS"):
        rates.Pacing.parse("hold=3")

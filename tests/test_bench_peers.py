"""``bench/peers.py`` goes on without a system whose request fails or stalls, and its report says so.

A peer that stops answering (it happened to ``vllm-render``: 14 tokens, then nothing) used to end
a half-hour run with nothing written. The systems here are stand-ins that stream token ids (the
failure cannot be produced on demand by a real server); the measuring code is the benchmark's own.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
TOKENS = 4


@pytest.fixture(scope="module")
def peers() -> Iterator[Any]:
    sys.path.insert(0, str(BENCH))
    try:
        import peers

        yield peers
    finally:
        sys.path.remove(str(BENCH))


def settings(peers: Any, tmp_path: Path) -> Any:
    return peers.Settings(
        systems=(peers.ENSEMBLE, peers.VLLM_SERVE),
        workloads=("text",),
        concurrency=(1, 4),
        rounds=3,
        requests_per_slot=2,
        min_requests=1,
        warmup=2,
        settle_s=0.0,
        max_tokens=TOKENS,
        image_size=(28, 28),
        audio_seconds=0.1,
        engine_args={"model": str(tmp_path)},
        out=tmp_path,
        command="bench/peers.py",
        sequential_start=False,
    )


def stand_in(peers: Any, name: str, stall_at: int | None = None) -> Any:
    """A system that streams ``TOKENS`` token ids per request, one per response; from its
    ``stall_at``-th request on (counting from 0), one token and then nothing."""

    class StandIn(peers.System):
        def __init__(self) -> None:
            super().__init__(name)
            self.started = 0
            self.open = 0  # requests whose stream has not ended (finished or cancelled)

        async def tokens(self, request: Any) -> AsyncIterator[list[int]]:
            number, self.started = self.started, self.started + 1
            self.open += 1
            try:
                for token in range(TOKENS):
                    yield [request.seed * 100 + token]
                    if stall_at is not None and number >= stall_at:
                        await asyncio.sleep(3600)
                    await asyncio.sleep(0)
            finally:
                self.open -= 1

    return StandIn()


def test_a_stalled_system_is_left_out_and_reported(peers: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(peers, "REQUEST_TIMEOUT_S", 0.3)
    config = settings(peers, tmp_path)
    good = stand_in(peers, peers.ENSEMBLE)
    # Its warm-up, round 0 and round 1's run at concurrency 1 answer; then every request stalls.
    round_0 = sum(config.requests_per_run(level, "text") for level in config.concurrency)
    answered = config.warmup + round_0 + config.requests_per_run(1, "text")
    stalling = stand_in(peers, peers.VLLM_SERVE, stall_at=answered)
    measured = peers.Measured([good, stalling])

    async def benchmark() -> tuple[list[Any], list[Any], int]:
        warmups = await peers.warm_up(measured, config)
        runs = await peers.measure(measured, config)
        return warmups, runs, stalling.open  # streams still open on the loop after the failure

    warmups, runs, left_open = asyncio.run(benchmark())

    cells = len(peers.plan(config))
    assert [run.system for run in runs].count(peers.ENSEMBLE) == cells  # the other system ran every cell
    assert [(r.round, r.concurrency) for r in runs if r.system == peers.VLLM_SERVE] == [(0, 1), (0, 4), (1, 1)]
    assert {run.system for run in warmups} == {peers.ENSEMBLE, peers.VLLM_SERVE}
    [failure] = measured.failures
    assert (failure.system, failure.workload, failure.round, failure.concurrency) == (peers.VLLM_SERVE, "text", 1, 4)
    assert "no answer to request" in failure.reason and "(1 tokens came)" in failure.reason
    assert stalling.started - answered >= 4  # the failed run had its 4 requests in flight...
    assert left_open == 0  # ...and were cancelled with it, not left running beside the next runs
    assert measured.systems == [good]

    report = peers.Report(config, runs, warmups, None, 1.0, {}, measured.failures)
    assert not report.ok
    assert failure.describe() in report.check()
    # With the shipped caches the warm-up requests are the ones compared across systems: equal here.
    assert report.check().startswith(
        f"OK: every one of the {config.warmup} requests gave the same greedy tokens on every system that answered it"
    )
    table = peers.results_table("text", report.stats, config)
    assert f"| 4 | {peers.VLLM_SERVE} | failed |" not in table  # round 0 of both levels is in
    assert all(row.count("|") == table.splitlines()[0].count("|") for row in table.splitlines())
    assert report.json()["failures"] == [vars(failure)]


def test_a_system_failing_in_its_warm_up_gets_no_runs(peers: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(peers, "REQUEST_TIMEOUT_S", 0.3)
    config = settings(peers, tmp_path)
    good = stand_in(peers, peers.ENSEMBLE)
    stalling = stand_in(peers, peers.VLLM_SERVE, stall_at=0)
    measured = peers.Measured([good, stalling])

    async def benchmark() -> tuple[list[Any], list[Any]]:
        warmups = await peers.warm_up(measured, config)
        return warmups, await peers.measure(measured, config)

    warmups, runs = asyncio.run(benchmark())

    assert {run.system for run in runs} == {peers.ENSEMBLE}
    assert [failure.round for failure in measured.failures] == [-1]
    report = peers.Report(config, runs, warmups, None, 1.0, {}, measured.failures)
    table = peers.results_table("text", report.stats, config)
    assert f"| 4 | {peers.VLLM_SERVE} | failed |" in table
    assert "the warm-up" in report.check() and not report.ok
    assert "| 4 | mm_ensemble |" in table and "–" in table  # no ratio to a system that has none


def test_lora_modules_spread_the_requests_and_reach_every_system(peers: Any, tmp_path: Path):
    """``--lora-modules``: the requests take the base model and each adapter in turn; mm_llm gets them
    in ``multi_lora.json`` (and each request its ``lora_name``), the engines LoRA's arguments sized
    for them (every adapter in a step, the largest rank's slots)."""
    import dataclasses
    import json

    adapters = []
    for name, rank in (("a", 8), ("b", 12)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank}))
        adapters.append((name, str(folder)))
    assert peers.lora_engine_args(adapters) == {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
    assert peers.lora_engine_args([]) == {}
    lora = dataclasses.replace(settings(peers, tmp_path), lora_modules=tuple(adapters))
    assert [peers.make_request("text", seed, lora).lora for seed in range(6)] == [None, "a", "b", None, "a", "b"]
    assert peers.make_request("text", 1, settings(peers, tmp_path)).lora is None
    repository = peers.triton_repository({"model": "m"}, tmp_path / "run", None, lora.lora_modules)
    assert json.loads((repository / "mm_llm" / "multi_lora.json").read_text()) == dict(adapters)

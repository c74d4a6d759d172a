#!/usr/bin/env python3
"""Soak: N requests at concurrency C against the live server, mixing good requests of every
modality, cancellations and bad inputs; nothing may change a good request's answer.

    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python bench/soak.py                 # 2000 requests, C=32
    .venv/bin/python bench/soak.py --requests 200 --concurrency 8          # a quick one
    .venv/bin/python bench/soak.py --url 127.0.0.1:8001                     # a running server

Starts a ``TritonServer`` on model_repository/ (tiny Qwen2.5-Omni) unless ``--url`` is given. First
the reference of each of ``--pool`` distinct good requests (text, image, audio, image+audio, two
images; greedy, each sent alone), then the soak: each request is, at random (seeded), a good one
from the pool (65%), a cancelled stream (15%: ``Generation.cancel()`` of the project's client after
its first delta, which sends ``mm_llm`` a cancel for the request) or a bad input
(20%: from tests/test_e2e_inputs.py's table). Every good answer is compared with its reference.

Prints: mismatches (must be 0), outcomes by class (good requests must all succeed; bad ones must
all be INVALID_ARG), latency, RSS of the server's process tree after the references (warm) and at
the end, and /dev/shm before and after. Exit status 1 on any mismatch or unexpected outcome.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def shm_bytes() -> tuple[int, int]:
    files = list(Path("/dev/shm").iterdir())
    return len(files), sum(f.stat().st_size for f in files if f.is_file())


def tree_rss(pid: int | None) -> float:
    """RSS of a process and its descendants, MiB (shared pages counted once per process)."""
    import psutil

    if pid is None:
        return float("nan")
    root = psutil.Process(pid)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--pool", type=int, default=20, help="distinct good requests")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--entry", default="mm_ensemble")
    parser.add_argument("--url", help="gRPC host:port of a running server (tiny default model)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    shm_before = shm_bytes()
    if args.url:
        run(args, args.url, None)
        return report_exit
    from mmserve_dev.triton import TritonServer

    env = {
        "MMSERVE_MODEL": str(ROOT / "models" / "qwen2_5_omni"),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }
    with TritonServer(
        ROOT / "model_repository",
        env=env,
        shm_default_byte_size=32 * 1024 * 1024,
        keep_loaded=("mm_llm", "mm_ensemble"),
    ) as server:
        print(f"server up: {server.grpc_url} (log {server.log_path})", flush=True)
        run(args, server.grpc_url, server.pid)
        started = time.monotonic()
    code = server.stop()
    shm_after = shm_bytes()
    print(f"stop: {time.monotonic() - started:.1f} s, exit code {code}")
    print(
        f"/dev/shm before start: {shm_before[0]} files, {shm_before[1] / 2**20:.1f} MiB; "
        f"after stop: {shm_after[0]} files, {shm_after[1] / 2**20:.1f} MiB"
    )
    return report_exit


report_exit = 0


def run(args: argparse.Namespace, url: str, pid: int | None) -> None:
    global report_exit
    from test_e2e_inputs import RAW_CASES

    from mmserve.client import ClientError, MMClient

    import utils

    client = MMClient(url, entry=args.entry)
    sampling = {"max_tokens": args.max_tokens, "temperature": 0.0}
    pool = [utils.make_case(name, parts, seed) for seed in range(args.pool) for name, parts in utils.CASES.items()][
        : args.pool
    ]
    t0 = time.monotonic()
    references = [client.generate(c.text, c.images, c.audios, **sampling).output_ids for c in pool]
    print(f"{len(pool)} references in {time.monotonic() - t0:.1f} s", flush=True)
    bad_cases = [
        case
        for case in RAW_CASES
        if "grpc" in case.protocols and case.code == "INVALID_ARG" and "10000x10000" not in case.id
    ]
    rss_warm = tree_rss(pid)
    shm_warm = shm_bytes()

    rng = random.Random(args.seed)
    plan = [rng.choices(["good", "cancel", "bad"], weights=[65, 15, 20])[0] for _ in range(args.requests)]
    outcomes: collections.Counter[str] = collections.Counter()
    mismatches: list[str] = []
    latencies: list[float] = []
    lock = threading.Lock()

    def one(index: int) -> None:
        try:
            outcome = attempt(index)
        except Exception as exc:  # noqa: BLE001 - counted: a soak reports, it doesn't stop
            outcome = f"{plan[index]}: EXCEPTION {type(exc).__name__}: {str(exc)[:80]}"
        with lock:
            outcomes[outcome] += 1

    def attempt(index: int) -> str:
        kind = plan[index]
        local = random.Random(args.seed * 1_000_003 + index)
        started = time.monotonic()
        if kind == "good":
            k = local.randrange(len(pool))
            case = pool[k]
            try:
                ids = (
                    MMClient(url, entry=args.entry).generate(case.text, case.images, case.audios, **sampling).output_ids
                )
                outcome = "good: ok" if ids == references[k] else "good: MISMATCH"
                if ids != references[k]:
                    with lock:
                        mismatches.append(f"#{index} pool {k} ({case.name}): {ids} != {references[k]}")
            except ClientError as exc:
                outcome = f"good: ERROR {exc.code} {str(exc)[:80]}"
            with lock:
                latencies.append(time.monotonic() - started)
        elif kind == "cancel":  # the project's client: a cancel control request to mm_llm beside the stream
            case = pool[local.randrange(len(pool))]
            generation = MMClient(url, entry=args.entry).start(case.text, max_tokens=400, ignore_eos=True)
            try:
                next(iter(generation))
            finally:
                generation.cancel()
            outcome = "cancel: sent"
        else:
            bad = bad_cases[local.randrange(len(bad_cases))]
            try:
                utils.send_tensors(utils.Endpoints(url, None, None), args.entry, bad.request.tensors())
                outcome = "bad: ACCEPTED"
            except ClientError as exc:
                outcome = f"bad: {exc.code}" if exc.code else f"bad: untagged {str(exc)[:80]}"
        return outcome

    done = [0]
    rss_series: list[tuple[int, float]] = [(0, rss_warm)]

    def counted(index: int) -> None:
        one(index)
        with lock:
            done[0] += 1
            sample = done[0] % max(args.requests // 8, 1) == 0
        if sample:
            rss_series.append((done[0], tree_rss(pid)))

    t0 = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool_executor:
        list(pool_executor.map(counted, range(args.requests)))
    elapsed = time.monotonic() - t0
    time.sleep(3)  # let cancelled requests drain
    rss_end = tree_rss(pid)
    shm_end = shm_bytes()

    latencies.sort()
    print(
        f"\n{args.requests} requests at concurrency {args.concurrency} in {elapsed:.0f} s "
        f"({args.requests / elapsed:.1f} req/s) through {args.entry}"
    )
    for outcome, count in sorted(outcomes.items()):
        print(f"  {outcome:<22} {count}")
    if latencies:
        print(
            f"good latency p50 {latencies[len(latencies) // 2]:.2f} s, p99 {latencies[int(len(latencies) * 0.99)]:.2f} s"
        )
    print(f"mismatches: {len(mismatches)}")
    for line in mismatches[:10]:
        print("  " + line)
    print(
        f"server RSS (process tree): {rss_warm:.0f} MiB warm -> {rss_end:.0f} MiB after the soak "
        f"({rss_end - rss_warm:+.0f} MiB); by requests done: "
        + ", ".join(f"{n}: {rss:.0f}" for n, rss in sorted(rss_series))
    )
    print(
        f"/dev/shm while serving: {shm_warm[0]} files {shm_warm[1] / 2**20:.0f} MiB warm -> "
        f"{shm_end[0]} files {shm_end[1] / 2**20:.0f} MiB after"
    )
    unexpected = [o for o in outcomes if o not in ("good: ok", "cancel: sent", "bad: INVALID_ARG")]
    if mismatches or unexpected:
        print(f"FAIL: {len(mismatches)} mismatch(es), unexpected outcomes {unexpected}")
        report_exit = 1
    else:
        print("check: OK")


if __name__ == "__main__":
    sys.exit(main())

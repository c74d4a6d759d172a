"""Encoder offload, measured: the in-engine encoder (``mm_ensemble``) against the ``encode`` model
(``mm_ensemble_encoded``: preprocess -> encode -> mm_llm), with and without its cache's hits.

One tritonserver serves ``model_repository/`` and ``model_repository_encoder/`` (one engine, shared
by both chains); both chains get the same requests, in alternating runs, closed loop at each
concurrency, streamed, greedy with ``ignore_eos``. Image + audio requests (448x448 PNG, 3-s WAV):

* ``new``: new media in every request: every item is encoded (the encode model's cache misses);
* ``repeat``: media drawn from a pool of ``--pool`` image + clip pairs, after a text that differs
  per request (so the engine's prefix cache can't reuse the media's tokens): the encode model's
  cache hits once a pair was seen; the engine's own encoder cache may too;
* ``multiturn``: conversations whose every turn adds an image and sends the earlier turns again
  (their images come back each turn).

Every request's greedy tokens are compared across the two chains (they must be equal). Printed: per
workload and concurrency, requests/s, TTFT p50/p95 and latency p50 for each chain, the ratio, and
the encode model's cache hits and misses during the runs.

Reproduce (about 5 minutes on 2 CPU cores, after ``.venv/bin/python -m mmserve_dev.tiny_models``)::

    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python bench/encoder_offload.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import percentile_ms

ROOT = Path(__file__).resolve().parents[1]
CHAINS = ("mm_ensemble", "mm_ensemble_encoded")
WORKLOADS = ("new", "repeat", "multiturn")


@dataclass
class Request:
    """One request: its conversation and media, the same for both chains."""

    name: str
    messages: list[dict[str, Any]]
    images: list[bytes]
    audios: list[bytes]


@dataclass
class Outcome:
    ttft: float
    latency: float
    ids: list[int]


@dataclass
class Run:
    chain: str
    wall: float
    outcomes: list[Outcome] = field(default_factory=list)


def media(seed: int) -> tuple[bytes, bytes]:
    from mmserve_dev.samples import encode_audio, encode_image, sample_audio, sample_image

    return encode_image(sample_image(seed, size=(448, 448))), encode_audio(sample_audio(seed, seconds=3.0))


def build(workload: str, count: int, *, seed: int, pool: int) -> list[Request]:
    requests = []
    if workload == "multiturn":
        turns = 3
        for conversation in range((count + turns - 1) // turns):
            messages: list[dict[str, Any]] = []
            images: list[bytes] = []
            for turn in range(turns):
                image, _ = media(seed + 100 * conversation + turn)
                images = [*images, image]
                if messages:
                    messages.append({"role": "assistant", "content": "Noted."})
                question = f"Turn {turn + 1}: what changed in this picture?"
                messages.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]})
                requests.append(Request(f"c{conversation}t{turn}", json.loads(json.dumps(messages)), images, []))
        return requests[:count]
    pairs = [media(seed + k) for k in range(pool)]
    for index in range(count):
        image, clip = pairs[index % pool] if workload == "repeat" else media(seed + 1000 + index)
        content = [
            {"type": "text", "text": f"Request {seed + index}."},
            {"type": "image"},
            {"type": "audio"},
            {"type": "text", "text": "Describe the picture and the sound."},
        ]
        requests.append(Request(f"{workload}{index}", [{"role": "user", "content": content}], [image], [clip]))
    return requests


def send(url: str, chain: str, request: Request, max_tokens: int) -> Outcome:
    from mmserve.client import MMClient

    client = MMClient(url, entry=chain)
    start = time.perf_counter()
    ttft, ids = 0.0, list[int]()
    generation = client.start(
        messages=request.messages,
        images=request.images,
        audios=request.audios,
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
    )
    for response in generation:
        if response.output_ids and not ids:
            ttft = time.perf_counter() - start
        ids += response.output_ids
    return Outcome(ttft, time.perf_counter() - start, ids)


def run(url: str, chain: str, requests: Sequence[Request], concurrency: int, max_tokens: int) -> Run:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outcomes = list(pool.map(lambda r: send(url, chain, r, max_tokens), requests))
    return Run(chain, time.perf_counter() - start, outcomes)


def cache_counts(metrics_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    counts = {"hits": 0.0, "misses": 0.0}
    for line in text.splitlines():
        for kind in counts:
            if line.startswith(f"mmserve_encoder_cache_{kind}_total{{"):
                counts[kind] += float(line.rsplit(" ", 1)[1])
    return counts


def row(runs: Sequence[Run]) -> dict[str, float]:
    outcomes = [o for r in runs for o in r.outcomes]
    return {
        "rps": len(outcomes) / sum(r.wall for r in runs),
        "ttft50": percentile_ms([o.ttft for o in outcomes], 50),
        "ttft95": percentile_ms([o.ttft for o in outcomes], 95),
        "lat50": percentile_ms([o.latency for o in outcomes], 50),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "models" / "qwen2_5_omni"))
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--requests", type=int, default=12, help="per run (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per chain and cell, alternating")
    parser.add_argument("--pool", type=int, default=4, help="image + clip pairs of the repeat workload")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    from mmserve_dev.triton import TritonServer

    env = {"MMSERVE_MODEL": str(Path(args.model).resolve())}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    print(f"# encoder offload: {platform.node() or 'host'}, {os.cpu_count()} CPUs, model {args.model}", flush=True)
    started = time.perf_counter()
    differ: list[str] = []
    table: list[tuple[str, int, dict[str, dict[str, float]], dict[str, float]]] = []
    with TritonServer(
        [ROOT / "model_repository", ROOT / "model_repository_encoder"],
        env=env,
        shm_default_byte_size=32 * 1024 * 1024,
        drain="mm_llm",
    ) as server:
        warm = build("new", 2, seed=7, pool=1)
        for chain in CHAINS:
            run(server.grpc_url, chain, warm, 1, args.max_tokens)
        for w_index, workload in enumerate(args.workloads):
            for concurrency in args.concurrency:
                runs: dict[str, list[Run]] = {chain: [] for chain in CHAINS}
                before = cache_counts(server.metrics_url)
                for round_ in range(args.rounds):
                    # a new seed per cell and round, the same for both chains
                    seed = 100_000 * (w_index + 1) + 10_000 * concurrency + 1_000 * round_
                    requests = build(workload, args.requests, seed=seed, pool=args.pool)
                    order = CHAINS if round_ % 2 == 0 else CHAINS[::-1]
                    for chain in order:
                        runs[chain].append(run(server.grpc_url, chain, requests, concurrency, args.max_tokens))
                    first, second = (runs[chain][-1] for chain in CHAINS)
                    differ += [
                        f"{workload} c{concurrency} {r.name}"
                        for r, a, b in zip(requests, first.outcomes, second.outcomes, strict=True)
                        if a.ids != b.ids
                    ]
                after = cache_counts(server.metrics_url)
                cache = {kind: after[kind] - before[kind] for kind in after}
                table.append((workload, concurrency, {chain: row(runs[chain]) for chain in CHAINS}, cache))
                print(f"{workload} c{concurrency}: done", file=sys.stderr, flush=True)

    print(
        f"\ntook {(time.perf_counter() - started) / 60:.1f} min; {args.requests} requests per run, "
        f"{args.rounds} rounds, {args.max_tokens} tokens each\n"
    )
    print(
        "| workload | concurrency | req/s in-engine | req/s encode | encode ÷ in-engine | TTFT p50 in-engine / encode (ms) "
        "| TTFT p95 in-engine / encode (ms) | latency p50 in-engine / encode (ms) | encode cache hits / misses |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for workload, concurrency, rows, cache in table:
        a, b = rows["mm_ensemble"], rows["mm_ensemble_encoded"]
        print(
            f"| {workload} | {concurrency} | {a['rps']:.2f} | {b['rps']:.2f} | {b['rps'] / a['rps']:.2f}x "
            f"| {a['ttft50']:.0f} / {b['ttft50']:.0f} | {a['ttft95']:.0f} / {b['ttft95']:.0f} "
            f"| {a['lat50']:.0f} / {b['lat50']:.0f} | {cache['hits']:.0f} / {cache['misses']:.0f} |"
        )
    print()
    print(
        "tokens: " + ("every request gave the same greedy tokens on both chains" if not differ else f"DIFFER: {differ}")
    )
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

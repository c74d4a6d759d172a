"""Raw multimodal inputs vs. already-processed inputs on one vLLM engine, side by side.

One ``EngineRunner`` (vLLM V1 ``AsyncLLM`` with the mmserve pass-through plugin) on the tiny
Qwen2.5-Omni thinker serves the same workload twice per round:

* ``raw``: ``{"prompt": chat text, "multi_modal_data": {"image": [PIL], "audio": [(wave, sr)]}}`` --
  vLLM's frontend (this process) runs the HF processor on every request;
* ``processed``: the HF processor was run beforehand, outside the timed region (as Triton's
  ``preprocess`` model does in another process), and the engine gets expanded ``prompt_token_ids``
  plus the feature tensors (``mmserve.inputs.processed_prompt``).

Every request has its own media (seeded per round and request; 400x300 images, 3-5 s clips), and
neither the prefix cache nor vLLM's multimodal processor cache is on, so nothing is served from a
cache. Modes alternate over the rounds (raw, processed, raw, processed, ...) to cancel drift; each
round is closed-loop at ``--concurrency`` requests in flight.

Printed: per mode requests/s, output tokens/s, time to first token (mean, p50, p90; measured
client-side from submission to the arrival of the first output, so it includes the frontend's input
processing), end-to-end latency; the ratios processed/raw; the preprocessing time per request (the
work moved out of the engine's process: ``mmserve.serving.preprocess.Preprocessor``, what Triton's
``preprocess`` model runs), also on a sample with torch's default intra-op threads and with one,
alternating (which is faster depends on what else keeps the cores busy); and a check that both
modes give the same greedy tokens per request (exit status 1 if not).

Reproduce (about 2 minutes on 2 CPU cores, after ``.venv/bin/python -m mmserve_dev.tiny_models``)::

    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python bench/passthrough_vs_raw.py

Scale up with e.g. ``--requests 64 --rounds 5 --concurrency 1 4 16 --images 2 --max-tokens 64``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import percentile_ms

ROOT = Path(__file__).resolve().parents[1]
MODES = ("raw", "processed")
QUESTIONS = ("Describe the picture and the sound.", "What do you see and hear?", "Summarize the media.")


@dataclass
class Request:
    seed: int
    raw: dict[str, Any]
    processed: dict[str, Any]
    prompt_tokens: int
    preprocess_s: float


@dataclass
class Outcome:
    ttft_s: float
    e2e_s: float
    token_ids: list[int] = field(default_factory=list)


@dataclass
class RoundResult:
    mode: str
    concurrency: int
    round: int
    wall_s: float
    outcomes: list[Outcome]


def build_workload(preprocessor, seeds: list[int], args) -> list[Request]:
    """Requests with their own media; the processed form is made here, outside any timed region."""
    from mmserve.inputs import processed_prompt
    from mmserve_dev.samples import AUDIO_SAMPLE_RATE, encode_image, sample_audio, sample_image

    width, height = args.image_size
    requests = []
    for seed in seeds:
        images = [sample_image(seed * 17 + k, size=(width, height)) for k in range(args.images)]
        audios = [
            sample_audio(
                seed * 17 + k,
                seconds=args.audio_seconds[0] + (seed + k) % (args.audio_seconds[1] - args.audio_seconds[0] + 1),
            )
            for k in range(args.audios)
        ]
        text = QUESTIONS[seed % len(QUESTIONS)]
        raw: dict[str, Any] = {"prompt": preprocessor.chat_prompt(text, len(images), len(audios))}
        mm: dict[str, Any] = {}
        if images:
            mm["image"] = images
        if audios:
            mm["audio"] = [(a, AUDIO_SAMPLE_RATE) for a in audios]
        if mm:
            raw["multi_modal_data"] = mm
        # What Triton's preprocess model runs on a request: images arrive as encoded files (PNG is
        # lossless, so the pixels are the raw mode's), audio as float PCM (exactly the raw waveform).
        encoded = [encode_image(image) for image in images]
        start = time.perf_counter()
        tensors = preprocessor(text, images=encoded, pcm=[(a, AUDIO_SAMPLE_RATE) for a in audios])
        elapsed = time.perf_counter() - start
        processed = processed_prompt(preprocessor.family, tensors["input_ids"], preprocessor.decode_wire(tensors))
        requests.append(Request(seed, raw, processed, len(processed["prompt_token_ids"]), elapsed))
    return requests


async def run_round(
    runner, prompts: list[dict[str, Any]], concurrency: int, max_tokens: int, tag: str
) -> tuple[float, list[Outcome]]:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    slots = asyncio.Semaphore(concurrency)
    outcomes: list[Outcome | None] = [None] * len(prompts)

    async def one(index: int, prompt: dict[str, Any]) -> None:
        async with slots:
            start = time.perf_counter()
            first = None
            ids: list[int] = []
            async for output in runner.stream(prompt, params, runner.new_request_id(tag)):
                if first is None and output.outputs[0].token_ids:
                    first = time.perf_counter()
                ids += output.outputs[0].token_ids
            end = time.perf_counter()
            outcomes[index] = Outcome(first - start if first else end - start, end - start, ids)

    start = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return time.perf_counter() - start, outcomes  # type: ignore[return-value]


def summarize(results: list[RoundResult]) -> dict[str, float]:
    outcomes = [o for r in results for o in r.outcomes]
    wall = sum(r.wall_s for r in results)
    ttft = [o.ttft_s for o in outcomes]
    return {
        "req_s": len(outcomes) / wall,
        "tok_s": sum(len(o.token_ids) for o in outcomes) / wall,
        "ttft_mean": statistics.fmean(ttft),
        "ttft_p50": percentile_ms(ttft, 50) / 1e3,
        "ttft_p90": percentile_ms(ttft, 90) / 1e3,
        "e2e_mean": statistics.fmean(o.e2e_s for o in outcomes),
    }


def print_table(stats: dict[str, dict[str, float]]) -> None:
    rows = [
        ("requests/s", "req_s", 1.0, "{:.2f}"),
        ("output tokens/s", "tok_s", 1.0, "{:.1f}"),
        ("TTFT mean (ms)", "ttft_mean", 1e3, "{:.0f}"),
        ("TTFT p50 (ms)", "ttft_p50", 1e3, "{:.0f}"),
        ("TTFT p90 (ms)", "ttft_p90", 1e3, "{:.0f}"),
        ("end-to-end mean (ms)", "e2e_mean", 1e3, "{:.0f}"),
    ]
    print(f"| {'metric':<22} | {'raw':>9} | {'processed':>9} | {'processed/raw':>13} |")
    print(f"|{'-' * 24}|{'-' * 10}:|{'-' * 10}:|{'-' * 14}:|")
    for label, key, scale, fmt in rows:
        raw, proc = stats["raw"][key], stats["processed"][key]
        print(f"| {label:<22} | {fmt.format(raw * scale):>9} | {fmt.format(proc * scale):>9} | {proc / raw:>12.2f}x |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "qwen2_5_omni"))
    parser.add_argument("--requests", type=int, default=32, help="requests per round and mode")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per concurrency; each runs raw then processed")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="requests in flight (levels)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (ignore_eos)")
    parser.add_argument("--images", type=int, default=1, help="images per request")
    parser.add_argument("--audios", type=int, default=1, help="audio clips per request")
    parser.add_argument("--image-size", type=int, nargs=2, default=(400, 300), metavar=("W", "H"))
    parser.add_argument("--audio-seconds", type=int, nargs=2, default=(3, 5), metavar=("MIN", "MAX"))
    parser.add_argument("--warmup", type=int, default=4, help="untimed requests per mode first")
    parser.add_argument(
        "--thread-sample",
        type=int,
        default=16,
        help="also time the preprocessing of this many requests with torch's default "
        "threads and with 1, alternating (0: off)",
    )
    args = parser.parse_args(argv)
    if args.images > 4 or args.audios > 2:
        parser.error("limit_mm_per_prompt is image 4, audio 2")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import torch

    from mmserve.engine import EngineRunner
    from mmserve.serving.preprocess import Preprocessor

    print(
        f"# passthrough_vs_raw: {platform.node()}, {os.cpu_count()} CPUs (torch threads "
        f"{torch.get_num_threads()}), {time.strftime('%Y-%m-%d %H:%M')}; model {args.model}",
        flush=True,
    )
    print(
        f"# {args.requests} requests x {args.rounds} rounds per mode and concurrency "
        f"{args.concurrency}; {args.images} image(s) {args.image_size[0]}x{args.image_size[1]} + "
        f"{args.audios} clip(s) {args.audio_seconds[0]}-{args.audio_seconds[1]} s; "
        f"{args.max_tokens} output tokens",
        flush=True,
    )

    preprocessor = Preprocessor(args.model)
    t0 = time.perf_counter()
    warmup = build_workload(preprocessor, [900_000 + i for i in range(args.warmup)], args)
    plan = [(c, r) for c in args.concurrency for r in range(args.rounds)]
    workloads = {
        key: build_workload(preprocessor, [10_000 * (n + 1) + i for i in range(args.requests)], args)
        for n, key in enumerate(plan)
    }
    everything = [q for w in workloads.values() for q in w]
    threads = torch.get_num_threads()
    by_threads: dict[int, list[float]] = {threads: [], 1: []}
    if threads > 1 and args.thread_sample:
        # The same preprocessing with torch's default intra-op threads and with one, alternating
        # request by request on the same media (outputs discarded).
        for q in everything[: args.thread_sample]:
            for n in (threads, 1):
                torch.set_num_threads(n)
                by_threads[n] += [r.preprocess_s for r in build_workload(preprocessor, [q.seed], args)]
        torch.set_num_threads(threads)
    print(
        f"# workload built in {time.perf_counter() - t0:.1f} s (prompt tokens "
        f"{min(q.prompt_tokens for q in everything)}-{max(q.prompt_tokens for q in everything)})",
        flush=True,
    )

    t0 = time.perf_counter()
    runner = EngineRunner(
        args.model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        max_num_seqs=16,
        limit_mm_per_prompt={"image": 4, "audio": 2},
        enable_prefix_caching=False,
        mm_processor_cache_gb=0,
        seed=0,
    )
    print(f"# engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    results: list[RoundResult] = []
    try:
        for mode in MODES:  # warm-up, untimed (media of their own)
            runner.submit(
                run_round(
                    runner, [getattr(q, mode) for q in warmup], max(args.concurrency), args.max_tokens, f"warm-{mode}"
                )
            ).result()
        for (concurrency, r), workload in workloads.items():
            for mode in MODES:
                wall, outcomes = runner.submit(
                    run_round(
                        runner,
                        [getattr(q, mode) for q in workload],
                        concurrency,
                        args.max_tokens,
                        f"{mode}-c{concurrency}-{r}",
                    )
                ).result()
                results.append(RoundResult(mode, concurrency, r, wall, outcomes))
                print(
                    f"  concurrency {concurrency} round {r} {mode:<9} {wall:6.2f} s {len(outcomes) / wall:6.2f} req/s",
                    flush=True,
                )
    finally:
        runner.shutdown()

    # Same greedy tokens per request in both modes?
    mismatches = []
    for key, workload in workloads.items():
        by_mode = {res.mode: res.outcomes for res in results if (res.concurrency, res.round) == key}
        for i, request in enumerate(workload):
            if by_mode["raw"][i].token_ids != by_mode["processed"][i].token_ids:
                mismatches.append(request.seed)

    for concurrency in args.concurrency:
        stats = {
            mode: summarize([res for res in results if res.mode == mode and res.concurrency == concurrency])
            for mode in MODES
        }
        print(f"\nconcurrency {concurrency} ({args.requests * args.rounds} requests per mode):")
        print_table(stats)

    pre = [q.preprocess_s for q in everything]
    print()
    print(
        "preprocessing moved out of the engine's process (mmserve Preprocessor = Triton's preprocess "
        "model: PNG decode + HF processor; measured in this process before the engine started):"
    )
    print(
        f"  all {len(pre)} requests (torch threads {threads}): mean {statistics.fmean(pre) * 1e3:.0f} ms, "
        f"p50 {percentile_ms(pre, 50):.0f} ms, p90 {percentile_ms(pre, 90):.0f} ms per request"
    )
    if by_threads[1]:
        default, one = by_threads[threads], by_threads[1]
        for n, times in ((threads, default), (1, one)):
            print(
                f"  sample of {len(times)}, torch threads {n}: mean {statistics.fmean(times) * 1e3:.0f} ms, "
                f"p50 {percentile_ms(times, 50):.0f} ms, p90 {percentile_ms(times, 90):.0f} ms"
            )
        print(
            f"  (threads {threads} and 1 alternate request by request on the same media; "
            f"mean ratio threads {threads}/1: {statistics.fmean(default) / statistics.fmean(one):.2f}x)"
        )
    if mismatches:
        print(
            f"check: FAILED, {len(mismatches)}/{len(everything)} requests differ between raw and processed "
            f"(seeds {mismatches[:10]})"
        )
        return 1
    print(f"check: OK, raw and processed give identical greedy tokens for all {len(everything)} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())

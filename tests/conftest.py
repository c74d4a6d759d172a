"""Shared fixtures: the tiny checkpoints (built once), test media, request builders.

Engines are module-scoped in the modules that need them (one engine alive at a time: pytest
finalizes a module's fixtures before the next module starts), sized small for 2 cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
# Small CPU KV cache (GiB) for every engine the tests start, unless the caller chose one.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# Engine settings every engine test shares: exact float32 numerics (parity with HF), eager mode
# (no compile time on 2 cores), a fixed seed, prefix caching on.
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 2048,
    "max_num_seqs": 16,
    "enforce_eager": True,
    "seed": 0,
    "limit_mm_per_prompt": {"image": 3, "audio": 2},
    "enable_prefix_caching": True,
}
MAX_TOKENS = 12


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    from mmserve_dev.tiny_models import build_all

    return build_all(Path(os.environ.get("MMSERVE_MODELS_DIR", ROOT / "models")))


@dataclass
class Request:
    """One test request in both forms: raw media and the HF processor's output."""

    name: str
    text: str
    images: list[Any] = field(default_factory=list)
    audios: list[np.ndarray] = field(default_factory=list)
    hf_inputs: Any = None

    def raw_prompt(self) -> dict[str, Any]:
        mm: dict[str, Any] = {}
        if self.images:
            mm["image"] = self.images
        if self.audios:
            mm["audio"] = [(a, 16_000) for a in self.audios]
        prompt: dict[str, Any] = {"prompt": self.text}
        if mm:
            prompt["multi_modal_data"] = mm
        return prompt


def make_request(reference, name: str, parts: list[str], *, seed: int = 0, question: str = "Describe it.") -> Request:
    """Parts like ["image", "audio", "image"], in prompt order; media seeded from ``seed``."""
    from mmserve_dev.hf_reference import chat_prompt
    from mmserve_dev.samples import sample_audio, sample_image

    images = [sample_image(seed + 10 * i, size=(112 + 28 * (i % 2), 84)) for i, p in enumerate(parts) if p == "image"]
    audios = [sample_audio(seed + 10 * i, seconds=1.0 + 0.5 * (i % 2)) for i, p in enumerate(parts) if p == "audio"]
    text = chat_prompt(reference.family, reference.processor, [*parts, f"text:{question}"])
    request = Request(name, text, images, audios)
    request.hf_inputs = reference.processor_inputs(text, images, audios)
    return request


# The Omni workload shared by the parity, concurrency and chunked-prefill tests: every case the issue
# names, then more requests with other media (seeds), each with its HF transformers reference.
OMNI_CASES: dict[str, list[str]] = {
    "text_only": [],
    "image_only": ["image"],
    "audio_only": ["audio"],
    "image_audio": ["image", "audio"],
    "interleaved": ["image", "audio", "image"],
    "two_images": ["image", "image"],
}


@pytest.fixture(scope="session")
def omni_reference(tiny_models):
    from mmserve_dev.hf_reference import HFReference

    return HFReference("qwen2_5_omni", tiny_models["qwen2_5_omni"])


@pytest.fixture(scope="session")
def omni_workload(omni_reference) -> list[tuple[Request, list[int]]]:
    """18 requests (3 rounds of the 6 cases, different media per round) with HF greedy tokens."""
    workload = []
    for round_ in range(3):
        for name, parts in OMNI_CASES.items():
            request = make_request(omni_reference, f"{name}#{round_}", parts, seed=100 * round_,
                                   question=["Describe it.", "What is this?", "Tell me more."][round_])
            tokens = omni_reference.generate(request.text, request.images, request.audios,
                                             max_new_tokens=MAX_TOKENS)
            workload.append((request, tokens))
    return workload


def greedy(max_tokens: int = MAX_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def processed(family_name: str, request: Request) -> dict[str, Any]:
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt

    return processed_prompt(get_family(family_name), request.hf_inputs["input_ids"], request.hf_inputs)


async def run_concurrently(engine, prompts: list[dict[str, Any]], *, stagger_s: float) -> list[list[int]]:
    """Submit ``prompts`` with staggered arrivals (later ones prefill while earlier ones decode)."""
    import asyncio

    async def one(index: int, prompt: dict[str, Any]) -> list[int]:
        await asyncio.sleep(index * stagger_s)
        output = await engine.generate(prompt, greedy())
        return list(output.outputs[0].token_ids)

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


# -- the live server (tests/live.py) ------------------------------------------------------------------
def pytest_collection_modifyitems(config, items):
    """Server tests run last, so that the session's one server (and its engine) never overlaps the
    engines other modules start; among them, those that break the engine (``fault``) run at the end."""
    items.sort(key=lambda item: (item.get_closest_marker("server") is not None,
                                 item.get_closest_marker("fault") is not None))


@pytest.fixture(scope="session")
def references(tiny_models):
    """Offline vLLM's greedy outputs of the e2e workload (before the server starts its engine)."""
    import live
    from mmserve.serving.llm import LLMConfig

    engine_args = dict(LLMConfig.from_file(ROOT / "model_repository" / "mm_llm" / "model.json").engine_args)
    engine_args.pop("model")
    return live.compute_references(str(tiny_models["qwen2_5_omni"]), engine_args)


@pytest.fixture(scope="session")
def server(references, tiny_models):
    """The model repository on a real tritonserver, or an external one: set ``MMSERVE_TRITON_GRPC_URL``
    (and ``MMSERVE_TRITON_HTTP_URL``, ``MMSERVE_TRITON_METRICS_URL``), e.g. ``127.0.0.1:8001``."""
    import live

    grpc = os.environ.get("MMSERVE_TRITON_GRPC_URL")
    if grpc:
        metrics = os.environ.get("MMSERVE_TRITON_METRICS_URL")
        yield live.Endpoints(grpc, os.environ.get("MMSERVE_TRITON_HTTP_URL"),
                             f"http://{metrics}/metrics" if metrics else None)
        return
    from mmserve_dev.triton import TritonServer

    env = {"MMSERVE_MODEL": str(tiny_models["qwen2_5_omni"]),
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with TritonServer(ROOT / "model_repository", env=env, shm_default_byte_size=32 * 1024 * 1024,
                      keep_loaded=("mm_llm", "mm_ensemble")) as triton:
        yield live.Endpoints(triton.grpc_url, triton.http_url, triton.metrics_url, server=triton)

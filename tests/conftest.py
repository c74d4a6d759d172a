"""Shared fixtures: the tiny checkpoints (built once), the Omni workload, the live server and its
references. Helpers that tests import are in utils.py.

Engines are module-scoped in the modules that need them (one engine alive at a time: pytest
finalizes a module's fixtures before the next module starts), sized small for 2 cores.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mmserve import settings

from utils import MAX_TOKENS, OMNI_CASES, ROOT, Endpoints, Request, compute_references, make_request

# Small CPU KV cache (GiB) for every engine the tests start, unless the caller chose one.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    from mmserve_dev.tiny_models import build_all

    return build_all(Path(settings.MODELS_DIR.get(str(ROOT / "models"))))


@pytest.fixture(scope="session")
def omni_reference(tiny_models):
    from mmserve_dev.hf_reference import HFReference

    return HFReference("qwen2_5_omni", tiny_models["qwen2_5_omni"])


@pytest.fixture(scope="session")
def omni_encoder(tiny_models):
    """The Omni checkpoint's towers alone (``mmserve.encoder``), no cache: every call encodes."""
    from mmserve.encoder import Encoder, Towers

    return Encoder(Towers(tiny_models["qwen2_5_omni"]), cache_bytes=0)


@pytest.fixture(scope="session")
def omni_workload(omni_reference) -> list[tuple[Request, list[int]]]:
    """18 requests (3 rounds of utils.OMNI_CASES, different media per round) with HF greedy tokens."""
    workload = []
    for round_ in range(3):
        for name, parts in OMNI_CASES.items():
            request = make_request(
                omni_reference,
                f"{name}#{round_}",
                parts,
                seed=100 * round_,
                question=["Describe it.", "What is this?", "Tell me more."][round_],
            )
            tokens = omni_reference.generate(request.text, request.images, request.audios, max_new_tokens=MAX_TOKENS)
            workload.append((request, tokens))
    return workload


# -- the test process's scheduling policy ---------------------------------------------------------------
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After every test: the process still runs under the normal policy (SCHED_OTHER), else the test
    is named in a warning and the policy restored. One CI run found this process SCHED_FIFO 99 after
    some test: every process it started from then on inherited it (an engine core, then dockerd and
    docker-untar, which spun at real-time priority and never ended the image build)."""
    yield
    if os.sched_getscheduler(0) != os.SCHED_OTHER:
        import warnings

        policy, priority = os.sched_getscheduler(0), os.sched_getparam(0).sched_priority
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        warnings.warn(
            f"{item.nodeid} left this process under scheduling policy {policy} (priority {priority}): restored",
            stacklevel=1,
        )
        print(f"\n[conftest] {item.nodeid} left the scheduling policy {policy}/{priority}; restored", flush=True)


# -- the live server (its helpers: utils.py) --------------------------------------------------------
def pytest_collection_modifyitems(config, items):
    """Server tests run last, so that the session's one server (and its engine) never overlaps the
    engines other modules start: first those with a server of their own (``own_server``), which
    stop it before the shared one starts; those that break the engine (``fault``) at the end."""
    items.sort(
        key=lambda item: (
            item.get_closest_marker("server") is not None,
            item.get_closest_marker("own_server") is None,  # their own server first, then the shared one
            item.get_closest_marker("fault") is not None,
        )
    )


@pytest.fixture(scope="session")
def references(tiny_models):
    """Offline vLLM's greedy outputs of the e2e workload (before the server starts its engine)."""
    from mmserve.serving.llm import LLMConfig

    engine_args = dict(LLMConfig.from_file(ROOT / "model_repository" / "mm_llm" / "model.json").engine_args)
    engine_args.pop("model")
    return compute_references(str(tiny_models["qwen2_5_omni"]), engine_args)


@pytest.fixture(scope="session")
def server(references, tiny_models):
    """The model repository on a real tritonserver, or an external one: set ``MMSERVE_TRITON_GRPC_URL``
    (and ``MMSERVE_TRITON_HTTP_URL``, ``MMSERVE_TRITON_METRICS_URL``), e.g. ``127.0.0.1:8001``."""
    grpc = settings.TRITON_GRPC_URL.get()
    if grpc:
        metrics = settings.TRITON_METRICS_URL.get()
        yield Endpoints(grpc, settings.TRITON_HTTP_URL.get(), f"http://{metrics}/metrics" if metrics else None)
        return
    from mmserve_dev.triton import TritonServer

    env = {
        settings.MODEL.name: str(tiny_models["qwen2_5_omni"]),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }
    with TritonServer(
        ROOT / "model_repository",
        env=env,
        shm_default_byte_size=32 * 1024 * 1024,
        keep_loaded=("mm_llm", "mm_ensemble"),
        drain="mm_llm",
    ) as triton:
        yield Endpoints(triton.grpc_url, triton.http_url, triton.metrics_url, server=triton)

"""Tensor parallelism from ``model.json``: the processed path with 2 worker processes on the CPU.

One engine with ``tensor_parallel_size=2`` (``distributed_executor_backend="mp"``), configured the way
``mm_llm`` configures it (a ``model.json`` read by ``LLMConfig``, started by ``LLMService.start``), fed
the tensors ``preprocess`` produces (``Preprocessor`` -> ``parse_request``). Its greedy tokens must equal

* 1 worker: offline vLLM on the e2e workload (the session's ``references``, which the live-server
  tests compare the server against), and
* HF transformers: the Omni workload's references (the session's ``omni_workload``),

for image, audio and image+audio requests. Both references are session fixtures computed before this
module's engine starts, so one engine runs at a time. vLLM's CPU platform binds each rank's OpenMP
threads to the CPU list ``VLLM_CPU_OMP_THREADS_BIND`` gives it (``|`` between ranks; the engine core
process reads it when it creates the workers), set here for this module only.
"""

from __future__ import annotations

import json
import os

import pytest

from utils import ROOT, greedy, processed, run_concurrently

pytestmark = pytest.mark.engine

PARALLEL_ARGS = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
E2E_CASES = ("image", "audio", "image_audio")  # utils.CASES names (4 rounds each)
OMNI_CASES = ("image_only", "audio_only", "image_audio")  # utils.OMNI_CASES names (3 rounds each)


def cpu_binding(ranks: int = 2) -> str:
    """One CPU per rank among those this process may use (shared round-robin when there are fewer)."""
    cpus = sorted(os.sched_getaffinity(0))
    return "|".join(str(cpus[rank % len(cpus)]) for rank in range(ranks))


@pytest.fixture(scope="module")
def tp_config(tmp_path_factory, tiny_models):
    """model_repository's model.json plus the parallel arguments (and a small batch), as mm_llm reads it."""
    from mmserve.serving.llm import LLMConfig

    args = json.loads((ROOT / "model_repository" / "mm_llm" / "model.json").read_text())
    args.update(PARALLEL_ARGS, model=str(tiny_models["qwen2_5_omni"]), max_num_seqs=4)
    path = tmp_path_factory.mktemp("tensor_parallel") / "model.json"
    path.write_text(json.dumps(args))
    return LLMConfig.from_file(path)


@pytest.fixture(scope="module")
def service(tp_config, references, omni_workload):
    """mm_llm's service on a TP=2 engine. The references are requested first: they are computed (and
    their engine stopped) before this engine starts."""
    from mmserve.serving.llm import LLMService

    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(2))
        # Lets the test send a function to the workers (collective_rpc) to look inside them.
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        service = LLMService.start(tp_config)
        try:
            yield service
        finally:
            service.shutdown()


@pytest.fixture(scope="module")
def preprocessor(tiny_models):
    from mmserve.serving.preprocess import Preprocessor

    return Preprocessor(tiny_models["qwen2_5_omni"])


def served_prompt(service, preprocessor, case) -> dict:
    """What mm_llm hands the engine for a raw request: preprocess's tensors read by parse_request."""
    from mmserve.serving.llm import parse_request

    tensors = preprocessor(case.text, case.images, case.audios)
    return parse_request(
        service.family, tensors.get, vocab_size=service.vocab_size, wire_decoders=service.wire_decoders
    ).prompt


def test_model_json_parallel_arguments_reach_vllm(tp_config, service):
    assert {k: tp_config.engine_args[k] for k in PARALLEL_ARGS} == PARALLEL_ARGS
    parallel = service.runner.engine.vllm_config.parallel_config
    assert (parallel.tensor_parallel_size, parallel.world_size) == (2, 2)
    assert parallel.distributed_executor_backend == "mp"


def test_plugin_registered_in_every_worker(service):
    """Each rank is a process of its own (spawned: vLLM's CPU platform sets
    VLLM_WORKER_MULTIPROC_METHOD=spawn, so nothing of the parent's model registry is inherited); in
    each, vLLM's plugin loader ran mmserve's entry point and the model it loaded is the pass-through
    class the registration names."""
    import psutil

    def facts(worker):  # runs in each worker process (sent by value with cloudpickle)
        import os
        import sys

        import vllm.plugins
        from vllm import ModelRegistry

        model = worker.model_runner.get_model()
        return {
            "pid": os.getpid(),
            "rank": worker.rank,
            "start_method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"),
            "plugins_loaded": vllm.plugins.plugins_loaded,
            "plugin_imported": "mmserve.passthrough.models" in sys.modules,
            "registered": "MMServePassthroughQwen2_5OmniThinker" in ModelRegistry.get_supported_archs(),
            "model_class": f"{type(model).__module__}.{type(model).__name__}",
        }

    runner = service.runner
    workers = runner.submit(runner.engine.collective_rpc(facts)).result(120)
    assert sorted(w["rank"] for w in workers) == [0, 1]
    core_children = {p.pid for pid in runner.core_pids() for p in psutil.Process(pid).children(recursive=True)}
    pids = {w["pid"] for w in workers}
    assert len(pids) == 2 and pids <= core_children and os.getpid() not in pids
    for worker in workers:
        assert worker["start_method"] == "spawn"
        assert worker["plugins_loaded"] and worker["plugin_imported"] and worker["registered"], worker
        assert worker["model_class"] == "mmserve.passthrough.models.MMServePassthroughQwen2_5OmniThinker", worker


def test_tokens_equal_one_worker(service, preprocessor, references):
    """The e2e workload's image, audio and image+audio requests through preprocess, concurrently."""
    names = [name for name in references if name.split("#")[0] in E2E_CASES]
    prompts = [served_prompt(service, preprocessor, references[n]) for n in names]
    outputs = service.runner.submit(run_concurrently(service.runner, prompts, stagger_s=0.03)).result(600)
    assert len(names) == 12
    mismatches = {
        n: (out, references[n].ids) for n, out in zip(names, outputs, strict=True) if out != references[n].ids
    }
    assert not mismatches, f"TP=2 != 1 worker: {mismatches}"


def test_tokens_equal_hf(service, omni_workload):
    """The Omni workload's image, audio and image+audio requests (the HF processor's own output)."""
    cases = [(request, tokens) for request, tokens in omni_workload if request.name.split("#")[0] in OMNI_CASES]
    prompts = [processed("qwen2_5_omni", request) for request, _ in cases]
    outputs = service.runner.submit(run_concurrently(service.runner, prompts, stagger_s=0.03)).result(600)
    assert len(cases) == 9
    mismatches = {r.name: (out, ref) for (r, ref), out in zip(cases, outputs, strict=True) if out != ref}
    assert not mismatches, f"TP=2 != HF: {mismatches}"


def test_single_request_equals_hf(service, omni_workload):
    """One request alone (no batch): image+audio."""
    request, reference = next((r, t) for r, t in omni_workload if r.name == "image_audio#0")
    output = service.runner.generate_sync(processed("qwen2_5_omni", request), greedy(), timeout=300)
    assert list(output.outputs[0].token_ids) == reference

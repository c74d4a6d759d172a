"""The Omni workload again, on an engine whose chunked prefill splits every multimodal prompt."""

from __future__ import annotations

import pytest

from utils import ENGINE_ARGS, processed, run_concurrently

pytestmark = pytest.mark.engine

CHUNK = 16  # tokens per engine step: well under any multimodal prompt of the workload


@pytest.fixture(scope="module")
def chunked_engine(tiny_models):
    from mmserve.engine import EngineRunner

    args = {
        **ENGINE_ARGS,
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": CHUNK,
        "enable_prefix_caching": True,
    }
    with EngineRunner(str(tiny_models["qwen2_5_omni"]), **args) as runner:
        yield runner


def test_chunked_prefill_concurrent_matches_reference(chunked_engine, omni_workload):
    prompts = [processed("qwen2_5_omni", r) if i % 2 == 0 else r.raw_prompt() for i, (r, _) in enumerate(omni_workload)]
    multimodal = [p for p in prompts if "multi_modal_data" in p and "prompt_token_ids" in p]
    assert multimodal and all(len(p["prompt_token_ids"]) > 2 * CHUNK for p in multimodal)
    outputs = chunked_engine.submit(run_concurrently(chunked_engine, prompts, stagger_s=0.03)).result()
    mismatches = [r.name for (r, ref), out in zip(omni_workload, outputs, strict=True) if out != ref]
    assert not mismatches, f"differ from their single-request reference: {mismatches}"

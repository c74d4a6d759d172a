"""Dummy inputs for memory profiling at the configured limits (no engine: the processor alone)."""

from __future__ import annotations

import pytest

from mmserve.families.qwen import whisper_output_length


@pytest.mark.parametrize("limits", [{"image": 3, "audio": 2}, {"image": 1, "audio": 0}])
def test_dummy_inputs_fill_the_limits_with_the_largest_items(tiny_models, limits):
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    from mmserve.inputs import engine_kwargs
    from mmserve.passthrough import register
    from mmserve_dev.hf_reference import load_processor

    register()
    model = tiny_models["qwen2_5_omni"]
    config = ModelConfig(**engine_kwargs(model, limit_mm_per_prompt=limits, max_model_len=4096, dtype="float32"))
    processor = MULTIMODAL_REGISTRY.create_processor(config)
    assert type(processor).__name__ == "MMServePassthroughQwen2_5OmniThinkerProcessor"

    dummy = processor.get_dummy_mm_inputs({m: n for m, n in limits.items() if n})
    placeholders = dummy["mm_placeholders"]
    hf = load_processor(model)
    image = hf.image_processor  # size["longest_edge"] is its max_pixels
    image_tokens = image.size["longest_edge"] // (image.patch_size * image.merge_size) ** 2
    audio_tokens = whisper_output_length(hf.feature_extractor.nb_max_frames)
    assert [r.length for r in placeholders.get("image", [])] == [image_tokens] * limits["image"]
    assert [r.length for r in placeholders.get("audio", [])] == [audio_tokens] * limits["audio"]

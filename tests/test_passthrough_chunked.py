"""The Omni workload again, on an engine whose chunked prefill splits every multimodal prompt."""

from __future__ import annotations

import pytest

from utils import ENGINE_ARGS, processed, raw_video, run_concurrently

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


def test_videos_under_chunked_prefill_and_prefix_caching_match_hf(chunked_engine, omni_reference, tiny_models):
    """Omni videos through the chunked engine, all in flight together: different videos of the
    same length, one of them twice (its second prefill hits the prefix cache), processed (the
    pass-through) and raw (vLLM's own processing of the frames, the same engine) = HF transformers
    on the frames, each alone. The videos travel as lossless files (``preprocess`` decodes them)."""
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt
    from mmserve.serving.preprocess import Preprocessor
    from mmserve_dev.hf_reference import chat_prompt
    from mmserve_dev.samples import encode_video, sample_video

    from utils import hf_video_tokens

    family = get_family("qwen2_5_omni")
    videos = [sample_video(31 + i, frames=6) for i in range(3)]
    text = chat_prompt("qwen2_5_omni", omni_reference.processor, ["video", "text:What happens?"])
    expected = [hf_video_tokens(omni_reference, text, [video]) for video in videos]

    preprocessor = Preprocessor(tiny_models["qwen2_5_omni"])

    def processed_video(video):
        tensors = preprocessor.decode_wire(preprocessor("What happens?", videos=[encode_video(video)]))
        return processed_prompt(family, tensors["input_ids"], tensors)

    def raw_prompt(video):
        return {"prompt": text, "multi_modal_data": {"video": [raw_video(video)]}}

    prompts = [processed_video(v) for v in videos] + [processed_video(videos[0]), raw_prompt(videos[1])]
    assert all(len(p["prompt_token_ids"]) > 2 * CHUNK for p in prompts[:3])
    outputs = chunked_engine.submit(run_concurrently(chunked_engine, prompts, stagger_s=0.03)).result()
    assert outputs == [*expected, expected[0], expected[1]]


def test_a_video_with_its_audio_under_chunked_prefill_matches_hf(chunked_engine, omni_reference, tiny_models):
    """A video with its audio track (``use_audio_in_video``), its interleaved span cut into 16-token
    steps, twice at once (the second a prefix-cache hit), processed and raw = HF transformers. At 6
    fps, 14 frames span two of the model's 2-second chunks within this engine's encoder budget."""
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt
    from mmserve.serving.preprocess import Preprocessor
    from mmserve_dev.hf_reference import chat_prompt
    from mmserve_dev.samples import AUDIO_SAMPLE_RATE, VIDEO_FPS, encode_video, sample_audio, sample_video

    from utils import hf_video_with_audio_tokens

    fps = VIDEO_FPS // 2
    frames = sample_video(61, frames=14)
    audio = sample_audio(62, seconds=len(frames) / fps)
    expected = hf_video_with_audio_tokens(omni_reference, frames, audio, fps=fps)
    preprocessor = Preprocessor(tiny_models["qwen2_5_omni"])
    tensors = preprocessor.decode_wire(
        preprocessor("What happens?", videos=[encode_video(frames, fps, audio=audio)], use_audio_in_video=True)
    )
    processed_one = processed_prompt(get_family("qwen2_5_omni"), tensors["input_ids"], tensors)
    ids = processed_one["prompt_token_ids"]
    audio_id, video_id = omni_reference.model.config.audio_token_index, omni_reference.model.config.video_token_index
    last_video = len(ids) - 1 - ids[::-1].index(video_id)
    assert ids.index(audio_id) < last_video  # two chunks: video, audio, video, audio
    raw = {
        "prompt": chat_prompt("qwen2_5_omni", omni_reference.processor, ["video", "text:What happens?"]),
        "multi_modal_data": {"video": [raw_video(frames, fps)], "audio": [(audio, AUDIO_SAMPLE_RATE)]},
        "mm_processor_kwargs": {"use_audio_in_video": True},
    }
    outputs = chunked_engine.submit(
        run_concurrently(chunked_engine, [processed_one, processed_one, raw], stagger_s=0.03)
    ).result()
    assert outputs == [expected] * 3, outputs

"""The Qwen3-Omni thinker through the pass-through: its count rules (audio: 13 tokens per 100 mel frames)
against the HF processor's expansion, its layout of a video with its audio track (interleaved token by
token) against vLLM's own, bad layouts named, and greedy tokens of HF transformers = vLLM on the raw
media = vLLM on the processor's tensors = vLLM on ``preprocess``'s tensors of the files, per modality,
mixed, a video with its audio, under chunked prefill in small steps, prefix caching and concurrency."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mmserve_dev.samples import (
    AUDIO_SAMPLE_RATE,
    VIDEO_FPS,
    decode_audio,
    encode_audio,
    encode_image,
    encode_video,
    sample_audio,
    sample_image,
    sample_video,
)

from utils import ENGINE_ARGS, greedy, hf_greedy, hf_on_frames, hf_on_video_with_audio, raw_video, run_concurrently

FAMILY = "qwen3_omni"
CHUNK = 32  # tokens per engine step: every multimodal prompt below takes several
AIV_FRAMES = 10
"""Frames of the video with its audio: 5 temporal patches at 2 s each (the HF processor's default
``fps`` 1 for the time positions) against ~11 audio tokens: the audio's placeholders fall between the
first and second patches'."""


@pytest.fixture(scope="module")
def reference(tiny_models):
    from mmserve_dev.hf_reference import HFReference

    return HFReference(FAMILY, tiny_models[FAMILY])


@pytest.fixture(scope="module")
def preprocessor(tiny_models):
    from mmserve.serving.preprocess import Preprocessor

    return Preprocessor(tiny_models[FAMILY])


def prompt_text(reference, parts: list[str], question: str = "What happens?") -> str:
    from mmserve_dev.hf_reference import chat_prompt

    return chat_prompt(FAMILY, reference.processor, [*parts, f"text:{question}"])


def hf_inputs(reference, parts: list[str], images=(), audios=(), videos=()):
    """The HF processor on the media (videos: frames at VIDEO_FPS), as tensors for the model."""
    text = prompt_text(reference, parts)
    if not audios:
        return text, hf_on_frames(reference.processor, text, list(images), list(videos)).convert_to_tensors("pt")
    kwargs = {"text": [text], "audio": list(audios), "sampling_rate": AUDIO_SAMPLE_RATE, "return_tensors": "pt"}
    if images:
        kwargs["images"] = list(images)
    if videos:
        kwargs["videos"] = list(videos)
        kwargs["video_metadata"] = [
            {"total_num_frames": len(v), "fps": float(VIDEO_FPS), "width": v.shape[2], "height": v.shape[1]}
            for v in videos
        ]
    return text, reference.processor(**kwargs)


def audio_in_video(reference, seed: int):
    """A video with its audio track: the frames, the waveform, the prompt and the HF processor's
    tensors, with the model's ``use_audio_in_video`` (without it HF's model places the positions as
    for a video alone)."""
    frames = sample_video(seed, frames=AIV_FRAMES, size=(96, 64))
    audio = sample_audio(seed + 1, seconds=AIV_FRAMES / VIDEO_FPS)
    text = prompt_text(reference, ["video"])
    inputs = hf_on_video_with_audio(reference.processor, text, frames, audio)
    return frames, audio, text, {**inputs, "use_audio_in_video": True}


def tensors_of(inputs, *, with_audio: bool = False) -> dict:
    """The HF processor's outputs as ``mm_llm`` takes them (its video seconds under the wire's name)."""
    import torch

    data = {name: value for name, value in inputs.items() if name != "use_audio_in_video"}
    if "video_second_per_grid" in data:
        data["second_per_grid_ts"] = torch.as_tensor(data.pop("video_second_per_grid"), dtype=torch.float32)
    if with_audio:
        data["use_audio_in_video"] = torch.ones(len(data["video_grid_thw"]), dtype=torch.bool)
    return data


def as_sent(wave: np.ndarray) -> np.ndarray:
    """``wave`` as a WAV file of it holds it (16-bit samples): what ``preprocess`` decodes."""
    return decode_audio(encode_audio(wave))


def passthrough(inputs, *, with_audio: bool = False) -> dict:
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt

    return processed_prompt(get_family(FAMILY), inputs["input_ids"][0], tensors_of(inputs, with_audio=with_audio))


def items(modality: str, inputs, config, *, with_audio: bool = False):
    from mmserve.families import get_family
    from mmserve.inputs import processed_multi_modal_data
    from mmserve.passthrough.items import ProcessedItems

    family = get_family(FAMILY)
    spec = family.modality(modality)
    assert spec is not None
    data = processed_multi_modal_data(family, tensors_of(inputs, with_audio=with_audio))[modality]
    return spec, ProcessedItems(data, spec, config)


def test_counts_are_the_hf_processors(reference):
    """Clips of 0.05 to 30 s (whole and partial 100-frame windows), images and videos of several
    sizes: each item's run is the length its tensors imply, as the HF processor expands it."""
    from mmserve.passthrough.placeholders import placeholder_runs

    config = reference.model.config
    seconds = [0.05, 0.5, 0.99, 1.0, 1.01, 2.37, 5.0, 9.99, 17.3, 29.99]
    clips = [sample_audio(i, seconds=s) for i, s in enumerate(seconds)]
    _, inputs = hf_inputs(reference, ["audio"] * len(clips), audios=clips)
    _, audio = items("audio", inputs, config)
    runs = placeholder_runs(inputs["input_ids"][0].tolist(), config.audio_token_id)
    assert [n for _, n in runs] == audio.expected_tokens()
    assert audio.expected_tokens()[-1] == 13 * 29 + 13  # 2999 frames: 29 whole windows of 13, 99 frames 13 more

    sizes = [(32, 32), (112, 84), (333, 97), (512, 512), (40, 900)]
    images = [sample_image(i, size=size) for i, size in enumerate(sizes)]
    _, inputs = hf_inputs(reference, ["image"] * len(images), images=images)
    _, image = items("image", inputs, config)
    runs = placeholder_runs(inputs["input_ids"][0].tolist(), config.image_token_id)
    assert [n for _, n in runs] == image.expected_tokens()

    videos = [sample_video(7, frames=4, size=(64, 64)), sample_video(8, frames=9, size=(160, 96))]
    _, inputs = hf_inputs(reference, ["video", "video"], videos=videos)
    _, video = items("video", inputs, config)
    runs = placeholder_runs(inputs["input_ids"][0].tolist(), config.video_token_id)
    assert [n for _, n in runs] == video.expected_tokens()


def test_the_audio_in_video_layout_is_vllms_and_bad_ones_are_named(reference):
    """A video with its audio: one span from ``<|audio_start|>`` to ``<|audio_end|>`` whose tokens are
    the HF processor's and vLLM's own (``Qwen3OmniMoeThinkerMultiModalProcessor``), the video's and the
    audio's placeholders each marked; a swapped pair or a missing span is refused by name; without
    the flag the video is an ordinary one."""
    from mmserve.errors import ProcessedInputError
    from mmserve.families import get_family

    family, config = get_family(FAMILY), reference.model.config
    assert family.audio_in_video is not None
    _, _, _, inputs = audio_in_video(reference, 3)
    ids = inputs["input_ids"][0].tolist()
    _, videos = items("video", inputs, config, with_audio=True)
    _, audios = items("audio", inputs, config)
    placed = family.audio_in_video.placements(ids, videos, audios, config)
    [video], [sound] = placed["video"], placed["audio"]
    assert video.offset == sound.offset == ids.index(config.audio_start_token_id)
    span = ids[video.offset : video.offset + video.length]
    assert span[-1] == config.audio_end_token_id and ids[video.offset + video.length] == config.vision_end_token_id
    assert sum(video.is_embed) == videos.expected_tokens()[0] == ids.count(config.video_token_id)
    assert sum(sound.is_embed) == audios.expected_tokens()[0] == ids.count(config.audio_token_id)
    audio_at = [i for i, t in enumerate(span) if t == config.audio_token_id]
    video_at = [i for i, t in enumerate(span) if t == config.video_token_id]
    assert video_at[0] < audio_at[0] < audio_at[-1] < video_at[-1]  # interleaved

    swapped = list(ids)
    at = swapped.index(config.audio_token_id)
    swapped[at - 1], swapped[at] = swapped[at], swapped[at - 1]
    with pytest.raises(ProcessedInputError, match=r"video item 0, prompt_token_ids: expected \d+ tokens from audio"):
        family.audio_in_video.placements(swapped, videos, audios, config)
    with pytest.raises(ProcessedInputError, match=r"1 <\|vision_start\|><\|audio_start\|> span\(s\)"):
        family.audio_in_video.placements([1, 2, 3], videos, audios, config)
    _, plain = items("video", inputs, config)
    assert family.audio_in_video.placements(ids, plain, audios, config) is None


def test_preprocess_gives_what_the_hf_processor_makes_of_the_files(preprocessor, reference):
    """An image, an audio clip and a video file through ``preprocess``; then a video file with its
    audio track (``use_audio_in_video``): the ids and every tensor are the HF processor's on the
    frames and the waveform the files were made from."""
    image, audio, video = (
        sample_image(3, size=(112, 84)),
        as_sent(sample_audio(4, seconds=2.5)),
        sample_video(5, frames=6),
    )
    content = [{"type": "image"}, {"type": "audio"}, {"type": "video"}, {"type": "text", "text": "What happens?"}]
    got = preprocessor.decode_wire(
        preprocessor(
            None,
            [encode_image(image)],
            [encode_audio(audio)],
            messages=json.dumps([{"role": "user", "content": content}]),
            videos=[encode_video(video)],
        )
    )
    _, want = hf_inputs(reference, ["image", "audio", "video"], images=[image], audios=[audio], videos=[video])
    np.testing.assert_array_equal(got["input_ids"], want["input_ids"][0].numpy())
    for name in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        np.testing.assert_array_equal(got[name], want[name].numpy(), err_msg=name)
    heard = int(want["feature_attention_mask"].sum())
    assert int(got["feature_attention_mask"].sum()) == heard
    np.testing.assert_array_equal(got["input_features"][..., :heard], want["input_features"][..., :heard].numpy())
    np.testing.assert_allclose(got["second_per_grid_ts"], want["video_second_per_grid"].numpy())

    frames, track, _, want = audio_in_video(reference, 6)
    wire = preprocessor("What happens?", videos=[encode_video(frames, audio=track)], use_audio_in_video=True)
    got = preprocessor.decode_wire(wire)
    np.testing.assert_array_equal(got["input_ids"], want["input_ids"][0].numpy())
    np.testing.assert_array_equal(got["pixel_values_videos"], want["pixel_values_videos"].numpy())
    assert got["use_audio_in_video"].tolist() == [True]
    heard = int(want["feature_attention_mask"].sum())
    np.testing.assert_array_equal(got["input_features"][..., :heard], want["input_features"][..., :heard].numpy())


# -- on the engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_models):
    from mmserve.engine import EngineRunner

    args = {
        **ENGINE_ARGS,
        "limit_mm_per_prompt": {"image": 2, "audio": 2, "video": 1},
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": CHUNK,
        "enable_prefix_caching": True,
    }
    with EngineRunner(str(tiny_models[FAMILY]), **args) as runner:
        yield runner


CASES = {
    "image": (["image"], [(256, 192)], [], []),
    "audio": (["audio"], [], [3.3], []),
    "two_audios": (["audio", "audio"], [], [1.2, 4.5], []),
    "video": (["video"], [], [], [6]),
    "image_audio_video": (["image", "audio", "video"], [(96, 96)], [2.0], [4]),
}


def _raw(text: str, images, audios, videos, **kwargs) -> dict:
    data: dict = {}
    if images:
        data["image"] = list(images)
    if audios:
        data["audio"] = [(a, AUDIO_SAMPLE_RATE) for a in audios]
    if videos:
        data["video"] = [raw_video(v) for v in videos]
    return {"prompt": text, "multi_modal_data": data, **kwargs}


@pytest.mark.engine
def test_parity_with_hf(engine, reference):
    """HF transformers on the raw media = vLLM on them = vLLM on the HF processor's tensors and
    expanded ids, per case (a video with its audio among them), each prompt prefilled in steps of
    CHUNK tokens; then every pass-through prompt again, all at once (prefix cache hits, mixed prefill
    and decode)."""
    alone, prompts = {}, {}
    for name, (parts, sizes, seconds, lengths) in CASES.items():
        images = [sample_image(30 + i, size=size) for i, size in enumerate(sizes)]
        audios = [sample_audio(40 + i, seconds=s) for i, s in enumerate(seconds)]
        videos = [sample_video(50 + i, frames=n) for i, n in enumerate(lengths)]
        text, inputs = hf_inputs(reference, parts, images, audios, videos)
        raw = _raw(text, images, audios, videos)
        prompts[name] = passthrough(inputs)
        alone[name] = _compare(engine, reference, name, inputs, raw, prompts[name])

    frames, audio, text, inputs = audio_in_video(reference, 50)
    raw = _raw(text, [], [audio], [frames], mm_processor_kwargs={"use_audio_in_video": True})
    prompts["audio_in_video"] = passthrough(inputs, with_audio=True)
    alone["audio_in_video"] = _compare(engine, reference, "audio_in_video", inputs, raw, prompts["audio_in_video"])

    assert len({tuple(tokens) for tokens in alone.values()}) == len(alone)  # each media its own answer
    names = list(prompts)
    outputs = engine.submit(run_concurrently(engine, [prompts[n] for n in names], stagger_s=0.05)).result()
    assert dict(zip(names, outputs, strict=True)) == alone


def _compare(engine, reference, name: str, inputs, raw: dict, prompt: dict) -> list[int]:
    expected = hf_greedy(reference, inputs, 12).tokens
    got = engine.generate_sync(raw, greedy(12))
    assert list(got.prompt_token_ids) == inputs["input_ids"][0].tolist(), name
    assert list(got.outputs[0].token_ids) == expected, f"{name}: vLLM raw != HF"
    assert len(prompt["prompt_token_ids"]) > 2 * CHUNK
    tokens = list(engine.generate_sync(prompt, greedy(12)).outputs[0].token_ids)
    assert tokens == expected, f"{name}: vLLM on the processor's tensors != HF"
    return tokens


@pytest.mark.engine
def test_files_through_preprocess_match_hf_and_bad_layouts_leave_the_engine_serving(engine, reference, preprocessor):
    """An image, an audio clip and a video file through ``preprocess`` then the engine = HF on the
    decoded media; a video file with its audio track the same; two clips of the same length and
    different content, concurrently, each its own answer; a prompt whose audio-in-video span was
    reordered is refused by name and the next request answers as before."""
    from mmserve.errors import ProcessedInputError
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt

    family = get_family(FAMILY)
    image, video = sample_image(61, size=(112, 84)), sample_video(62, frames=6)
    content = [{"type": "image"}, {"type": "audio"}, {"type": "video"}, {"type": "text", "text": "What happens?"}]
    prompts, expected = [], []
    for seed in (63, 64):
        audio = as_sent(sample_audio(seed, seconds=2.5))
        wire = preprocessor(
            None,
            [encode_image(image)],
            [encode_audio(audio)],
            messages=json.dumps([{"role": "user", "content": content}]),
            videos=[encode_video(video)],
        )
        tensors = preprocessor.decode_wire(wire)
        prompts.append(processed_prompt(family, tensors["input_ids"], tensors))
        _, inputs = hf_inputs(reference, ["image", "audio", "video"], [image], [audio], [video])
        expected.append(hf_greedy(reference, inputs, 12).tokens)
    assert expected[0] != expected[1]
    alone = [list(engine.generate_sync(prompt, greedy(12)).outputs[0].token_ids) for prompt in prompts]
    assert alone == expected, "vLLM on preprocess's tensors != HF"
    assert engine.submit(run_concurrently(engine, prompts, stagger_s=0.0)).result() == alone

    frames, track, _, inputs = audio_in_video(reference, 64)
    wire = preprocessor("What happens?", videos=[encode_video(frames, audio=track)], use_audio_in_video=True)
    tensors = preprocessor.decode_wire(wire)
    with_audio = processed_prompt(family, tensors["input_ids"], tensors)
    want = hf_greedy(reference, inputs, 12).tokens
    assert list(engine.generate_sync(with_audio, greedy(12)).outputs[0].token_ids) == want

    ids = list(with_audio["prompt_token_ids"])
    at = ids.index(reference.model.config.audio_token_id)
    ids[at - 1], ids[at] = ids[at], ids[at - 1]
    with pytest.raises(ProcessedInputError, match=r"video item 0, prompt_token_ids: expected \d+ tokens from audio"):
        engine.generate_sync({**with_audio, "prompt_token_ids": ids}, greedy(12))
    assert list(engine.generate_sync(prompts[0], greedy(12)).outputs[0].token_ids) == alone[0]

    # A video's run right before an audio's (their markers dropped): vLLM's thinker places the token
    # after a run as its end marker, and this layout took the engine core down (the property test's find)
    config = reference.model.config
    _, inputs = hf_inputs(reference, ["video", "audio"], audios=[sample_audio(66, seconds=1.0)], videos=[video])
    ids = inputs["input_ids"][0].tolist()
    at = ids.index(config.audio_start_token_id)
    assert ids[at - 1] == config.vision_end_token_id
    joined = {**passthrough(inputs), "prompt_token_ids": ids[: at - 1] + ids[at + 1 :]}
    with pytest.raises(
        ProcessedInputError, match=r"(video|audio) item 0, prompt_token_ids: expected its run of .* between"
    ):
        engine.generate_sync(joined, greedy(12))
    assert list(engine.generate_sync(prompts[0], greedy(12)).outputs[0].token_ids) == alone[0]


@pytest.mark.engine
def test_the_encoders_outputs_give_hfs_tokens(engine, reference, preprocessor, tiny_models):
    """Encoder offload: the towers loaded alone (``mmserve.encoder``) give ``image_embeds`` (the DeepStack
    levels beside the merger's rows), ``video_embeds`` and ``audio_embeds`` in place of the features;
    vLLM on them = HF, for an image, a clip and a video in one prompt and for a video with its audio
    track (interleaved token by token), each prefilled in steps, and beside the features' prompt at
    once; audio embeddings one row short are refused by the count rule and the engine serves on."""
    from mmserve.encoder import Encoder, Towers
    from mmserve.errors import ProcessedInputError
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt

    family = get_family(FAMILY)
    encoder = Encoder(Towers(tiny_models[FAMILY]), cache_bytes=0)
    image, audio, video = sample_image(71, size=(112, 84)), as_sent(sample_audio(72, seconds=2.5)), sample_video(73, 6)
    content = [{"type": "image"}, {"type": "audio"}, {"type": "video"}, {"type": "text", "text": "What happens?"}]
    wire = preprocessor(
        None,
        [encode_image(image)],
        [encode_audio(audio)],
        messages=json.dumps([{"role": "user", "content": content}]),
        videos=[encode_video(video)],
    )
    _, inputs = hf_inputs(reference, ["image", "audio", "video"], [image], [audio], [video])
    frames, track, _, aiv_inputs = audio_in_video(reference, 74)
    aiv_wire = preprocessor("What happens?", videos=[encode_video(frames, audio=track)], use_audio_in_video=True)
    prompts, features, expected = [], [], []
    for request, hf in ((wire, inputs), (aiv_wire, aiv_inputs)):
        encoded = preprocessor.decode_wire(encoder.encoded(request))
        assert {"image_embeds", "video_embeds", "audio_embeds"} & set(encoded)
        assert not {"pixel_values", "pixel_values_videos", "input_features"} & set(encoded)
        prompts.append(processed_prompt(family, encoded["input_ids"], encoded))
        decoded = preprocessor.decode_wire(request)
        features.append(processed_prompt(family, decoded["input_ids"], decoded))
        expected.append(hf_greedy(reference, hf, 12).tokens)
    alone = [list(engine.generate_sync(prompt, greedy(12)).outputs[0].token_ids) for prompt in prompts]
    assert alone == expected, "vLLM on the towers' outputs != HF"
    both = engine.submit(run_concurrently(engine, [*prompts, *features], stagger_s=0.0)).result()
    assert both == [*expected, *expected]

    data = prompts[0]["multi_modal_data"]["audio"]
    short = {**data, "audio_embeds": data["audio_embeds"][:-1]}
    bad = {**prompts[0], "multi_modal_data": {**prompts[0]["multi_modal_data"], "audio": short}}
    with pytest.raises(ProcessedInputError, match=r"audio, audio_embeds: expected \d+ rows .*qwen3_omni_output_length"):
        engine.generate_sync(bad, greedy(12))
    assert list(engine.generate_sync(prompts[0], greedy(12)).outputs[0].token_ids) == expected[0]

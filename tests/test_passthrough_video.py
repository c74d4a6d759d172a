"""Videos (Qwen2.5-VL): ``preprocess`` decoding video files into what the HF processor makes of their
frames, its refusals of bad and oversized videos, the family's counting rule against the HF
processor's own expansion, the validation of processed video tensors, and greedy tokens of vLLM on
the processed videos against HF transformers on the frames."""

from __future__ import annotations

import numpy as np
import pytest

from mmserve_dev.samples import VIDEO_FPS, encode_video, sample_video

from utils import (
    ENGINE_ARGS,
    Request,
    greedy,
    hf_on_frames,
    hf_video_tokens,
    processed,
    raw_video,
    rejects,
)

FAMILY = "qwen2_5_vl"
CASES = {"one_video": ["video"], "two_videos": ["video", "video"], "image_and_video": ["image", "video"]}


@pytest.fixture(scope="module")
def preprocessor(tiny_models):
    from mmserve.serving.preprocess import Preprocessor

    return Preprocessor(tiny_models[FAMILY])


@pytest.fixture(scope="module")
def reference(tiny_models):
    from mmserve_dev.hf_reference import HFReference

    return HFReference(FAMILY, tiny_models[FAMILY])


def make_video_request(reference, name: str, parts: list[str], seed: int) -> tuple[Request, list[np.ndarray]]:
    from mmserve_dev.hf_reference import chat_prompt
    from mmserve_dev.samples import sample_image

    images = [sample_image(seed + 10 * i, size=(112, 84)) for i, p in enumerate(parts) if p == "image"]
    videos = [sample_video(seed + 10 * i, frames=4 + 2 * (i % 2)) for i, p in enumerate(parts) if p == "video"]
    text = chat_prompt(FAMILY, reference.processor, [*parts, "text:What happens?"])
    request = Request(name, text, images, [])
    request.hf_inputs = reference.processor(
        text=[text], images=images or None, videos=videos or None, return_tensors="pt"
    )
    return request, videos


def test_preprocess_gives_what_the_hf_processor_makes_of_the_frames(preprocessor, reference):
    """A video file through ``preprocess`` (text_input, and a conversation with an image before the
    video) = the HF processor on the frames the file was made from: ids and every video tensor."""
    from mmserve_dev.hf_reference import chat_prompt
    from mmserve_dev.samples import encode_image, sample_image

    video = sample_video(7, frames=6)
    got = preprocessor.decode_wire(preprocessor("What happens?", videos=[encode_video(video)]))
    want = hf_on_frames(
        reference.processor, chat_prompt(FAMILY, reference.processor, ["video", "text:What happens?"]), [], [video]
    )
    np.testing.assert_array_equal(got["input_ids"], want["input_ids"][0])
    for name in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):  # in the contract's dtypes
        np.testing.assert_array_equal(got[name], np.asarray(want[name], got[name].dtype), err_msg=name)
    assert got["second_per_grid_ts"].tolist() == pytest.approx([2 / VIDEO_FPS])  # temporal_patch_size / the file's fps

    image = sample_image(3, size=(112, 84))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "And?"}]}]
    import json

    got = preprocessor.decode_wire(
        preprocessor(None, [encode_image(image)], messages=json.dumps(messages), videos=[encode_video(video)])
    )
    text = chat_prompt(FAMILY, reference.processor, ["image", "video", "text:And?"])
    want = hf_on_frames(reference.processor, text, [image], [video])
    np.testing.assert_array_equal(got["input_ids"], want["input_ids"][0])
    for name in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_bad_and_oversized_videos_are_refused_by_name(preprocessor, tiny_models):
    """Every refusal names the video and what is wrong, before its frames are decoded where the file
    declares it (frame size, length), else as soon as a frame is over."""
    import io
    import json

    import soundfile

    from mmserve.serving.preprocess import PreprocessLimits, Preprocessor

    data = encode_video(sample_video(1, frames=6))  # 112x84, 6 frames at 12 fps: 0.5 s
    rejects(lambda: preprocessor("x", videos=[b"not a video"]), "video[0]: cannot decode 11 bytes as a video")
    wav = io.BytesIO()
    soundfile.write(wav, np.zeros(1600, np.float32), 16000, format="WAV")
    rejects(lambda: preprocessor("x", videos=[wav.getvalue()]), "video[0]: no video stream in")
    rejects(lambda: preprocessor("x", videos=[data[: len(data) // 2]]), "video[0]: ")
    limited = preprocessor.with_settings
    rejects(
        lambda: limited(limits=PreprocessLimits(max_video_frames=3))("x", videos=[data]),
        "video[0]: more than 3 frames (max_video_frames",
    )
    rejects(
        lambda: limited(limits=PreprocessLimits(max_video_frame_pixels=1000))("x", videos=[data]),
        "video[0]: frames of 9408 pixels (112x84) exceed the limit of 1000 (max_video_frame_pixels)",
    )
    rejects(
        lambda: limited(limits=PreprocessLimits(max_video_seconds=0.25))("x", videos=[data]),
        "video[0]: 0.50 s exceeds the limit of 0.25 s (max_video_seconds)",
    )
    rejects(
        lambda: preprocessor("x", videos=[data, data]),
        "video: 2 videos exceed the limit of 1 per request (max_videos)",
    )
    rejects(
        lambda: preprocessor(None, messages=json.dumps([{"role": "user", "content": [{"type": "video"}]}])),
        "messages: 1 video part but 0 videos given",
    )
    audio_only = Preprocessor(tiny_models["qwen2_audio"])
    rejects(lambda: audio_only("x", videos=[data]), "video: the qwen2_audio model takes no video")


def test_video_counting_rule_matches_hf_expansion(reference):
    """Each video's expected count (``video_grid_thw.prod() // merge**2``) is the run of
    ``<|video_pad|>`` the HF processor wrote for it, next to images."""
    from mmserve.families import get_family
    from mmserve.inputs import processed_multi_modal_data
    from mmserve.passthrough.items import ProcessedItems
    from mmserve.passthrough.placeholders import placeholder_runs

    family = get_family(FAMILY)
    vocab = reference.processor.tokenizer.get_vocab()
    for name, parts in CASES.items():
        request, _ = make_video_request(reference, name, parts, seed=3)
        ids = request.hf_inputs["input_ids"][0].tolist()
        data = processed_multi_modal_data(family, request.hf_inputs)
        assert set(data) == set(parts), name
        for modality, fields in data.items():
            spec = family.modality(modality)
            assert spec is not None
            items = ProcessedItems(fields, spec, reference.model.config)
            runs = placeholder_runs(ids, vocab[spec.placeholder_token])
            assert [n for _, n in runs] == items.expected_tokens(), name
            assert len(items) == parts.count(modality)


def test_bad_video_tensors_are_named(reference):
    """Processed videos are validated before the engine: what is wrong, in which field and item."""
    import torch

    from mmserve.errors import ProcessedInputError
    from mmserve.families import get_family
    from mmserve.passthrough.items import ProcessedItems

    family = get_family(FAMILY)
    video, image = family.modality("video"), family.modality("image")
    assert video is not None and image is not None
    request, _ = make_video_request(reference, "two", ["video", "video"], seed=4)
    good = {k: request.hf_inputs[k] for k in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")}
    config = reference.model.config
    ProcessedItems(good, video, config)  # the HF processor's own output passes

    def refused(change: dict, spec=video, base=good) -> str:
        with pytest.raises(ProcessedInputError) as failure:
            ProcessedItems({**base, **change}, spec, config)
        return str(failure.value)

    assert "second_per_grid_ts" in refused({"second_per_grid_ts": torch.tensor([0.5])})
    assert "positive number of seconds" in refused({"second_per_grid_ts": torch.tensor([0.5, 0.0])})
    assert "item 1" in refused({"second_per_grid_ts": torch.tensor([0.5, -1.0])})
    assert "NaN/Inf" in refused({"second_per_grid_ts": torch.tensor([0.5, float("nan")])})
    rows = good["pixel_values_videos"].shape[0]
    assert f"{rows - 1} rows" in refused({"pixel_values_videos": good["pixel_values_videos"][:-1]})
    grid = good["video_grid_thw"].clone()
    grid[1, 1] += 1  # h not a multiple of the merge size
    assert "multiples of spatial_merge_size" in refused({"video_grid_thw": grid})
    # An image is one temporal patch: vLLM's M-RoPE asserts it (in the engine) for image grids.
    pixels = torch.zeros(2 * 4 * 4, good["pixel_values_videos"].shape[1])
    message = refused({"pixel_values": pixels, "image_grid_thw": torch.tensor([[2, 4, 4]])}, spec=image, base={})
    assert "t = 1 (an image is one temporal patch)" in message and "(2, 4, 4)" in message


@pytest.fixture(scope="module")
def engine(tiny_models):
    from mmserve.engine import EngineRunner

    with EngineRunner(str(tiny_models[FAMILY]), **ENGINE_ARGS) as runner:
        yield runner


@pytest.mark.engine
def test_video_parity_with_hf(engine, reference):
    """Greedy tokens of vLLM fed the HF processor's video tensors and expanded ids (the pass-through)
    equal HF transformers' on the same processor output, for one video, two videos of different
    lengths, and an image with a video."""
    import torch

    for name, parts in CASES.items():
        request, _ = make_video_request(reference, name, parts, seed=5)
        with torch.no_grad():
            out = reference.model.generate(**request.hf_inputs, max_new_tokens=12, do_sample=False)
        expected = out[0, request.hf_inputs["input_ids"].shape[1] :].tolist()
        got = engine.generate_sync(processed(FAMILY, request), greedy(12)).outputs[0].token_ids
        assert list(got) == expected, f"{name}: vLLM on processed video != HF"


@pytest.mark.engine
def test_a_video_file_through_preprocess_gives_hf_tokens(engine, reference, preprocessor, tiny_models):
    """The whole preprocessing of a video file (decode, processor, wire) then the engine = HF
    transformers on the frames the file was made from, with the features or the vision tower's
    output in their place."""
    import torch

    from mmserve.encoder import Encoder, Towers
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt
    from mmserve_dev.hf_reference import chat_prompt

    video = sample_video(11, frames=6)
    tensors = preprocessor.decode_wire(preprocessor("What happens?", videos=[encode_video(video)]))
    hf = hf_on_frames(
        reference.processor, chat_prompt(FAMILY, reference.processor, ["video", "text:What happens?"]), [], [video]
    )
    with torch.no_grad():
        out = reference.model.generate(**hf.convert_to_tensors("pt"), max_new_tokens=12, do_sample=False)
    expected = out[0, hf["input_ids"].shape[1] :].tolist()
    prompt = processed_prompt(get_family(FAMILY), tensors["input_ids"], tensors)
    assert list(engine.generate_sync(prompt, greedy(12)).outputs[0].token_ids) == expected
    # the encoder apart (mmserve.encoder: the vision tower alone), its embeddings in their place
    encoder = Encoder(Towers(tiny_models[FAMILY]), cache_bytes=0)
    encoded = preprocessor.decode_wire(encoder.encoded(preprocessor("What happens?", videos=[encode_video(video)])))
    prompt = processed_prompt(get_family(FAMILY), encoded["input_ids"], encoded)
    assert list(engine.generate_sync(prompt, greedy(12)).outputs[0].token_ids) == expected


def test_the_example_clip_is_a_video_the_default_model_takes(tiny_models):
    """examples/media/clip.mp4 (the README's example: 8 frames, 224x168, 8 fps, MPEG-4 in MP4, made by
    ``mmserve_dev.samples.encode_video``) goes through the default model's ``preprocess``."""
    from pathlib import Path

    from mmserve.serving.preprocess import Preprocessor

    media = Path(__file__).resolve().parents[1] / "examples" / "media"
    preprocessor = Preprocessor(tiny_models["qwen2_5_omni"])
    out = preprocessor("What happens?", videos=[(media / "clip.mp4").read_bytes()])
    [(t, h, w)] = out["video_grid_thw"].tolist()
    assert t == 4 and out["pixel_values_videos"].shape[0] == t * h * w
    # clip_with_audio.mov: the same frames (MPEG-4 in MOV) with 1 s of tone.wav as its audio track
    out = preprocessor("What happens?", videos=[(media / "clip_with_audio.mov").read_bytes()], use_audio_in_video=True)
    assert out["use_audio_in_video"].tolist() == [True] and out["video_grid_thw"].tolist() == [[t, h, w]]
    assert out["feature_attention_mask"].sum() == 100  # 1 s of 10-ms frames


# -- Qwen2.5-Omni: video without its audio track ----------------------------------------------------------
@pytest.fixture(scope="module")
def omni_preprocessor(tiny_models):
    from mmserve.serving.preprocess import Preprocessor

    return Preprocessor(tiny_models["qwen2_5_omni"])


def test_omni_video_is_what_its_hf_processor_makes_of_the_frames(omni_preprocessor, omni_reference):
    """Omni's processor names the seconds per temporal patch ``video_second_per_grid``: ``preprocess``
    sends it under that name (a wire field of the family), ``mm_llm`` reads it as vLLM's
    ``second_per_grid_ts``; everything else equals the HF processor on the frames, and the count rule
    holds."""
    from mmserve.families import get_family
    from mmserve.inputs import processed_multi_modal_data
    from mmserve.passthrough.items import ProcessedItems
    from mmserve.passthrough.placeholders import placeholder_runs
    from mmserve_dev.hf_reference import chat_prompt

    video = sample_video(9, frames=6)
    wire = omni_preprocessor("What happens?", videos=[encode_video(video)])
    text = chat_prompt("qwen2_5_omni", omni_reference.processor, ["video", "text:What happens?"])
    want = hf_on_frames(omni_reference.processor, text, [], [video])
    seconds = np.asarray(want["video_second_per_grid"], np.float32)
    np.testing.assert_array_equal(wire["input_ids"], want["input_ids"][0])
    np.testing.assert_array_equal(wire["video_second_per_grid"], seconds)
    assert "second_per_grid_ts" not in wire
    got = omni_preprocessor.decode_wire(wire)
    assert "video_second_per_grid" not in got
    np.testing.assert_array_equal(got["second_per_grid_ts"], seconds)
    np.testing.assert_array_equal(got["pixel_values_videos"], want["pixel_values_videos"])
    family = get_family("qwen2_5_omni")
    spec = family.modality("video")
    assert spec is not None
    data = processed_multi_modal_data(family, got)["video"]
    items = ProcessedItems(data, spec, omni_reference.model.config)
    vocab = omni_reference.processor.tokenizer.get_vocab()
    runs = placeholder_runs(got["input_ids"].tolist(), vocab["<|VIDEO|>"])
    assert [n for _, n in runs] == items.expected_tokens()


@pytest.fixture(scope="module")
def omni_engine(tiny_models):
    from mmserve.engine import EngineRunner

    with EngineRunner(str(tiny_models["qwen2_5_omni"]), **ENGINE_ARGS) as runner:
        yield runner


@pytest.mark.engine
def test_omni_video_parity_with_hf(omni_engine, omni_reference, omni_preprocessor):
    """Video files through ``preprocess`` (a conversation) and the engine = HF transformers (the
    Omni thinker) on the frames: one video, and two of different lengths."""
    import json

    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt
    from mmserve.serving.preprocess import PreprocessLimits
    from mmserve_dev.hf_reference import chat_prompt

    family = get_family("qwen2_5_omni")
    for videos in ([sample_video(13, frames=6)], [sample_video(14, frames=4), sample_video(15, frames=6)]):
        text = chat_prompt("qwen2_5_omni", omni_reference.processor, [*(["video"] * len(videos)), "text:What happens?"])
        expected = hf_video_tokens(omni_reference, text, videos, max_new_tokens=12)
        content = [*({"type": "video"} for _ in videos), {"type": "text", "text": "What happens?"}]
        preprocessor = omni_preprocessor.with_settings(limits=PreprocessLimits(max_videos=2))
        wire = preprocessor(
            None, messages=json.dumps([{"role": "user", "content": content}]), videos=[encode_video(v) for v in videos]
        )
        tensors = preprocessor.decode_wire(wire)
        got = omni_engine.generate_sync(processed_prompt(family, tensors["input_ids"], tensors), greedy(12))
        assert list(got.outputs[0].token_ids) == expected, f"{len(videos)} video(s): vLLM on processed video != HF"


# -- Qwen2.5-Omni: a video with its audio track (use_audio_in_video) ------------------------------------
AIV_FRAMES = 26
"""Frames of the audio-in-video clip: 13 temporal patches at VIDEO_FPS span two of the model's
2-second chunks, so the placeholders interleave video, audio, video, audio."""


def _video_with_audio(seed: int) -> tuple[np.ndarray, np.ndarray]:
    from mmserve_dev.samples import sample_audio

    frames = sample_video(seed, frames=AIV_FRAMES)
    return frames, sample_audio(seed + 1, seconds=AIV_FRAMES / VIDEO_FPS)


def _hf_audio_in_video(reference, frames: np.ndarray, audio: np.ndarray):
    from mmserve_dev.hf_reference import chat_prompt

    from utils import hf_on_video_with_audio

    text = chat_prompt("qwen2_5_omni", reference.processor, ["video", "text:What happens?"])
    return hf_on_video_with_audio(reference.processor, text, frames, audio)


def test_omni_audio_in_video_is_what_its_hf_processor_makes(omni_preprocessor, omni_reference):
    """A video file with an audio track and ``use_audio_in_video``: ``preprocess`` decodes both,
    and its ids (video and audio placeholders interleaved by time) and tensors are the HF
    processor's on the frames and the waveform; each video is flagged for ``mm_llm``."""
    frames, audio = _video_with_audio(41)
    want = _hf_audio_in_video(omni_reference, frames, audio)
    wire = omni_preprocessor("What happens?", videos=[encode_video(frames, audio=audio)], use_audio_in_video=True)
    got = omni_preprocessor.decode_wire(wire)
    np.testing.assert_array_equal(got["input_ids"], want["input_ids"][0].numpy())
    vocab = omni_reference.processor.tokenizer.get_vocab()
    ids = got["input_ids"].tolist()
    first_audio, last_video = ids.index(vocab["<|AUDIO|>"]), len(ids) - 1 - ids[::-1].index(vocab["<|VIDEO|>"])
    assert first_audio < last_video  # interleaved: two chunks
    np.testing.assert_array_equal(got["pixel_values_videos"], want["pixel_values_videos"].numpy())
    assert got["use_audio_in_video"].tolist() == [True]
    frames_heard = int(want["feature_attention_mask"].sum())
    assert got["feature_attention_mask"].sum() == frames_heard
    np.testing.assert_array_equal(
        got["input_features"][..., :frames_heard], want["input_features"][..., :frames_heard].numpy()
    )
    plain = omni_preprocessor("What happens?", videos=[encode_video(frames, audio=audio)])
    assert "use_audio_in_video" not in plain and vocab["<|AUDIO|>"] not in plain["input_ids"].tolist()


def test_audio_in_video_refusals_name_the_input(omni_preprocessor, preprocessor):
    frames, audio = _video_with_audio(43)
    rejects(
        lambda: omni_preprocessor("x", videos=[encode_video(frames)], use_audio_in_video=True),
        "video[0].audio: the video has no audio track (use_audio_in_video)",
    )
    rejects(
        lambda: omni_preprocessor(
            "x", audios=[b"RIFF"], videos=[encode_video(frames, audio=audio)], use_audio_in_video=True
        ),
        "use_audio_in_video: audio and audio_pcm must be absent",
    )
    rejects(
        lambda: preprocessor("x", videos=[encode_video(frames, audio=audio)], use_audio_in_video=True),
        "use_audio_in_video: the qwen2_5_vl model takes no audio in video",
    )


def test_bad_audio_in_video_layouts_are_named(omni_reference):
    """The pass-through checks an audio-in-video prompt against vLLM's own layout of the chunks."""
    from mmserve.errors import ProcessedInputError
    from mmserve.families import get_family
    from mmserve.passthrough.items import ProcessedItems

    frames, audio = _video_with_audio(45)
    hf = {k: v.numpy() for k, v in _hf_audio_in_video(omni_reference, frames, audio).items()}
    family = get_family("qwen2_5_omni")
    config = omni_reference.model.config
    video_spec, audio_spec = family.modality("video"), family.modality("audio")
    assert video_spec is not None and audio_spec is not None and family.audio_in_video is not None

    def items(flags):
        video = {
            "pixel_values_videos": hf["pixel_values_videos"],
            "video_grid_thw": hf["video_grid_thw"],
            "second_per_grid_ts": hf["video_second_per_grid"].astype(np.float32),
            "use_audio_in_video": np.array(flags),
        }
        sound = {"input_features": hf["input_features"], "feature_attention_mask": hf["feature_attention_mask"]}
        return ProcessedItems(video, video_spec, config), ProcessedItems(sound, audio_spec, config)

    ids = hf["input_ids"][0].tolist()
    placed = family.audio_in_video.placements(ids, *items([True]), config)
    [video], [sound] = placed["video"], placed["audio"]
    assert video.offset == sound.offset == ids.index(config.audio_start_token_id)
    assert sum(video.is_embed) == int(hf["video_grid_thw"].prod()) // 4 and sum(sound.is_embed) == ids.count(
        config.audio_token_index
    )
    assert family.audio_in_video.placements(ids, *items([False]), config) is None

    with pytest.raises(
        ProcessedInputError,
        match=r"video item 0, prompt_token_ids: expected 1876 tokens .* found token \d+ at offset \d+",
    ):
        swapped = list(ids)
        at = swapped.index(config.audio_token_index)
        swapped[at - 1], swapped[at] = swapped[at], swapped[at - 1]
        family.audio_in_video.placements(swapped, *items([True]), config)
    with pytest.raises(ProcessedInputError, match=r"<\|vision_bos\|><\|audio_bos\|> span"):
        family.audio_in_video.placements([1, 2, 3], *items([True]), config)


@pytest.mark.engine
def test_omni_audio_in_video_parity_with_hf(omni_engine, omni_reference, omni_preprocessor, omni_encoder):
    """A video with its audio: HF transformers on the frames and the waveform = vLLM on the same raw
    media (the plugin's model class, with ``passthrough.models.qwen2_5_omni.OmniAudioInVideo``) = vLLM on
    ``preprocess``'s tensors of the video file = vLLM on the encoders' outputs of them. (Stock vLLM 0.32 answers otherwise: its positions
    of the span are one token off.)"""
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt

    from utils import hf_video_with_audio_tokens

    frames, audio = _video_with_audio(47)
    hf = _hf_audio_in_video(omni_reference, frames, audio)
    expected = hf_video_with_audio_tokens(omni_reference, frames, audio, max_new_tokens=12)

    wire = omni_preprocessor("What happens?", videos=[encode_video(frames, audio=audio)], use_audio_in_video=True)
    tensors = omni_preprocessor.decode_wire(wire)
    processed_run = omni_engine.generate_sync(
        processed_prompt(get_family("qwen2_5_omni"), tensors["input_ids"], tensors), greedy(12)
    )
    assert list(processed_run.outputs[0].token_ids) == expected, "vLLM on preprocess's tensors != HF"
    encoded = omni_preprocessor.decode_wire(omni_encoder.encoded(wire))
    encoded_run = omni_engine.generate_sync(
        processed_prompt(get_family("qwen2_5_omni"), encoded["input_ids"], encoded), greedy(12)
    )
    assert list(encoded_run.outputs[0].token_ids) == expected, "vLLM on the encoders' outputs != HF"

    from mmserve_dev.hf_reference import chat_prompt
    from mmserve_dev.samples import AUDIO_SAMPLE_RATE

    raw = {
        "prompt": chat_prompt("qwen2_5_omni", omni_reference.processor, ["video", "text:What happens?"]),
        "multi_modal_data": {"video": [raw_video(frames)], "audio": [(audio, AUDIO_SAMPLE_RATE)]},
        "mm_processor_kwargs": {"use_audio_in_video": True},
    }
    raw_run = omni_engine.generate_sync(raw, greedy(12))
    assert list(raw_run.prompt_token_ids) == hf["input_ids"][0].tolist()
    assert list(raw_run.outputs[0].token_ids) == expected, "vLLM on the raw video and audio != HF"


@pytest.mark.engine
def test_omni_image_video_and_audio_in_one_request_match_hf(
    omni_engine, omni_reference, omni_preprocessor, omni_encoder
):
    """An image, a video and an audio clip in one conversation: HF transformers on the raw media =
    vLLM on ``preprocess``'s tensors of the files = vLLM on the encoders' outputs of them (encoder
    offload) = vLLM on the raw media."""
    import json

    import torch

    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt
    from mmserve_dev.hf_reference import chat_prompt
    from mmserve_dev.samples import AUDIO_SAMPLE_RATE, encode_audio, encode_image, sample_audio, sample_image

    image, frames, audio = sample_image(51), sample_video(52, frames=6), sample_audio(53, seconds=1.5)
    parts = ["image", "video", "audio", "text:What do you get?"]
    text = chat_prompt("qwen2_5_omni", omni_reference.processor, parts)
    metadata = {
        "total_num_frames": len(frames),
        "fps": float(VIDEO_FPS),
        "width": frames.shape[2],
        "height": frames.shape[1],
    }
    hf = omni_reference.processor(
        text=[text],
        images=[image],
        videos=[frames],
        video_metadata=[metadata],
        audio=[audio],
        sampling_rate=AUDIO_SAMPLE_RATE,
        return_tensors="pt",
    )
    with torch.no_grad():
        out = omni_reference.model.generate(**hf, max_new_tokens=12, do_sample=False)
    expected = out[0, hf["input_ids"].shape[1] :].tolist()

    content = [{"type": "image"}, {"type": "video"}, {"type": "audio"}, {"type": "text", "text": "What do you get?"}]
    wire = omni_preprocessor(
        None,
        [encode_image(image)],
        [encode_audio(audio)],
        messages=json.dumps([{"role": "user", "content": content}]),
        videos=[encode_video(frames)],
    )
    tensors = omni_preprocessor.decode_wire(wire)
    np.testing.assert_array_equal(tensors["input_ids"], hf["input_ids"][0].numpy())
    got = omni_engine.generate_sync(
        processed_prompt(get_family("qwen2_5_omni"), tensors["input_ids"], tensors), greedy(12)
    )
    assert list(got.outputs[0].token_ids) == expected, "vLLM on preprocess's tensors != HF"
    encoded = omni_preprocessor.decode_wire(omni_encoder.encoded(wire))
    got = omni_engine.generate_sync(
        processed_prompt(get_family("qwen2_5_omni"), encoded["input_ids"], encoded), greedy(12)
    )
    assert list(got.outputs[0].token_ids) == expected, "vLLM on the encoders' outputs != HF"

    raw = {
        "prompt": text,
        "multi_modal_data": {
            "image": [image],
            "video": [raw_video(frames)],
            "audio": [(audio, AUDIO_SAMPLE_RATE)],
        },
    }
    assert list(omni_engine.generate_sync(raw, greedy(12)).outputs[0].token_ids) == expected, "vLLM raw != HF"

"""Every number of a processed input bounded before the engine (issue 39), without an engine: the
families' validation (``ProcessedItems``, as the pass-through processor builds them) on the values that
killed the engine core or would have, each refused with the modality, item, field, what was expected
and what was found. ``tests/test_property_engine.py`` runs the same kinds of inputs through the engine."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mmserve.errors import ProcessedInputError
from mmserve.families import get_family
from mmserve.families.qwen import rotary_positions
from mmserve.passthrough.items import ProcessedItems

WRAP = 2**62 + 2
"""h of the grid (1, 2**62 + 2, 24) an attacker sent with 12 rows of image_embeds: t*h*w is 48 in
int64 (6 * 2**64 + 48), 12 placeholders, and every check passed; vLLM's M-RoPE then built an index
array of 2**61 x 12 and the engine core died."""
MAX_MODEL_LEN = 2048  # tests/utils.ENGINE_ARGS


@pytest.fixture(scope="module")
def configs(tiny_models):
    from transformers import AutoConfig

    out = {}
    for name in ("qwen2_5_omni", "qwen2_5_vl", "qwen2_audio"):
        config = AutoConfig.from_pretrained(tiny_models[name])
        out[name] = getattr(config, "thinker_config", config)  # what vLLM's processing info hands the family
    return out


def refused(data: dict, family: str, modality: str, configs, *, encoded: bool = False, **kwargs) -> str:
    spec = get_family(family).spec_for(modality, data) if encoded else get_family(family).modality(modality)
    assert spec is not None
    with pytest.raises(ProcessedInputError) as failure:
        ProcessedItems(data, spec, configs[family], **kwargs)
    return str(failure.value)


def accepted(data: dict, family: str, modality: str, configs, **kwargs) -> ProcessedItems:
    spec = get_family(family).spec_for(modality, data)
    assert spec is not None
    return ProcessedItems(data, spec, configs[family], **kwargs)


def video(seconds: float, grid=(2, 4, 4), dtype=torch.float32) -> dict:
    t, h, w = grid
    return {
        "pixel_values_videos": torch.zeros(t * h * w, 1176),
        "video_grid_thw": torch.tensor([list(grid)]),
        "second_per_grid_ts": torch.tensor([seconds], dtype=dtype),
    }


def test_the_rotary_table_is_what_vllm_builds(configs):
    """4 x max_position_embeddings: vLLM's MRotaryEmbedding cache (the engine's IndexError named
    "size 131072" for these checkpoints); YaRN scales from the original length."""
    assert rotary_positions(configs["qwen2_5_vl"]) == rotary_positions(configs["qwen2_5_omni"]) == 131072
    from transformers import Qwen2_5_VLConfig

    yarn = Qwen2_5_VLConfig(
        text_config={
            "max_position_embeddings": 128000,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32000,
                "mrope_section": [16, 24, 24],
                "rope_theta": 1e6,
            },
        }
    )
    assert rotary_positions(yarn) == 4 * 32000


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_5_omni"])
def test_a_grid_that_wraps_around_in_int64_is_refused(configs, family):
    """The attack of issue 39, in each form of images and videos: products in exact integers."""
    grid = torch.tensor([[1, WRAP, 24]])
    assert int(grid.prod()) == 48  # what int64 arithmetic made of it
    message = refused(
        {"image_embeds": torch.zeros(12, 128), "image_grid_thw": grid}, family, "image", configs, encoded=True
    )
    assert message.startswith("image item 0, image_grid_thw: expected at most 131072 placeholder tokens"), message
    assert f"(1, {WRAP}, 24): {WRAP * 24 // 4} tokens" in message
    message = refused({"pixel_values": torch.zeros(48, 1176), "image_grid_thw": grid}, family, "image", configs)
    assert message.startswith("image item 0, image_grid_thw: expected at most 131072 placeholder tokens"), message
    video_grid = torch.tensor([[2, 2**62 + 4, 8]])  # 2 * 8 * (2**62 + 4) = 64 in int64
    data = {
        "video_embeds": torch.zeros(16, 128),
        "video_grid_thw": video_grid,
        "second_per_grid_ts": torch.tensor([1.0]),
    }
    message = refused(data, family, "video", configs, encoded=True)
    assert message.startswith("video item 0, video_grid_thw: expected at most 131072 placeholder tokens"), message
    # Wrapped sums too: two grids whose int64 rows add up to the patches sent
    grid = torch.tensor([[1, 2**62, 4], [1, 4, 4]])  # 2**64 + 16: 16 in int64
    message = refused({"pixel_values": torch.zeros(16, 1176), "image_grid_thw": grid}, family, "image", configs)
    assert message.startswith("image item 0, image_grid_thw: expected at most"), message


def test_the_uint8_wire_form_counts_patches_exactly(tiny_models):
    """``pixel_values_uint8``'s decoder (before the fields are validated) and the images'
    identities count t*h*w in exact integers too."""
    family = get_family("qwen2_5_vl")
    decoders = family.wire_decoders(tiny_models["qwen2_5_vl"])
    patches = np.zeros((48, 1176), np.uint8)
    grid = np.array([[1, WRAP, 24]], np.int64)
    with pytest.raises(ProcessedInputError, match=rf"image, pixel_values_uint8: expected {WRAP * 24} patches"):
        family.decode_wire({"pixel_values_uint8": patches, "image_grid_thw": grid}, decoders)
    spec = family.modality("image")
    assert spec is not None
    assert spec.wire_item_ids({"pixel_values_uint8": patches, "image_grid_thw": grid}) is None
    good = spec.wire_item_ids({"pixel_values_uint8": patches, "image_grid_thw": np.array([[1, 4, 4], [1, 4, 8]])})
    assert good is not None and len(good) == 2


def test_grid_items_count_in_exact_integers(configs):
    items = accepted(
        {"image_embeds": torch.zeros(4 + 30, 128), "image_grid_thw": torch.tensor([[1, 4, 4], [1, 6, 20]])},
        "qwen2_5_vl",
        "image",
        configs,
    )
    assert items.expected_tokens() == [4, 30]
    assert [tuple(items.get(i)["image_embeds"].shape) for i in range(2)] == [(4, 128), (30, 128)]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_5_omni"])
@pytest.mark.parametrize("seconds", [1e6, 3e38, 65536.0])
def test_seconds_past_the_rotary_table_are_refused(configs, family, seconds):
    """Positive and finite, yet the last temporal patch's M-RoPE time position ((t - 1) * seconds *
    tokens_per_second) lands past the table: vLLM indexed its cos/sin cache out of bounds (the engine
    core died, "index 2000005 is out of bounds for dimension 0 with size 131072")."""
    per_second = {"qwen2_5_vl": 2, "qwen2_5_omni": 25}[family]
    message = refused(video(seconds), family, "video", configs)
    assert message.startswith("video item 0, second_per_grid_ts: expected a positive number of seconds below "), message
    assert f"{131072 / per_second:.6g} for t=2" in message and f"found {float(np.float32(seconds))!r}" in message


def test_seconds_matter_for_one_temporal_patch_too(configs):
    """t = 1: vLLM still multiplies the temporal index 0 by seconds * tokens_per_second (Inf: NaN)."""
    message = refused(video(3e38, grid=(1, 4, 4)), "qwen2_5_vl", "video", configs)
    assert "below 65536 for t=1" in message
    accepted(video(60.0, grid=(1, 4, 4)), "qwen2_5_vl", "video", configs)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_seconds_are_refused(configs, value):
    message = refused(video(value), "qwen2_5_vl", "video", configs)
    assert message == "video, second_per_grid_ts: expected finite values, found 1 NaN/Inf value(s)"


@pytest.mark.parametrize("value", [0.0, -0.0, -1.0])
def test_seconds_must_be_positive(configs, value):
    message = refused(video(value), "qwen2_5_vl", "video", configs)
    assert message == f"video item 0, second_per_grid_ts: expected a positive number of seconds, found {value}"


def test_the_videos_positions_fit_the_table_past_a_whole_context(configs):
    """The request-level bound (``QwenVisionVideo.validate_limits``): the videos' time positions beyond
    their tokens, over all videos, within the table less max_model_len (a prompt and its generation
    then never reach the table's end: tests/test_property_engine.py generates to the context's end at
    the bound). Exactly at it: accepted; one position more: refused, naming the video that overflows."""
    budget = 131072 - MAX_MODEL_LEN
    at_bound = (budget + 8 - 1) / 2  # Qwen2.5-VL: int(1 * seconds * 2) + 1 - 8 tokens = budget
    accepted(video(at_bound), "qwen2_5_vl", "video", configs, max_model_len=MAX_MODEL_LEN)
    message = refused(video(at_bound + 0.5), "qwen2_5_vl", "video", configs, max_model_len=MAX_MODEL_LEN)
    assert message.startswith(
        f"video item 0, second_per_grid_ts: expected at most {budget} M-RoPE positions beyond the videos' tokens"
    ), message
    assert "found 129025 up to this video (129033 time positions for video_grid_thw=[2, 4, 4]" in message
    # two videos share the budget: each alone fits, together they don't
    half = (budget // 2 + 8 - 1) / 2
    two = {
        "pixel_values_videos": torch.zeros(64, 1176),
        "video_grid_thw": torch.tensor([[2, 4, 4], [2, 4, 4]]),
        "second_per_grid_ts": torch.tensor([half, half + 1]),
    }
    message = refused(two, "qwen2_5_vl", "video", configs, max_model_len=MAX_MODEL_LEN)
    assert message.startswith("video item 1, second_per_grid_ts: expected at most"), message
    # without the engine's max_model_len (ProcessedItems built alone): the model's own bound only
    accepted(video(at_bound + 0.5), "qwen2_5_vl", "video", configs)


def test_a_modalitys_placeholders_leave_room_to_generate(configs):
    """Every family: a request's placeholders of one modality fit max_model_len less one token."""
    grid = torch.tensor([[1, 64, 64], [1, 64, 64]])  # 1024 tokens each
    data = {"image_embeds": torch.zeros(2048, 128), "image_grid_thw": grid}
    message = refused(data, "qwen2_5_vl", "image", configs, encoded=True, max_model_len=MAX_MODEL_LEN)
    assert message == (
        "image item 1: expected at most 2047 placeholder tokens over the request's image items "
        "(max_model_len=2048, less one token to generate), found 2048 up to this item (image_grid_thw=[1, 64, 64])"
    )
    lengths = torch.tensor([3000, 3000, 3000])  # 750 audio tokens each
    data = {"audio_embeds": torch.zeros(2250, 128), "audio_feature_lengths": lengths}
    message = refused(data, "qwen2_audio", "audio", configs, encoded=True, max_model_len=MAX_MODEL_LEN)
    assert message.startswith("audio item 2: expected at most 2047 placeholder tokens"), message


def test_use_audio_in_video_is_boolean(configs):
    data = {**video(0.5), "use_audio_in_video": torch.tensor([2])}
    message = refused(data, "qwen2_5_omni", "video", configs)
    assert message == "video, use_audio_in_video: expected booleans (0 or 1), found values [2]"
    accepted(
        {**video(0.5), "use_audio_in_video": torch.tensor([1], dtype=torch.uint8)}, "qwen2_5_omni", "video", configs
    )


@pytest.mark.parametrize(
    ("field", "lengths", "expected"),
    [
        ("audio_feature_lengths", [2**63 - 1], f"between 2 and 3000 valid frames, found {2**63 - 1}"),
        ("audio_feature_lengths", [-(2**63)], f"between 2 and 3000 valid frames, found {-(2**63)}"),
        ("audio_feature_lengths", [3001], "between 2 and 3000 valid frames, found 3001"),
        ("audio_feature_lengths", [2], "at least 3 valid frames (fewer give no encoder output), found 2"),
    ],
)
def test_audio_lengths_are_bounded(configs, field, lengths, expected):
    data = {"audio_embeds": torch.zeros(1, 128), "audio_feature_lengths": torch.tensor(lengths)}
    for family in ("qwen2_5_omni", "qwen2_audio"):
        message = refused(data, family, "audio", configs, encoded=True)
        assert message == f"audio item 0, {field}: expected {expected}", message


def test_audio_masks_are_bounded(configs):
    features = torch.zeros(1, 128, 10)
    mask = torch.ones(1, 10, dtype=torch.int32)
    mask[0, :2] = 2
    message = refused({"input_features": features, "feature_attention_mask": mask}, "qwen2_5_omni", "audio", configs)
    assert message == "audio, feature_attention_mask: expected only 0 and 1, found values [1, 2]"
    mask = torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    message = refused({"input_features": features, "feature_attention_mask": mask}, "qwen2_5_omni", "audio", configs)
    assert (
        message
        == "audio item 0, feature_attention_mask: expected at least 3 valid frames (fewer give no encoder output), found 2"
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"image_embeds": torch.zeros(4, 128), "image_grid_thw": torch.tensor([[1, 4, 4]], dtype=torch.uint64)},
            "image, image_grid_thw: expected an integer tensor (int64, int32, int16, int8, uint8 or bool), found dtype torch.uint64",
        ),
        (
            {
                "image_embeds": torch.full((4, 128), 1e300, dtype=torch.float64),
                "image_grid_thw": torch.tensor([[1, 4, 4]]),
            },
            "image, image_embeds: expected values within float32's range (the engine computes in the model's dtype), found 512 value(s) beyond it",
        ),
        (
            {
                "image_embeds": np.zeros((4, 128), np.float32),
                "image_grid_thw": np.array([["1", "4", "4"]], dtype=object),
            },
            "image, image_grid_thw: expected a numeric array, found dtype object",
        ),
    ],
)
def test_dtypes_the_engine_cant_take_are_refused(configs, data, message):
    """uint64 grids have no ``prod`` kernel in torch (it raised inside vLLM's processor); float64's
    finite values may be Inf in the model's dtype (the engine casts to it); object arrays are no
    tensors. Other float dtypes, and float64 within float32's range, are taken."""
    assert refused(data, "qwen2_5_vl", "image", configs, encoded=True) == message
    grid = torch.tensor([[1, 4, 4]])
    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        accepted(
            {"image_embeds": torch.ones(4, 128, dtype=dtype), "image_grid_thw": grid}, "qwen2_5_vl", "image", configs
        )


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen2_audio"])
def test_log_mel_features_are_bounded(configs, family):
    """Finite but huge features overflow the audio encoder, and its NaN keys and values poison the CPU
    KV cache for the next request (1e25 did: tests/test_property_engine.py found it); a Whisper
    extractor gives [-1.5, 22] for any float32 waveform."""
    frames = 3000 if family == "qwen2_audio" else 10
    features = torch.zeros(1, 128, frames)
    features[0, 5, 3] = 1e25
    mask = torch.ones(1, frames, dtype=torch.int32)
    message = refused({"input_features": features, "feature_attention_mask": mask}, family, "audio", configs)
    assert message == (
        "audio, input_features: expected log-mel values within [-64, 64] (a Whisper feature extractor gives "
        "[-1.5, 22] for any float32 waveform), found 1 value(s) beyond, up to 1e+25 in magnitude"
    )
    features[0, 5, 3] = -1.5
    features[0, 6, 3] = 22.0
    accepted({"input_features": features, "feature_attention_mask": mask}, family, "audio", configs)


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen2_audio"])
def test_uint64_lengths_are_refused(configs, family):
    """uint64 ``audio_feature_lengths`` passed every check and killed Qwen2-Audio's engine core ("add_stub"
    not implemented for 'UInt64', in its tower's length arithmetic)."""
    data = {"audio_embeds": torch.zeros(32, 128), "audio_feature_lengths": np.array([128], np.uint64)}
    message = refused(data, family, "audio", configs, encoded=True)
    assert message == (
        "audio, audio_feature_lengths: expected an integer tensor (int64, int32, int16, int8, uint8 or bool), "
        "found dtype torch.uint64"
    )
    accepted({**data, "audio_feature_lengths": np.array([128], np.int32)}, family, "audio", configs)


def test_embeddings_are_bounded(configs):
    """An encoder's output sent in place of its input (encoder offload), finite but huge, is refused
    by the one check every encoded form runs (``base.check_embeddings``); float16's range passes."""
    grid = torch.tensor([[1, 4, 4]])
    embeds = torch.zeros(4, 128)
    embeds[2, 7] = 1e30
    message = refused({"image_embeds": embeds, "image_grid_thw": grid}, "qwen2_5_vl", "image", configs, encoded=True)
    assert message == (
        "image, image_embeds: expected values within [-65504, 65504] (float16's range), "
        "found 1 value(s) beyond, up to 1e+30 in magnitude"
    )
    audio = torch.zeros(1, 128)
    audio[0, 0] = -1e6
    data = {"audio_embeds": audio, "audio_feature_lengths": torch.tensor([4])}
    assert "found 1 value(s) beyond, up to 1e+06" in refused(data, "qwen2_5_omni", "audio", configs, encoded=True)
    embeds[2, 7] = -65504.0
    accepted({"image_embeds": embeds, "image_grid_thw": grid}, "qwen2_5_vl", "image", configs)

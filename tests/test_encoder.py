"""``mmserve.encoder``: a checkpoint's encoder towers loaded alone give the embeddings the full HF
model computes (``get_image_features``, ``get_video_features``, ``get_audio_features``) from the
same processor outputs, from ``preprocess``'s tensors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmserve_dev.samples import encode_audio, encode_image, encode_video, sample_audio, sample_image, sample_video


@pytest.fixture(scope="module")
def omni_towers(tiny_models):
    from mmserve.encoder import Towers

    return Towers(tiny_models["qwen2_5_omni"])


def _preprocessed(path, **media):
    from mmserve.serving.preprocess import Preprocessor

    preprocessor = Preprocessor(path)
    return preprocessor.decode_wire(preprocessor("Describe.", **media))


def test_omni_towers_give_the_models_embeddings(omni_towers, omni_reference, tiny_models):
    """An image, a video and an audio clip through ``preprocess``, then the towers alone = the HF
    thinker's own feature methods on the same tensors, exactly (float32, CPU)."""
    tensors = _preprocessed(
        tiny_models["qwen2_5_omni"],
        images=[encode_image(sample_image(3))],
        audios=[encode_audio(sample_audio(4, seconds=2.0))],
        videos=[encode_video(sample_video(5, frames=4))],
    )
    from mmserve.encoder import Encoder

    encoded = Encoder(omni_towers, cache_bytes=0)(tensors)
    embeddings = {m: torch.from_numpy(encoded[f"{m}_embeds"]) for m in ("image", "video", "audio")}
    model = omni_reference.model
    t = {name: torch.from_numpy(np.asarray(value)) for name, value in tensors.items()}
    with torch.inference_mode():
        image = torch.cat(model.get_image_features(t["pixel_values"], t["image_grid_thw"]).pooler_output)
        video = torch.cat(model.get_video_features(t["pixel_values_videos"], t["video_grid_thw"]).pooler_output)
        audio = model.get_audio_features(t["input_features"], t["feature_attention_mask"]).last_hidden_state
    torch.testing.assert_close(embeddings["image"], image, rtol=0, atol=0)
    torch.testing.assert_close(embeddings["video"], video, rtol=0, atol=0)
    torch.testing.assert_close(embeddings["audio"], audio, rtol=0, atol=0)
    vocab = omni_reference.processor.tokenizer.get_vocab()
    ids = tensors["input_ids"].tolist()
    for modality, token in (("image", "<|IMAGE|>"), ("video", "<|VIDEO|>"), ("audio", "<|AUDIO|>")):
        assert embeddings[modality].shape == (ids.count(vocab[token]), model.config.text_config.hidden_size)


def test_the_towers_hold_no_language_model_weights(omni_towers, omni_reference):
    held = {id(p) for module in omni_towers.modules.values() for p in module.parameters()}
    towers = sum(p.numel() for module in set(omni_towers.modules.values()) for p in module.parameters())
    model = omni_reference.model
    assert towers == sum(p.numel() for p in model.visual.parameters()) + sum(
        p.numel() for p in model.audio_tower.parameters()
    )
    assert len(held) < sum(1 for _ in model.parameters())


def test_vl_vision_tower(tiny_models):
    from mmserve.encoder import Towers
    from mmserve_dev.hf_reference import HFReference

    reference = HFReference("qwen2_5_vl", tiny_models["qwen2_5_vl"])
    towers = Towers(tiny_models["qwen2_5_vl"])
    tensors = _preprocessed(
        tiny_models["qwen2_5_vl"], images=[encode_image(sample_image(7)), encode_image(sample_image(8))]
    )
    with torch.inference_mode():
        want = torch.cat(
            reference.model.model.get_image_features(
                torch.from_numpy(tensors["pixel_values"]), torch.from_numpy(tensors["image_grid_thw"])
            ).pooler_output
        )
    torch.testing.assert_close(towers.image(tensors["pixel_values"], tensors["image_grid_thw"]), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="qwen2_5_vl: no tower for audio"):
        towers.audio(np.zeros((1, 128, 10), np.float32), np.ones((1, 10), np.int32))


def test_qwen3_vl_vision_tower_with_its_deepstack_levels(tiny_models):
    """Qwen3-VL's tower loaded alone gives the full HF model's visual output: the merger's rows, then
    each DeepStack level's, side by side (what vLLM's Qwen3-VL takes as image_embeds and splits)."""
    from mmserve.encoder import Towers
    from mmserve_dev.hf_reference import HFReference

    reference = HFReference("qwen3_vl", tiny_models["qwen3_vl"])
    towers = Towers(tiny_models["qwen3_vl"])
    tensors = _preprocessed(tiny_models["qwen3_vl"], images=[encode_image(sample_image(7, size=(256, 192)))])
    pixels, grid = torch.from_numpy(tensors["pixel_values"]), torch.from_numpy(tensors["image_grid_thw"])
    with torch.inference_mode():
        out = reference.model.model.visual(pixels, grid_thw=grid)
    want = torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)
    got = towers.image(tensors["pixel_values"], tensors["image_grid_thw"])
    assert got.shape == (int(grid.prod()) // 4, 128 * 2)  # hidden x (1 + 1 DeepStack level)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_family_without_towers_says_so(tiny_models, monkeypatch):
    """A family that declares no towers (a user's own, say) can't be encoded apart."""
    import dataclasses

    from mmserve import encoder
    from mmserve.families import get_family

    assert json.loads((tiny_models["qwen2_audio"] / "config.json").read_text())["architectures"]
    bare = dataclasses.replace(get_family("qwen2_audio"), towers=())
    monkeypatch.setattr(encoder, "family_of_checkpoint", lambda path: bare)
    with pytest.raises(ValueError, match="qwen2_audio: no encoder towers declared"):
        encoder.Towers(tiny_models["qwen2_audio"])


def test_the_gpu_benchmark_runs_without_a_gpu(tiny_models):
    """``bench/encode_gpu.py`` says there is no CUDA device, gives the CPU figures and exits 0."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "encode_gpu.py"
    run = subprocess.run(
        [sys.executable, str(script), "--model", str(tiny_models["qwen2_5_omni"]), "--images", "2", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    if not torch.cuda.is_available():
        assert "no CUDA device here" in run.stdout
    assert "| cpu | float32 | image |" in run.stdout and "| cpu | float32 | audio |" in run.stdout


# -- the Encoder (what the encode model runs): preprocess's outputs -> the fields mm_llm takes ---------
def test_the_encoder_gives_the_towers_embeddings_item_by_item_through_its_cache(omni_towers, tiny_models):
    """From ``preprocess``'s outputs as it sends them (uint8 patches): the same embeddings as the
    towers on the decoded tensors, exactly; a second call is all cache hits and gives the same
    arrays; ``encoded`` replaces the consumed features and keeps the rest."""
    from mmserve.encoder import Encoder
    from mmserve.serving.preprocess import Preprocessor

    preprocessor = Preprocessor(tiny_models["qwen2_5_omni"])
    wire = preprocessor(
        "Describe.",
        images=[encode_image(sample_image(3)), encode_image(sample_image(4))],
        audios=[encode_audio(sample_audio(4, seconds=2.0)), encode_audio(sample_audio(5, seconds=1.0))],
        videos=[encode_video(sample_video(5, frames=4))],
    )
    assert wire["pixel_values_uint8"].size
    encoder = Encoder(omni_towers)
    first = encoder(wire)
    decoded = preprocessor.decode_wire(wire)  # the towers on all items at once, no cache
    want = {
        "image": omni_towers.image(decoded["pixel_values"], decoded["image_grid_thw"]),
        "video": omni_towers.video(decoded["pixel_values_videos"], decoded["video_grid_thw"]),
        "audio": omni_towers.audio(decoded["input_features"], decoded["feature_attention_mask"]),
    }
    for modality in ("image", "video", "audio"):
        np.testing.assert_array_equal(first[f"{modality}_embeds"], want[modality].numpy())
    np.testing.assert_array_equal(first["audio_feature_lengths"], wire["feature_attention_mask"].sum(-1))
    assert encoder.stats.misses == {"image": 2, "video": 1, "audio": 2} and sum(encoder.stats.hits.values()) == 0
    second = encoder(wire)
    assert encoder.stats.hits == {"image": 2, "video": 1, "audio": 2}
    assert all(np.array_equal(first[name], second[name]) for name in first)
    handed_on = encoder.encoded(wire)
    assert encoder.consumed == {
        "pixel_values",
        "pixel_values_uint8",
        "pixel_values_videos",
        "input_features",
        "feature_attention_mask",
    }
    assert not encoder.consumed & set(handed_on) and set(first) <= set(handed_on)
    assert handed_on["input_ids"] is wire["input_ids"] and handed_on["image_grid_thw"] is wire["image_grid_thw"]


def test_the_cache_holds_at_most_its_bytes_and_evicts_the_oldest(omni_towers, tiny_models):
    from mmserve.encoder import Encoder
    from mmserve.serving.preprocess import Preprocessor

    preprocessor = Preprocessor(tiny_models["qwen2_5_omni"])
    requests = [preprocessor("Describe.", images=[encode_image(sample_image(seed))]) for seed in range(3)]
    one = Encoder(omni_towers, cache_bytes=0)(requests[0])["image_embeds"].nbytes
    encoder = Encoder(omni_towers, cache_bytes=2 * one)  # room for two images
    for request in requests:
        encoder(request)
    assert encoder.stats.bytes == 2 * one and encoder.stats.misses["image"] == 3
    encoder(requests[2])  # the newest: kept
    encoder(requests[0])  # the oldest: evicted, encoded again
    assert encoder.stats.hits["image"] == 1 and encoder.stats.misses["image"] == 4
    assert encoder.stats.bytes <= 2 * one
    uncached = Encoder(omni_towers, cache_bytes=0)
    uncached(requests[0])
    uncached(requests[0])
    assert uncached.stats.bytes == 0 and uncached.stats.misses["image"] == 2


def test_the_encode_service_answers_only_what_it_encoded(tiny_models):
    """A Qwen2.5-VL checkpoint has no audio tower: no audio outputs; a request without media gets
    none at all (Triton's ensemble hands mm_llm a missing output as an absent optional input)."""
    from mmserve.serving.encode import EncodeService, EncodeSettings
    from mmserve.serving.preprocess import Preprocessor

    service = EncodeService(str(tiny_models["qwen2_5_vl"]), EncodeSettings.from_parameters({"device": "cpu"}))
    wire = Preprocessor(tiny_models["qwen2_5_vl"])("Describe.", images=[encode_image(sample_image(9))])
    outputs = service(wire.get)
    assert list(outputs) == ["image_embeds"]
    assert outputs["image_embeds"].shape[0] == int(wire["image_grid_thw"].prod()) // 4  # a row per placeholder
    text_only = Preprocessor(tiny_models["qwen2_5_vl"])("Hello.")
    assert service(text_only.get) == {}
    assert service.stats_delta()["image"] == (0, 1) and service.stats_delta()["image"] == (0, 0)


def test_encode_settings_are_checked():
    from mmserve.serving.encode import EncodeSettings

    assert EncodeSettings.from_parameters({"device": "cpu", "dtype": "", "cache_bytes": ""}).cache_bytes == 256 << 20
    with pytest.raises(ValueError, match="parameter dtype: expected one of"):
        EncodeSettings.from_parameters({"dtype": "float64"})
    with pytest.raises(ValueError, match="parameter cache_bytes: expected a number of bytes"):
        EncodeSettings.from_parameters({"cache_bytes": "1GB"})


def test_qwen2_audio_tower_and_projector(tiny_models):
    """Qwen2-Audio's tower reads each clip's whole 30-s window with the padding masked, then its
    projector: the rows of each clip's valid frames = what the HF model's forward merges into the
    prompt (computed here as it does), exactly; the Encoder gives the same per clip."""
    from transformers.masking_utils import create_bidirectional_mask

    from mmserve.encoder import Encoder, Towers
    from mmserve_dev.hf_reference import HFReference

    reference = HFReference("qwen2_audio", tiny_models["qwen2_audio"])
    tensors = _preprocessed(
        tiny_models["qwen2_audio"],
        audios=[encode_audio(sample_audio(4, seconds=2.0)), encode_audio(sample_audio(5, seconds=1.0))],
    )
    features, mask = (torch.from_numpy(tensors[name]) for name in ("input_features", "feature_attention_mask"))
    model = reference.model.model
    with torch.inference_mode():
        after_cnn, outputs = model.audio_tower._get_feat_extract_output_lengths(mask.sum(-1))
        steps = (features.shape[-1] - 2) // 2 + 1
        valid = (torch.arange(steps)[None, :] < after_cnn[:, None]).long()
        attention = create_bidirectional_mask(
            config=model.audio_tower.config, inputs_embeds=torch.zeros(len(features), steps, 1), attention_mask=valid
        )
        hidden = model.multi_modal_projector(model.audio_tower(features, attention_mask=attention).last_hidden_state)
        want = hidden[torch.arange(hidden.shape[1])[None, :] < outputs[:, None]]
    towers = Towers(tiny_models["qwen2_audio"])
    assert "audio" in towers.projectors and towers.modalities == ("audio",)
    torch.testing.assert_close(towers.audio(features, mask), want, rtol=0, atol=0)
    encoded = Encoder(towers, cache_bytes=0)(tensors)
    np.testing.assert_array_equal(encoded["audio_embeds"], want.numpy())


def test_qwen3_omni_towers_give_the_thinkers_embeddings(tiny_models):
    """Qwen3-Omni's vision tower (its DeepStack levels beside the merger's rows) and audio tower (13 rows
    per 100 frames) loaded alone = the HF thinker's ``get_image_features``, ``get_video_features`` and
    ``get_audio_features`` on ``preprocess``'s tensors, exactly; a clip longer than one 100-frame
    window and one shorter."""
    from mmserve.encoder import Encoder, Towers
    from mmserve_dev.hf_reference import HFReference

    path = tiny_models["qwen3_omni"]
    reference = HFReference("qwen3_omni", path)
    tensors = _preprocessed(
        path,
        images=[encode_image(sample_image(3, size=(96, 64)))],
        audios=[encode_audio(sample_audio(4, seconds=2.3)), encode_audio(sample_audio(6, seconds=0.5))],
        videos=[encode_video(sample_video(5, frames=4))],
    )
    encoded = Encoder(Towers(path), cache_bytes=0)(tensors)
    model = reference.model
    t = {name: torch.from_numpy(np.asarray(value)) for name, value in tensors.items()}

    def vision(out):
        return torch.cat([torch.cat(out.pooler_output), *(torch.cat(level) for level in out.deepstack_features)], -1)

    with torch.inference_mode():
        image = vision(model.get_image_features(t["pixel_values"], t["image_grid_thw"]))
        video = vision(model.get_video_features(t["pixel_values_videos"], t["video_grid_thw"]))
        audio = model.get_audio_features(t["input_features"], t["feature_attention_mask"]).last_hidden_state
    np.testing.assert_array_equal(encoded["image_embeds"], image.numpy())
    np.testing.assert_array_equal(encoded["video_embeds"], video.numpy())
    np.testing.assert_array_equal(encoded["audio_embeds"], audio.numpy())
    np.testing.assert_array_equal(encoded["audio_feature_lengths"], t["feature_attention_mask"].sum(-1).numpy())
    vocab = reference.processor.tokenizer.get_vocab()
    ids = tensors["input_ids"].tolist()
    for modality in ("image", "video", "audio"):
        assert len(encoded[f"{modality}_embeds"]) == ids.count(vocab[f"<|{modality}_pad|>"])


def test_internvl_tower_gives_the_models_tile_embeddings(tiny_models):
    """InternVL's tower, pixel shuffle and projector loaded alone = the HF model's
    ``get_image_features`` on the tiles of two images of different tile counts, exactly; the Encoder
    gives each image its tiles' rows, through its cache too."""
    from mmserve.encoder import Encoder, Towers
    from mmserve_dev.hf_reference import HFReference

    path = tiny_models["internvl"]
    reference = HFReference("internvl", path)
    tensors = _preprocessed(
        path, images=[encode_image(sample_image(7, size=(448, 224))), encode_image(sample_image(8, size=(64, 64)))]
    )
    tiles = tensors["image_num_patches"].tolist()
    assert len(set(tiles)) == 2, tiles
    config = reference.model.config
    side = config.vision_config.image_size[0]
    with torch.inference_mode():
        want = reference.model.model.get_image_features(
            torch.from_numpy(tensors["pixel_values"]).reshape(-1, 3, side, side),
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
        ).pooler_output
    want = want.reshape(-1, want.shape[-1])
    encoder = Encoder(Towers(path))
    encoded = encoder(tensors)
    np.testing.assert_array_equal(encoded["image_embeds"], want.numpy())
    assert len(want) == sum(tiles) * config.image_seq_length
    again = encoder(tensors)
    assert encoder.stats.hits["image"] == 2 and encoder.stats.misses["image"] == 2
    np.testing.assert_array_equal(again["image_embeds"], want.numpy())


def test_audioflamingo3_tower_gives_the_models_windows(tiny_models):
    """Audio Flamingo 3's Whisper tower and projector loaded alone = the HF model's
    ``get_audio_features`` (each 30-s window's valid rows), exactly, for a clip of two windows and a
    short one (its processor takes one clip per prompt); the Encoder gives each clip its windows' rows
    and its valid frames over them."""
    from mmserve.encoder import Encoder, Towers
    from mmserve.families.qwen import whisper_output_length
    from mmserve_dev.hf_reference import HFReference

    path = tiny_models["audioflamingo3"]
    reference = HFReference("audioflamingo3", path)
    encoder = Encoder(Towers(path), cache_bytes=0)
    for seconds, windows in ((31.0, 2), (1.5, 1)):
        tensors = _preprocessed(path, audios=[encode_audio(sample_audio(4, seconds=seconds))])
        assert tensors["chunk_counts"].tolist() == [windows]
        features, mask = (torch.from_numpy(tensors[name]) for name in ("input_features", "feature_attention_mask"))
        with torch.inference_mode():
            want = reference.model.get_audio_features(features, mask).pooler_output
        encoded = encoder(tensors)
        np.testing.assert_array_equal(encoded["audio_embeds"], want.numpy())
        assert encoded["audio_feature_lengths"].tolist() == [int(mask.sum())]
        assert len(want) == whisper_output_length(int(mask.sum()))

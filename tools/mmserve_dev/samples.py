"""Deterministic sample media (and a sample tool) for tests, benchmarks and the README's example client call."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

AUDIO_SAMPLE_RATE = 16_000
"""The rate of every family's Whisper-style feature extractor: the tiny checkpoints are built with it,
the HF reference takes audio at it, and sample clips are made at it."""


def sample_image(seed: int = 0, size: tuple[int, int] = (112, 84)) -> Image.Image:
    """An RGB image of smooth colour gradients plus seeded noise (width, height = ``size``)."""
    rng = np.random.default_rng(seed)
    width, height = size
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack(
        [(x * (3 + seed % 5)) % 256, (y * (2 + seed % 7)) % 256, ((x + y) * (1 + seed % 3)) % 256],
        axis=-1,
    )
    noise = rng.integers(0, 64, size=(height, width, 3))
    return Image.fromarray(((base + noise) % 256).astype(np.uint8), "RGB")


def sample_audio(seed: int = 0, seconds: float = 1.0, sample_rate: int = AUDIO_SAMPLE_RATE) -> np.ndarray:
    """A mono float32 clip: two seeded tones plus a little noise, in [-1, 1]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    f1, f2 = 220 + 40 * (seed % 11), 550 + 70 * (seed % 5)
    wave = 0.5 * np.sin(2 * np.pi * f1 * t) + 0.3 * np.sin(2 * np.pi * f2 * t)
    wave += 0.05 * rng.standard_normal(t.shape)
    return (wave / np.abs(wave).max()).astype(np.float32)


def encode_image(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def encode_audio(wave: np.ndarray, sample_rate: int = AUDIO_SAMPLE_RATE, fmt: str = "WAV") -> bytes:
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, wave, sample_rate, format=fmt)
    return buffer.getvalue()


def decode_audio(data: bytes) -> np.ndarray:
    """The float32 samples an audio file holds (what a decoder gets back from ``encode_audio``'s
    16-bit WAV: the wave quantized)."""
    import soundfile

    return soundfile.read(io.BytesIO(data), dtype="float32")[0]


VIDEO_FPS = 12
"""The frame rate of sample videos."""


def sample_video(seed: int = 0, frames: int = 4, size: tuple[int, int] = (112, 84)) -> np.ndarray:
    """``frames`` RGB frames (frames, height, width, 3) uint8 of a seeded colour drifting over time
    (width, height = ``size``)."""
    rng = np.random.default_rng(seed)
    width, height = size
    base = rng.integers(0, 255, (1, height, width, 3)).astype(np.int16)
    drift = rng.integers(-20, 20, (frames, 1, 1, 3)).cumsum(0)
    return np.clip(base + drift, 0, 255).astype(np.uint8)


def encode_video(
    frames: np.ndarray,
    fps: int = VIDEO_FPS,
    *,
    codec: str = "png",
    fmt: str = "mov",
    audio: np.ndarray | None = None,
    sample_rate: int = AUDIO_SAMPLE_RATE,
) -> bytes:
    """A video file of ``frames`` (PyAV). The default, PNG frames in MOV, is lossless: decoding gives
    back exactly ``frames``; ``codec="mpeg4", fmt="mp4"`` makes a small everyday MP4. ``audio``: a
    mono float32 track at ``sample_rate`` beside them, stored losslessly (32-bit float PCM)."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "rgb24" if codec == "png" else "yuv420p"
        track = None
        if audio is not None:
            track = container.add_stream("pcm_f32le", rate=sample_rate, layout="mono")
            assert isinstance(track, av.AudioStream)
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
        if track is not None and audio is not None:
            samples = av.AudioFrame.from_ndarray(
                np.asarray(audio, np.float32).reshape(1, -1), format="flt", layout="mono"
            )
            samples.sample_rate = sample_rate
            container.mux(track.encode(samples))
            container.mux(track.encode())
    return out.getvalue()


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
"""A sample function tool (OpenAI's form), for the tool-calling tests and ``bench/openai_parity.py``."""

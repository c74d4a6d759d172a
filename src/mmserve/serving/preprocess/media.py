"""Media elements -> what the HF processor takes: images as RGB, audio as mono float32 at the
feature extractor's rate, videos as RGB frames with their frame rate. Untrusted bytes meet only the
decoders named here, and every size is checked before the pixels or samples are decoded (for a
video: its declared frame size and length, then every frame as it comes)."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from mmserve.dataurl import data_url_payload, is_data_url
from mmserve.serving.preprocess.limits import PreprocessError, PreprocessLimits
from mmserve.serving.preprocess.messages import BYTES_LIKE

if TYPE_CHECKING:
    from PIL.Image import Image

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
"""The only image decoders ever tried (no EPS/Ghostscript, no exotic plugins on untrusted bytes)."""
MAX_SAMPLE_RATE = 768_000
"""Highest accepted sample rate (Hz) of an audio clip."""
MAX_VIDEO_FPS = 1000.0
"""Highest accepted frame rate of a video (a file declaring more is refused)."""


VIDEO_FORMATS = "MP4/MOV/WebM/MKV"
"""What ``video`` elements are (any container and codec the bundled FFmpeg of PyAV decodes)."""


@dataclass
class Clip:
    """One decoded audio clip: mono float32 at the feature extractor's rate."""

    label: str  # "audio[0]", "audio_pcm[0]"
    samples: np.ndarray
    seconds: float  # duration as received


@dataclass
class Video:
    """One decoded video: RGB frames (frames, height, width, 3) uint8 and what the processor needs
    of its metadata."""

    label: str  # "video[0]"
    frames: np.ndarray
    fps: float
    audio: Clip | None = None
    """Its audio track, when asked for (``use_audio_in_video``)."""

    @property
    def seconds(self) -> float:
        return len(self.frames) / self.fps

    def metadata(self) -> dict[str, Any]:
        """transformers' ``VideoMetadata`` fields: the processor samples frames and times the video by them."""
        frames, height, width, _ = self.frames.shape
        return {"total_num_frames": frames, "fps": self.fps, "width": width, "height": height}


def payload_bytes(data: bytes | str) -> bytes:
    """A media element's file bytes: the element itself, or the content of a base64 data URL."""
    if isinstance(data, str):
        data = data.encode()
    if not isinstance(data, BYTES_LIKE):
        raise TypeError(f"expected bytes or a data URL, found {type(data).__name__}")
    return data_url_payload(data) if is_data_url(data) else bytes(data)


@dataclass(frozen=True)
class MediaDecoder:
    """Decodes one request's media within ``limits``.

    ``max_audio_seconds``: the longest clip (the configured limit or the model's window);
    ``audio_window_s``: the model's window, named in the error when it is the limit;
    ``sampling_rate``: the feature extractor's (None: the model takes no audio).
    """

    limits: PreprocessLimits
    max_audio_seconds: float
    audio_window_s: float | None
    sampling_rate: int | None

    # -- images --------------------------------------------------------------------------------
    def image(self, index: int, data: bytes | str) -> Image:
        """``image[index]`` as RGB, its pixel count checked from the header before decoding."""
        from PIL import Image as PILImage

        what = f"image[{index}]"
        payload = _payload(what, data)
        try:
            with PILImage.open(io.BytesIO(payload), formats=IMAGE_FORMATS) as image:
                self._check_image_pixels(what, *image.size)
                return image.convert("RGB")
        except (PreprocessError, MemoryError):
            raise
        except (PILImage.DecompressionBombError, PILImage.DecompressionBombWarning):
            raise PreprocessError(self._pil_refused(what, payload)) from None
        except PILImage.UnidentifiedImageError:
            raise PreprocessError(_undecodable_image(what, payload)) from None
        except Exception as exc:  # noqa: BLE001 - any decoder failure on untrusted bytes is the client's
            raise PreprocessError(f"{_undecodable_image(what, payload)}: {exc}") from None

    def _pil_refused(self, what: str, payload: bytes) -> str:
        """PIL's own (global) bomb check refused the image: say whose limit it is over."""
        size = _declared_size(payload)
        if size is None:
            return f"{what}: more pixels than the image decoder accepts (PIL.Image.MAX_IMAGE_PIXELS)"
        width, height = size
        limit = self.limits.max_image_pixels
        if width * height > limit:
            return f"{what}: {width * height} pixels ({width}x{height}) exceeds the limit of {limit} (max_image_pixels)"
        return (
            f"{what}: {width * height} pixels ({width}x{height}) exceeds the image decoder's own limit "
            "(PIL.Image.MAX_IMAGE_PIXELS)"
        )

    def _check_image_pixels(self, what: str, width: int, height: int) -> None:
        limit = self.limits.max_image_pixels
        if width * height > limit:
            raise PreprocessError(
                f"{what}: {width * height} pixels ({width}x{height}) exceeds the limit of {limit} (max_image_pixels)"
            )

    # -- video ---------------------------------------------------------------------------------
    def video(self, index: int, data: bytes | str, *, with_audio: bool = False) -> Video:
        """``video[index]``'s frames as RGB, within ``max_video_frame_pixels`` (declared, then per
        frame), ``max_video_seconds`` (declared, then by the frames decoded) and
        ``max_video_frames`` (decoding stops one frame past it); ``with_audio``: its audio track
        too, as an audio clip (``video[index].audio``, within the clip limits)."""
        import av

        what = f"video[{index}]"
        payload = _payload(what, data)
        try:
            with av.open(io.BytesIO(payload), mode="r") as container:
                if not container.streams.video:
                    raise PreprocessError(f"{what}: no video stream in {len(payload)} bytes (an audio-only file?)")
                stream = container.streams.video[0]
                self._check_frame_pixels(what, stream.codec_context.width, stream.codec_context.height)
                rate = stream.average_rate or stream.guessed_rate
                fps = float(rate) if rate else 0.0
                if not 0 < fps <= MAX_VIDEO_FPS:
                    raise PreprocessError(f"{what}: expected a frame rate in (0, {MAX_VIDEO_FPS}] fps, found {fps:g}")
                declared = float(stream.duration * stream.time_base) if stream.duration and stream.time_base else 0.0
                if declared > self.limits.max_video_seconds:
                    self._video_too_long(what, declared)
                frames: list[np.ndarray] = []
                for frame in container.decode(stream):
                    self._check_frame_pixels(what, frame.width, frame.height)
                    if len(frames) == self.limits.max_video_frames:
                        raise PreprocessError(
                            f"{what}: more than {self.limits.max_video_frames} frames "
                            f"(max_video_frames; sample the video down before sending it)"
                        )
                    frames.append(frame.to_ndarray(format="rgb24"))
                    if len(frames) / fps > self.limits.max_video_seconds:
                        self._video_too_long(what, None)
        except (PreprocessError, MemoryError):
            raise
        except Exception as exc:  # noqa: BLE001 - any decoder failure on untrusted bytes is the client's
            raise PreprocessError(
                f"{what}: cannot decode {len(payload)} bytes as a video ({VIDEO_FORMATS}): {exc}"
            ) from None
        if not frames:
            raise PreprocessError(f"{what}: no frame could be decoded from {len(payload)} bytes")
        if len({f.shape for f in frames}) > 1:
            raise PreprocessError(f"{what}: frames of different sizes ({sorted({f.shape[:2] for f in frames})[:3]})")
        return Video(what, np.stack(frames), fps, self._audio_track(what, payload) if with_audio else None)

    def _audio_track(self, what: str, payload: bytes) -> Clip:
        """A video file's first audio stream, mixed down to mono float32 (its own rate; ``_clip``
        resamples), read no further than the clip limit."""
        import av

        what = f"{what}.audio"
        chunks: list[np.ndarray] = []
        try:
            with av.open(io.BytesIO(payload), mode="r") as container:
                if not container.streams.audio:
                    raise PreprocessError(f"{what}: the video has no audio track (use_audio_in_video)")
                stream = container.streams.audio[0]
                rate = _check_rate(what, stream.rate)
                limit = math.floor(self.max_audio_seconds * rate)
                mono = av.AudioResampler(format="flt", layout="mono", rate=rate)
                read = 0
                for frame in container.decode(stream):
                    for out in mono.resample(frame):
                        chunks.append(out.to_ndarray().reshape(-1))
                        read += chunks[-1].size
                    if read > limit:
                        self._too_long(what, None)
        except (PreprocessError, MemoryError):
            raise
        except Exception as exc:  # noqa: BLE001 - any decoder failure on untrusted bytes is the client's
            raise PreprocessError(f"{what}: cannot decode the audio track: {exc}") from None
        if not chunks:
            raise PreprocessError(f"{what}: the audio track has no samples")
        return self._clip(what, np.concatenate(chunks), rate)

    def _check_frame_pixels(self, what: str, width: int, height: int) -> None:
        limit = self.limits.max_video_frame_pixels
        if width * height > limit:
            raise PreprocessError(
                f"{what}: frames of {width * height} pixels ({width}x{height}) exceed the limit of {limit} "
                "(max_video_frame_pixels)"
            )

    def _video_too_long(self, what: str, seconds: float | None) -> NoReturn:
        length = "the video" if seconds is None else f"{seconds:.2f} s"
        raise PreprocessError(
            f"{what}: {length} exceeds the limit of {self.limits.max_video_seconds:g} s (max_video_seconds)"
        )

    # -- audio ---------------------------------------------------------------------------------
    def clips(self, audios: Sequence[bytes | str], pcm: Sequence[tuple[np.ndarray, int]]) -> list[Clip]:
        """``audio`` (encoded files) then ``audio_pcm`` (samples, rate) clips, within the limits."""
        clips = [self._decode_audio(f"audio[{i}]", data) for i, data in enumerate(audios)]
        clips += [self._clip(f"audio_pcm[{i}]", samples, rate) for i, (samples, rate) in enumerate(pcm)]
        total, limit = sum(clip.seconds for clip in clips), self.limits.max_total_audio_seconds
        if total > limit:
            raise PreprocessError(
                f"audio: {total:.1f} s in total exceeds the limit of {limit:.1f} s (max_total_audio_seconds)"
            )
        return clips

    def _decode_audio(self, what: str, data: bytes | str) -> Clip:
        import soundfile

        payload = _payload(what, data)
        try:
            with soundfile.SoundFile(io.BytesIO(payload)) as sound:
                rate = _check_rate(what, sound.samplerate)
                limit = math.floor(self.max_audio_seconds * rate)
                if sound.frames > limit:  # the header's length; the read below is bounded anyway
                    self._too_long(what, sound.frames / rate)
                samples = sound.read(frames=limit + 1, dtype="float32", always_2d=True)
        except (PreprocessError, MemoryError):
            raise
        except Exception as exc:  # noqa: BLE001 - any decoder failure on untrusted bytes is the client's
            raise PreprocessError(
                f"{what}: cannot decode {len(payload)} bytes as audio (WAV/FLAC/OGG/MP3): "
                f"{str(exc).rsplit(': ', 1)[-1]}"
            ) from None
        if len(samples) > limit:
            self._too_long(what, None)
        return self._clip(what, samples.mean(axis=1), rate)

    def _clip(self, what: str, samples: np.ndarray, rate: int) -> Clip:
        samples = np.asarray(samples, dtype=np.float32)
        if samples.ndim != 1 or samples.size == 0:
            raise PreprocessError(f"{what}: expected a non-empty mono clip, found shape {samples.shape}")
        rate = _check_rate(what, rate)
        seconds = samples.size / rate
        if seconds > self.max_audio_seconds:
            self._too_long(what, seconds)
        if not np.isfinite(samples).all():
            bad = int(np.count_nonzero(~np.isfinite(samples)))
            raise PreprocessError(f"{what}: {bad} non-finite samples (NaN/Inf)")
        if self.sampling_rate is not None and rate != self.sampling_rate:
            import soxr

            samples = soxr.resample(samples, rate, self.sampling_rate).astype(np.float32, copy=False)
        return Clip(what, samples, seconds)

    def _too_long(self, what: str, seconds: float | None) -> NoReturn:
        """``seconds``: the clip's length, None when only known to be longer than the limit."""
        limit = self.max_audio_seconds
        name = "max_audio_seconds"
        if self.audio_window_s is not None and limit == self.audio_window_s:
            name += "; the model's audio window"
        length = "the clip" if seconds is None else f"{seconds:.1f} s"
        if seconds is not None and round(seconds, 1) <= limit:  # just over: show the difference
            length = f"{seconds:.6f} s"
        raise PreprocessError(f"{what}: {length} exceeds the limit of {limit:.1f} s per clip ({name})")


def _check_rate(what: str, rate: Any) -> int:
    try:
        rate = int(rate)
    except (TypeError, ValueError, OverflowError):
        raise PreprocessError(f"{what}: expected an integer sample rate, found {rate!r}") from None
    if not 0 < rate <= MAX_SAMPLE_RATE:
        raise PreprocessError(f"{what}: expected a positive sample rate of at most {MAX_SAMPLE_RATE} Hz, found {rate}")
    return rate


def _payload(what: str, data: bytes | str) -> bytes:
    try:
        return payload_bytes(data)
    except (ValueError, TypeError) as exc:
        raise PreprocessError(f"{what}: {exc}") from None


def _undecodable_image(what: str, payload: bytes) -> str:
    return f"{what}: cannot decode {len(payload)} bytes as an image ({'/'.join(IMAGE_FORMATS)})"


def _declared_size(payload: bytes) -> tuple[int, int] | None:
    """The size an image's header declares, read without PIL's global bomb check (error path only:
    ``PIL.Image.open`` refused to say). Uses PIL's registry of format plugins."""
    from PIL import Image

    Image.init()
    for name in IMAGE_FORMATS:
        factory, accept = Image.OPEN.get(name, (None, None))
        accepted = accept is None or accept(payload[:16])  # a str: "yes, but can't open it"
        if factory is not None and accepted and not isinstance(accepted, str):
            try:
                with factory(io.BytesIO(payload), "") as image:
                    return image.size
            except Exception:  # noqa: BLE001 - not a valid file of this format
                return None
    return None

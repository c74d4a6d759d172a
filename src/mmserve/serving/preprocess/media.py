"""Media elements -> what the HF processor takes: images as RGB, audio as mono float32 at the
feature extractor's rate, videos as the RGB frames the processor keeps, with their frame rate.

Untrusted bytes meet only the parsers named here, chosen from the file's first bytes: PIL's
``IMAGE_FORMATS``; for audio, libsndfile only after the bytes are sniffed as WAV, FLAC, Ogg or MP3
(``AUDIO_FORMATS``); for video, FFmpeg's MP4/MOV or WebM/MKV demuxer forced by the sniffed header
(no other demuxer is probed: no concat/ffconcat, image2pipe, yuv4mpegpipe, HLS, ...), reading only
the request's bytes, and only the decoders of ``VIDEO_CODECS`` (``AUDIO_IN_VIDEO_CODECS`` for a
video's audio track). Every size is checked before the pixels or samples are decoded, and the bytes
decoding creates (RGB of images and of the video frames kept, float32 samples of audio files) are
counted against the request's ``max_decoded_bytes`` before they are allocated, and the placeholder
tokens of images and videos against ``max_prompt_tokens`` before they are decoded
(``RequestBudget``). A video's frames are all decoded, but only those the HF video processor keeps
(``ProcessorPlan``) are converted to RGB and held."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import numpy as np

from mmserve.dataurl import data_url_payload, is_data_url
from mmserve.serving.preprocess.limits import PreprocessError, PreprocessLimits
from mmserve.serving.preprocess.messages import BYTES_LIKE

if TYPE_CHECKING:
    from av.container import InputContainer
    from PIL.Image import Image

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
"""The only image decoders ever tried (no EPS/Ghostscript, no exotic plugins on untrusted bytes)."""
MAX_SAMPLE_RATE = 768_000
"""Highest accepted sample rate (Hz) of an audio clip."""
MAX_VIDEO_FPS = 1000.0
"""Highest accepted frame rate of a video (a file declaring more is refused)."""

VIDEO_FORMATS = "MP4/MOV/WebM/MKV"
"""What ``video`` elements are: the containers below, with a codec of ``VIDEO_CODECS``."""
VIDEO_CONTAINERS = {"mov": "MP4/MOV", "matroska": "WebM/MKV"}
"""FFmpeg's demuxer for each accepted container (forced: no other demuxer is probed)."""
VIDEO_CODECS: dict[str, tuple[str, ...]] = {
    "h264": ("h264",),
    "hevc": ("hevc",),
    "vp8": ("vp8", "libvpx"),
    "vp9": ("vp9", "libvpx-vp9"),
    "av1": ("libdav1d", "av1"),
    "mpeg4": ("mpeg4",),
    "png": ("png",),  # lossless clips (mmserve_dev.samples.encode_video's default)
}
"""Accepted video codecs (FFmpeg's codec names) and the decoders FFmpeg may pick for each."""
_PCM = ("u8", "s8", "s16le", "s16be", "s24le", "s24be", "s32le", "s32be", "f32le", "f32be", "f64le", "f64be")
AUDIO_IN_VIDEO_CODECS: dict[str, tuple[str, ...]] = {
    "aac": ("aac", "aac_fixed"),
    "mp3": ("mp3float", "mp3"),
    "opus": ("opus", "libopus"),
    "vorbis": ("vorbis", "libvorbis"),
    "flac": ("flac",),
    **{f"pcm_{kind}": (f"pcm_{kind}",) for kind in _PCM},
}
"""Accepted codecs of a video's audio track (``use_audio_in_video``), as ``VIDEO_CODECS``."""
_DEMUXER_OPTIONS = {
    # No decoder outside the lists is opened, not even by the demuxer's own probing of the streams.
    "codec_whitelist": ",".join(
        sorted({d for ds in (*VIDEO_CODECS.values(), *AUDIO_IN_VIDEO_CODECS.values()) for d in ds})
    ),
    # The data come from the request's bytes (a BytesIO): no file or URL is ever opened.
    "protocol_whitelist": "none",
}
_MOV_OPTIONS = {"enable_drefs": "0", "use_absolute_path": "0"}  # no external data references (FFmpeg's default, stated)

AUDIO_FORMATS: dict[str, tuple[str, ...]] = {
    "WAV": ("PCM_U8", "PCM_16", "PCM_24", "PCM_32", "FLOAT", "DOUBLE", "ULAW", "ALAW"),
    "FLAC": ("PCM_S8", "PCM_16", "PCM_24"),
    "OGG": ("VORBIS", "OPUS"),
    "MP3": ("MPEG_LAYER_I", "MPEG_LAYER_II", "MPEG_LAYER_III"),
}
"""The audio files libsndfile is given (sniffed from the first bytes: RIFF/WAVE, fLaC, OggS, an ID3
tag or an MPEG audio frame), and the encodings accepted in each."""
_LIBSNDFILE_FORMATS = {"WAV": ("WAV", "WAVEX"), "FLAC": ("FLAC",), "OGG": ("OGG",), "MP3": ("MP3",)}

_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"YUV4MPEG2", "a YUV4MPEG2 video"),
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF8", "a GIF image"),
    (b"ffconcat", "an ffconcat script"),
    (b"#EXTM3U", "an M3U/HLS playlist"),
    (b".snd", "a Sun AU file"),
    (b"caff", "a CAF file"),
    (b"RF64", "an RF64 file"),
    (b"fLaC", "a FLAC file"),
    (b"OggS", "an Ogg file"),
    (b"\x1aE\xdf\xa3", "a WebM/MKV file"),
    (b"\x00\x00\x01\xba", "an MPEG program stream"),
)
"""Headers named in refusals (what was found)."""


class ProcessorPlan(Protocol):
    """What the HF processor will make of a medium, asked before the medium is decoded."""

    def kept(self, total: int, fps: float, width: int, height: int) -> list[int] | None:
        """Indices of the frames the video processor keeps of ``total`` (its own sampling); None: all."""

    def video_tokens(self, frames: int, width: int, height: int) -> int | None:
        """Placeholder tokens of ``frames`` kept frames of that size; None: not known before processing."""

    def image_tokens(self, width: int, height: int) -> int | None:
        """Placeholder tokens of an image of that size; None: not known before processing."""


class RequestBudget:
    """What one request's media may take, each item counted before it is decoded: the bytes
    decoding creates (``max_decoded_bytes``: RGB of images and of the video frames kept, float32
    samples of audio files) and the placeholder tokens of images and videos where the processor's
    count is known beforehand (``max_prompt_tokens``: the processor's work and output grow with
    them)."""

    def __init__(self, max_bytes: int, max_tokens: int) -> None:
        self.max_bytes, self.max_tokens = max_bytes, max_tokens
        self.bytes = self.tokens = 0

    def take(self, what: str, content: str, nbytes: int, kind: str, tokens: int | None = None) -> tuple[int, int]:
        """Count ``nbytes`` of ``kind`` and ``tokens`` for ``what`` (``content`` says what it is), or
        refuse it; returns what was taken (for ``give_back``)."""
        left = self.max_bytes - self.bytes
        if nbytes > left:
            over = f"over the limit of {self.max_bytes} decoded bytes per request (max_decoded_bytes)"
            if self.bytes:
                over = (
                    f"over the {left} left of the limit of {self.max_bytes} decoded bytes per request "
                    f"(max_decoded_bytes; the items before it took {self.bytes})"
                )
            raise PreprocessError(f"{what}: {content} decode to {nbytes} bytes ({kind}), {over}")
        tokens = tokens or 0
        left = self.max_tokens - self.tokens
        if tokens > left:
            over = f"over the limit of {self.max_tokens} prompt tokens (max_prompt_tokens)"
            if self.tokens:
                over = (
                    f"over the {left} left of the limit of {self.max_tokens} prompt tokens "
                    f"(max_prompt_tokens; the media before it make {self.tokens})"
                )
            raise PreprocessError(f"{what}: {content} make {tokens} placeholder tokens, {over}")
        self.bytes += nbytes
        self.tokens += tokens
        return nbytes, tokens

    def give_back(self, taken: tuple[int, int]) -> None:
        self.bytes -= taken[0]
        self.tokens -= taken[1]


@dataclass
class Clip:
    """One decoded audio clip: mono float32 at the feature extractor's rate."""

    label: str  # "audio[0]", "audio_pcm[0]"
    samples: np.ndarray
    seconds: float  # duration as received


@dataclass
class Video:
    """One decoded video: the RGB frames the processor keeps, channels first (kept, 3, height,
    width) uint8 (as the HF video processor works on them: no copy to reorder them), and what the
    processor needs of its metadata."""

    label: str  # "video[0]"
    frames: np.ndarray
    fps: float
    total_frames: int
    """Frames in the file (all decoded)."""
    frames_indices: list[int] | None = None
    """The frames kept, when the processor samples them (``ProcessorPlan.kept``); None: every frame."""
    audio: Clip | None = None
    """Its audio track, when asked for (``use_audio_in_video``)."""

    @property
    def seconds(self) -> float:
        return self.total_frames / self.fps

    @property
    def height(self) -> int:
        return int(self.frames.shape[2])

    @property
    def width(self) -> int:
        return int(self.frames.shape[3])

    def metadata(self) -> dict[str, Any]:
        """transformers' ``VideoMetadata`` fields: the processor times the video by them (and, for
        frames sampled here, by the indices kept, as its own sampling records them)."""
        metadata: dict[str, Any] = {
            "total_num_frames": self.total_frames,
            "fps": self.fps,
            "width": self.width,
            "height": self.height,
        }
        if self.frames_indices is not None:
            metadata["frames_indices"] = self.frames_indices
        return metadata


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
    ``sampling_rate``: the feature extractor's (None: the model takes no audio);
    ``plan``: what the processor will make of each medium (None: every frame kept, tokens unknown).
    Each call takes the request's ``RequestBudget`` (``budget()``; None: one of its own).
    """

    limits: PreprocessLimits
    max_audio_seconds: float
    audio_window_s: float | None
    sampling_rate: int | None
    plan: ProcessorPlan | None = None

    def budget(self) -> RequestBudget:
        """A request's budget (``max_decoded_bytes``, ``max_prompt_tokens``)."""
        return RequestBudget(self.limits.max_decoded_bytes, self.limits.max_prompt_tokens)

    # -- images --------------------------------------------------------------------------------
    def image(self, index: int, data: bytes | str, budget: RequestBudget | None = None) -> Image:
        """``image[index]`` as RGB, its pixel count, RGB bytes and placeholder tokens checked from
        the header before decoding."""
        from PIL import Image as PILImage

        what = f"image[{index}]"
        payload = _payload(what, data)
        budget = budget or self.budget()
        try:
            with PILImage.open(io.BytesIO(payload), formats=IMAGE_FORMATS) as image:
                width, height = image.size
                self._check_image_pixels(what, width, height)
                tokens = self.plan.image_tokens(width, height) if self.plan is not None else None
                budget.take(what, f"{width}x{height} pixels", width * height * 3, "RGB", tokens)
                image.load()  # decoded here, where a failure is the client's
                return image if image.mode == "RGB" else image.convert("RGB")  # RGB already: no copy
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
    def video(
        self, index: int, data: bytes | str, *, with_audio: bool = False, budget: RequestBudget | None = None
    ) -> Video:
        """``video[index]``: every frame decoded, those the processor keeps (``plan``) as RGB.

        Before any frame is decoded: the container (sniffed, its demuxer forced), the codec, and
        what the stream declares: ``max_video_frame_pixels``, ``max_video_seconds``,
        ``max_video_frames``, the RGB bytes of the frames kept (``max_decoded_bytes``) and their
        tokens (``max_prompt_tokens``). While decoding: every frame the size of the first,
        ``max_video_frames`` (decoding stops one frame past it), ``max_video_seconds`` by the
        frames decoded. ``with_audio``: its audio track too, as an audio clip
        (``video[index].audio``, within the clip limits).

        A file that declares no frame count (WebM/MKV) is assumed to have as many frames as video
        packets; when the frames decoded are not the count assumed and the frames kept of the true
        count differ, the file is decoded a second time to convert those (never more held at once).
        """
        what = f"video[{index}]"
        payload = _payload(what, data)
        budget = budget or self.budget()
        demuxer = _video_demuxer(what, payload)
        try:
            with _open_video(payload, demuxer) as container:
                width, height, fps, assumed = self._video_header(what, container, len(payload))
            video = self._video_frames(what, payload, demuxer, (width, height), fps, assumed, budget)
        except (PreprocessError, MemoryError):
            raise
        except Exception as exc:  # noqa: BLE001 - any decoder failure on untrusted bytes is the client's
            raise PreprocessError(
                f"{what}: cannot decode {len(payload)} bytes as a video ({VIDEO_FORMATS}): {exc}"
            ) from None
        if with_audio:
            video.audio = self._audio_track(what, payload, demuxer, budget)
        return video

    def _video_header(self, what: str, container: InputContainer, size: int) -> tuple[int, int, float, int]:
        """Frame size, frame rate and frame count (declared, else video packets) of the first video
        stream, checked against the limits; its codec allow-listed."""
        if not container.streams.video:
            raise PreprocessError(f"{what}: no video stream in {size} bytes (an audio-only file?)")
        stream = container.streams.video[0]
        codec = _codec_name(stream)
        if codec not in VIDEO_CODECS:
            raise PreprocessError(
                f"{what}: video codec '{codec}' is not accepted (expected one of {', '.join(sorted(VIDEO_CODECS))})"
            )
        width, height = stream.codec_context.width, stream.codec_context.height
        self._check_frame_pixels(what, width, height)
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else 0.0
        if not 0 < fps <= MAX_VIDEO_FPS:
            raise PreprocessError(f"{what}: expected a frame rate in (0, {MAX_VIDEO_FPS}] fps, found {fps:g}")
        declared = float(stream.duration * stream.time_base) if stream.duration and stream.time_base else 0.0
        if declared > self.limits.max_video_seconds:
            self._video_too_long(what, declared)
        frames = stream.frames
        if frames > self.limits.max_video_frames:
            self._too_many_frames(what, f"the stream declares {frames}")
        if frames <= 0:  # not declared (WebM/MKV): as many as video packets, demuxed without decoding
            frames = sum(1 for packet in container.demux(stream) if packet.size)
        return width, height, fps, frames

    def _video_frames(
        self,
        what: str,
        payload: bytes,
        demuxer: str,
        size: tuple[int, int],
        fps: float,
        assumed: int,
        budget: RequestBudget,
    ) -> Video:
        """Decode, converting the frames kept of ``assumed`` frames; again if that count was wrong."""
        kept = self._kept(what, assumed, fps, size)
        frames, total, size, taken = self._decode_kept(what, payload, demuxer, kept, size, fps, budget)
        if total == 0:
            raise PreprocessError(f"{what}: no frame could be decoded from {len(payload)} bytes")
        if total != assumed:
            truly_kept = self._kept(what, total, fps, size)
            if truly_kept == kept[: len(truly_kept)]:  # e.g. all frames kept and fewer came: the first ones
                budget.give_back(taken)
                taken = self._take(what, len(truly_kept), size, budget)
                kept, frames = truly_kept, frames[: len(truly_kept)]
            else:  # other frames: decode again, converting those (the first ones freed before)
                del frames
                budget.give_back(taken)
                kept = truly_kept
                frames, again, size, taken = self._decode_kept(what, payload, demuxer, kept, size, fps, budget)
                if again != total:
                    raise PreprocessError(f"{what}: decoding gave {total} frames, then {again}")
        sampled = None if self.plan is None or kept == list(range(total)) else kept
        return Video(what, frames, fps, total, sampled)

    def _kept(self, what: str, total: int, fps: float, size: tuple[int, int]) -> list[int]:
        """The frames the processor keeps of ``total`` (all of them where it does not sample)."""
        width, height = size
        kept = list(range(total))
        if self.plan is not None and total > 0:
            try:
                sampled = self.plan.kept(total, fps, width, height)
            except (ValueError, IndexError, TypeError, ArithmeticError) as exc:  # as the processor raises them
                raise PreprocessError(
                    f"{what}: {total} frames of {width}x{height} pixels: the processor rejects it ({exc})"
                ) from None
            kept = kept if sampled is None else sampled
        return kept

    def _take(self, what: str, frames: int, size: tuple[int, int], budget: RequestBudget) -> tuple[int, int]:
        """The RGB bytes and the tokens of ``frames`` kept frames of ``size``, taken from ``budget``."""
        width, height = size
        tokens = self.plan.video_tokens(frames, width, height) if self.plan is not None and frames else None
        return budget.take(what, f"{frames} frames of {width}x{height}", frames * width * height * 3, "RGB", tokens)

    def _decode_kept(
        self,
        what: str,
        payload: bytes,
        demuxer: str,
        kept: list[int],
        size: tuple[int, int],
        fps: float,
        budget: RequestBudget,
    ) -> tuple[np.ndarray, int, tuple[int, int], tuple[int, int]]:
        """One decoding pass: the frames at ``kept`` (indices, in order) as RGB, the frames decoded,
        their size, what was taken from ``budget``: the RGB bytes and tokens of the frames kept, for
        the declared ``size`` before decoding, again for the size of the first frame where it
        differs."""
        width, height = size
        taken = self._take(what, len(kept), size, budget)
        slots: dict[int, list[int]] = {}
        for position, frame_index in enumerate(kept):
            slots.setdefault(frame_index, []).append(position)
        frames: np.ndarray | None = None
        count = 0
        with _open_video(payload, demuxer) as container:
            stream = container.streams.video[0]
            for frame in container.decode(stream):
                if count == 0 and (frame.width, frame.height) != size:  # the stream's header was wrong
                    self._check_frame_pixels(what, frame.width, frame.height)
                    budget.give_back(taken)
                    size, (width, height) = (frame.width, frame.height), (frame.width, frame.height)
                    taken = self._take(what, len(kept), size, budget)
                elif (frame.width, frame.height) != size:
                    raise PreprocessError(
                        f"{what}: frames of different sizes ({width}x{height}, then {frame.width}x{frame.height} "
                        f"at frame {count})"
                    )
                if count == self.limits.max_video_frames:
                    self._too_many_frames(what, None)
                positions = slots.get(count)
                if positions:
                    if frames is None:
                        frames = np.empty((len(kept), 3, height, width), np.uint8)
                    rgb = frame.to_ndarray(format="rgb24")
                    for position in positions:
                        frames[position] = rgb.transpose(2, 0, 1)
                count += 1
                if count / fps > self.limits.max_video_seconds:
                    self._video_too_long(what, None)
        if frames is None:
            frames = np.empty((0, 3, height, width), np.uint8)
        return frames, count, size, taken

    def _audio_track(self, what: str, payload: bytes, demuxer: str, budget: RequestBudget) -> Clip:
        """A video file's first audio stream (an allow-listed codec), mixed down to mono float32
        (its own rate; ``_clip`` resamples), read no further than the clip limit, each chunk charged
        to ``budget`` before it is kept."""
        import av

        what = f"{what}.audio"
        chunks: list[np.ndarray] = []
        try:
            with _open_video(payload, demuxer) as container:
                if not container.streams.audio:
                    raise PreprocessError(f"{what}: the video has no audio track (use_audio_in_video)")
                stream = container.streams.audio[0]
                codec = _codec_name(stream)
                if codec not in AUDIO_IN_VIDEO_CODECS:
                    raise PreprocessError(
                        f"{what}: audio codec '{codec}' is not accepted (expected one of aac, mp3, opus, "
                        f"vorbis, flac, pcm_{'/'.join(_PCM)})"
                    )
                rate = _check_rate(what, stream.rate)
                limit = math.floor(self.max_audio_seconds * rate)
                mono = av.AudioResampler(format="flt", layout="mono", rate=rate)
                read = 0
                for frame in container.decode(stream):
                    for out in mono.resample(frame):
                        chunk = out.to_ndarray().reshape(-1)
                        budget.take(what, f"the {chunk.size} samples after {read}", chunk.nbytes, "float32")
                        chunks.append(chunk)
                        read += chunk.size
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

    def _too_many_frames(self, what: str, declared: str | None) -> NoReturn:
        also = f"; {declared}" if declared else ""
        raise PreprocessError(
            f"{what}: more than {self.limits.max_video_frames} frames "
            f"(max_video_frames{also}; sample the video down before sending it)"
        )

    def _video_too_long(self, what: str, seconds: float | None) -> NoReturn:
        length = "the video" if seconds is None else f"{seconds:.2f} s"
        raise PreprocessError(
            f"{what}: {length} exceeds the limit of {self.limits.max_video_seconds:g} s (max_video_seconds)"
        )

    # -- audio ---------------------------------------------------------------------------------
    def clips(
        self,
        audios: Sequence[bytes | str],
        pcm: Sequence[tuple[np.ndarray, int]],
        budget: RequestBudget | None = None,
    ) -> list[Clip]:
        """``audio`` (encoded files) then ``audio_pcm`` (samples, rate) clips, within the limits."""
        budget = budget or self.budget()
        clips = [self._decode_audio(f"audio[{i}]", data, budget) for i, data in enumerate(audios)]
        clips += [self._clip(f"audio_pcm[{i}]", samples, rate) for i, (samples, rate) in enumerate(pcm)]
        total, limit = sum(clip.seconds for clip in clips), self.limits.max_total_audio_seconds
        if total > limit:
            raise PreprocessError(
                f"audio: {total:.1f} s in total exceeds the limit of {limit:.1f} s (max_total_audio_seconds)"
            )
        return clips

    def _decode_audio(self, what: str, data: bytes | str, budget: RequestBudget) -> Clip:
        """An audio file of ``AUDIO_FORMATS`` (sniffed before libsndfile sees it), its length and
        float32 bytes checked from the header before any sample is decoded."""
        import soundfile

        payload = _payload(what, data)
        kind = _audio_format(what, payload)
        try:
            with soundfile.SoundFile(io.BytesIO(payload)) as sound:
                if sound.format not in _LIBSNDFILE_FORMATS[kind]:  # libsndfile saw another header
                    raise PreprocessError(
                        f"{what}: cannot decode {len(payload)} bytes as audio ({AUDIO_NAMES}): "
                        f"the header looks like {kind}, the decoder reads it as {sound.format}"
                    )
                if sound.subtype not in AUDIO_FORMATS[kind]:
                    raise PreprocessError(
                        f"{what}: {kind} audio encoded as {sound.subtype} is not accepted "
                        f"(expected {', '.join(AUDIO_FORMATS[kind])})"
                    )
                rate = _check_rate(what, sound.samplerate)
                limit = math.floor(self.max_audio_seconds * rate)
                if sound.frames > limit:  # the header's length; the read below is bounded anyway
                    self._too_long(what, sound.frames / rate)
                frames = min(sound.frames, limit + 1)  # what the read allocates, for every channel
                content = f"{frames} samples x {sound.channels} channels"
                budget.take(what, content, frames * sound.channels * 4, "float32")
                samples = sound.read(frames=limit + 1, dtype="float32", always_2d=True)
        except (PreprocessError, MemoryError):
            raise
        except Exception as exc:  # noqa: BLE001 - any decoder failure on untrusted bytes is the client's
            raise PreprocessError(
                f"{what}: cannot decode {len(payload)} bytes as audio ({AUDIO_NAMES}): {str(exc).rsplit(': ', 1)[-1]}"
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


def _open_video(payload: bytes, demuxer: str) -> InputContainer:
    """``payload`` opened with ``demuxer`` alone (``VIDEO_CONTAINERS``), its decoders allow-listed
    and no other file or URL reachable."""
    import av

    options = {**_DEMUXER_OPTIONS, "format_whitelist": demuxer, **(_MOV_OPTIONS if demuxer == "mov" else {})}
    return av.open(io.BytesIO(payload), mode="r", format=demuxer, container_options=options)


def _codec_name(stream: Any) -> str:
    """FFmpeg's name of a stream's codec (``av1``, not the decoder's ``libdav1d``)."""
    try:
        return str(stream.codec_context.codec.canonical_name)
    except Exception:  # noqa: BLE001 - no decoder in this build: its id is all there is
        return "unknown (no decoder for it in this build)"


def _video_demuxer(what: str, payload: bytes) -> str:
    """The demuxer of ``payload``'s container, from its first bytes: an ISO-BMFF box (``ftyp``; a
    QuickTime file may start with another top-level atom) for MP4/MOV, an EBML header for
    WebM/MKV. Anything else is refused before FFmpeg sees it."""
    if len(payload) >= 8 and payload[4:8] in (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip"):
        return "mov"
    if payload[:4] == b"\x1aE\xdf\xa3":
        return "matroska"
    audio = _sniff_audio(payload)
    if audio is not None:
        raise PreprocessError(
            f"{what}: no video stream in {len(payload)} bytes ({_describe(payload)}: an audio-only file; "
            f"expected {VIDEO_FORMATS})"
        )
    raise PreprocessError(
        f"{what}: cannot decode {len(payload)} bytes as a video ({VIDEO_FORMATS}): expected an ISO-BMFF "
        f"'ftyp' box at byte 4 (MP4/MOV) or the EBML header 1a 45 df a3 (WebM/MKV), found {_describe(payload)}"
    )


AUDIO_NAMES = "WAV/FLAC/OGG/MP3"


def _audio_format(what: str, payload: bytes) -> str:
    """The ``AUDIO_FORMATS`` key of ``payload`` from its first bytes, or a refusal naming what was found."""
    kind = _sniff_audio(payload)
    if kind is None:
        raise PreprocessError(
            f"{what}: cannot decode {len(payload)} bytes as audio ({AUDIO_NAMES}): expected a RIFF/WAVE, fLaC "
            f"or OggS header, an ID3 tag or an MPEG audio frame (MP3), found {_describe(payload)}"
        )
    return kind


def _sniff_audio(payload: bytes) -> str | None:
    if payload[:4] == b"RIFF" and payload[8:12] == b"WAVE":
        return "WAV"
    if payload[:4] == b"fLaC":
        return "FLAC"
    if payload[:4] == b"OggS":
        return "OGG"
    start = _id3_size(payload)
    if _mpeg_audio_frame(payload[start : start + 4]):  # after a tag: an MP3 frame, nothing else
        return "MP3"
    return None


def _id3_size(payload: bytes) -> int:
    """Bytes of the ID3v2 tag ``payload`` starts with (10-byte header, syncsafe size, optional
    footer); 0 without one."""
    if payload[:3] != b"ID3" or len(payload) < 10:
        return 0
    size = int.from_bytes(bytes(byte & 0x7F for byte in payload[6:10]), "big")
    return 10 + size + (10 if payload[5] & 0x10 else 0)


def _mpeg_audio_frame(header: bytes) -> bool:
    """Whether ``header`` is an MPEG audio frame header (sync, a version, a layer, a bitrate and a
    sample rate that exist). ADTS AAC (layer 0) is not one."""
    if len(header) < 4 or header[0] != 0xFF or header[1] & 0xE0 != 0xE0:
        return False
    version, layer = (header[1] >> 3) & 3, (header[1] >> 1) & 3
    bitrate, rate = header[2] >> 4, (header[2] >> 2) & 3
    return version != 1 and layer != 0 and bitrate != 15 and rate != 3


def _describe(payload: bytes) -> str:
    """What the first bytes of a refused file look like, and the bytes themselves (hex)."""
    if not payload:
        return "no bytes at all"
    tag = _id3_size(payload)
    if tag:  # libsndfile skips the tag and reads what follows
        return f"an ID3 tag of {tag} bytes, then {_describe(payload[tag:])}"
    head = " ".join(f"{byte:02x}" for byte in payload[:8])
    if payload[:4] == b"RIFF":
        form = "".join(chr(byte) if 32 <= byte < 127 else "." for byte in payload[8:12])
        name = f"a RIFF '{form}' file" if len(form) == 4 else "a RIFF header cut short"
    elif payload[:4] == b"FORM" and payload[8:12] in (b"AIFF", b"AIFC"):
        name = "an AIFF file"
    elif payload[4:8] == b"ftyp":
        name = "an MP4/MOV file"
    else:
        name = next((label for magic, label in _SIGNATURES if payload.startswith(magic)), "")
    if _mpeg_audio_frame(payload[:4]):
        name = "an MPEG audio frame"
    return f"{name} ({head})" if name else f"no known header ({head})"


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

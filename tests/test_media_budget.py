"""Media decoded within a stated memory budget, from an allow-list of formats (issue 39).

* Video: only MP4/MOV (ISO-BMFF) and WebM/MKV (EBML) bytes reach FFmpeg, each with its demuxer
  forced, and only the codecs of ``VIDEO_CODECS`` (``AUDIO_IN_VIDEO_CODECS`` for an audio track) are
  decoded. Audio: only WAV, FLAC, Ogg and MP3 bytes reach libsndfile. Every refusal names the item,
  what was expected and what was found; each forbidden file is first shown to be one FFmpeg or
  libsndfile would have opened.
* Only the frames the HF video processor keeps are converted to RGB, and it makes of them exactly
  what it makes of the whole video.
* ``max_decoded_bytes`` and ``max_prompt_tokens`` are counted item by item before decoding.
* ``preprocess``'s peak RSS for the worst request the limits accept, and for a 256-frame 1080p
  "video" of 2 MB, stays under ``instance_memory_bound`` (a fresh process each).

No engine and no server: the preprocessing runs in-process (or in a child process) on the tiny
checkpoints. Every file is made here, deterministically (PyAV, numpy, soundfile, PIL).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmserve_dev.samples import AUDIO_SAMPLE_RATE, VIDEO_FPS, encode_video, sample_audio, sample_video

from utils import rejects

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

VIDEO_EXPECTED = "expected an ISO-BMFF 'ftyp' box at byte 4 (MP4/MOV) or the EBML header 1a 45 df a3 (WebM/MKV)"
AUDIO_EXPECTED = "expected a RIFF/WAVE, fLaC or OggS header, an ID3 tag or an MPEG audio frame (MP3)"


@pytest.fixture(scope="module")
def preprocessor(tiny_models):
    from mmserve.serving.preprocess import Preprocessor

    return Preprocessor(tiny_models["qwen2_5_omni"])


def limited(preprocessor, **limits):
    from mmserve.serving.preprocess import PreprocessLimits

    return preprocessor.with_settings(limits=PreprocessLimits(**limits))


# -- files made here -------------------------------------------------------------------------------
def video_file(
    frames: np.ndarray,
    codec: str,
    fmt: str,
    fps: int = VIDEO_FPS,
    *,
    audio_codec: str | None = None,
    options: dict[str, str] | None = None,
) -> bytes:
    """``frames`` (RGB, frames x height x width x 3) encoded with ``codec`` in container ``fmt``;
    ``audio_codec``: a 1-s 16 kHz mono track beside them. The SVT-AV1 encoder (``libsvtav1``) sets the
    calling thread to SCHED_FIFO 99 when run as root: the policy is put back after encoding, so that
    nothing this process starts later inherits it (the server decodes AV1 with libdav1d, which leaves
    the policy alone)."""
    try:
        return _encoded(frames, codec, fmt, fps, audio_codec, options)
    finally:
        if os.sched_getscheduler(0) != os.SCHED_OTHER:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def _encoded(
    frames: np.ndarray, codec: str, fmt: str, fps: int, audio_codec: str | None, options: dict[str, str] | None
) -> bytes:
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps, options=options or {})
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = {"png": "rgb24", "mjpeg": "yuvj420p"}.get(codec, "yuv420p")
        track = container.add_stream(audio_codec, rate=AUDIO_SAMPLE_RATE, layout="mono") if audio_codec else None
        for index, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
        if track is not None:
            assert isinstance(track, av.AudioStream)
            wave = sample_audio(3, seconds=1.0)
            encoded = track.codec_context.format.name
            samples = av.AudioFrame.from_ndarray(
                (wave * 32767).astype(np.int16).reshape(1, -1) if encoded == "s16" else wave.reshape(1, -1),
                format="s16" if encoded == "s16" else "flt",
                layout="mono",
            )
            samples.sample_rate = AUDIO_SAMPLE_RATE
            for resampled in av.AudioResampler(format=encoded, layout="mono", rate=AUDIO_SAMPLE_RATE).resample(samples):
                container.mux(track.encode(resampled))
            container.mux(track.encode())
    return out.getvalue()


def decoded_by_ffmpeg(data: bytes) -> list[np.ndarray]:
    """The frames FFmpeg gives for ``data`` when it picks the demuxer itself (what the landed code
    did with every ``video``), as RGB."""
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def png(width: int, height: int, colour: tuple[int, int, int] = (90, 120, 200)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def sound_file(wave: np.ndarray, fmt: str, subtype: str | None = None, rate: int = AUDIO_SAMPLE_RATE) -> bytes:
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, wave, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def id3_tag(size: int = 32) -> bytes:
    """An ID3v2.4 tag of ``size`` bytes of padding (its size syncsafe, as MP3 tools write it)."""
    syncsafe = bytes((size >> shift) & 0x7F for shift in (21, 14, 7, 0))
    return b"ID3\x04\x00\x00" + syncsafe + bytes(size)


def hex_head(data: bytes) -> str:
    return " ".join(f"{byte:02x}" for byte in data[:8])


FRAMES = sample_video(5, frames=6, size=(64, 48))


# -- 1. video: containers and codecs allow-listed -------------------------------------------------------
def test_a_yuv4mpeg2_file_is_refused(preprocessor):
    header = b"YUV4MPEG2 W64 H48 F12:1 Ip A1:1 C420jpeg\n"
    y4m = header + b"".join(b"FRAME\n" + bytes(64 * 48 * 3 // 2) for _ in range(3))
    assert len(decoded_by_ffmpeg(y4m)) == 3  # FFmpeg's yuv4mpegpipe demuxer would have read it
    message = rejects(lambda: preprocessor("x", videos=[y4m]), "video[0]: ")
    assert message == (
        f"video[0]: cannot decode {len(y4m)} bytes as a video (MP4/MOV/WebM/MKV): {VIDEO_EXPECTED}, "
        "found a YUV4MPEG2 video (59 55 56 34 4d 50 45 47)"
    )


def test_concatenated_pngs_are_refused(preprocessor):
    stream = png(64, 48) + png(64, 48, (10, 20, 30))
    assert len(decoded_by_ffmpeg(stream)) == 2  # image2pipe (png_pipe) would have read two frames
    message = rejects(lambda: preprocessor("x", videos=[stream]), "video[0]: ")
    assert message == (
        f"video[0]: cannot decode {len(stream)} bytes as a video (MP4/MOV/WebM/MKV): {VIDEO_EXPECTED}, "
        "found a PNG image (89 50 4e 47 0d 0a 1a 0a)"
    )


def test_an_ffconcat_script_is_refused_and_reads_no_file(preprocessor, tmp_path, monkeypatch):
    """FFmpeg's concat demuxer, probed on these bytes, opens the files the script names (relative to
    the server's working directory); ``preprocess`` never hands it the bytes."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "clip.mov").write_bytes(encode_video(FRAMES))
    script = b"ffconcat version 1.0\nfile 'clip.mov'\n"
    assert len(decoded_by_ffmpeg(script)) == len(FRAMES)  # a file of the server's, read through `video`
    message = rejects(lambda: preprocessor("x", videos=[script]), "video[0]: ")
    assert message == (
        f"video[0]: cannot decode {len(script)} bytes as a video (MP4/MOV/WebM/MKV): {VIDEO_EXPECTED}, "
        "found an ffconcat script (66 66 63 6f 6e 63 61 74)"
    )


def test_a_video_codec_outside_the_list_is_refused_before_decoding(preprocessor):
    mjpeg = video_file(FRAMES, "mjpeg", "mp4")
    assert len(decoded_by_ffmpeg(mjpeg)) == len(FRAMES)
    message = rejects(lambda: preprocessor("x", videos=[mjpeg]), "video[0]: ")
    assert (
        message
        == "video[0]: video codec 'mjpeg' is not accepted (expected one of av1, h264, hevc, mpeg4, png, vp8, vp9)"
    )


def test_an_audio_track_codec_outside_the_list_is_refused(preprocessor):
    mp2 = video_file(FRAMES, "mpeg4", "mov", audio_codec="mp2")
    message = rejects(lambda: preprocessor("x", videos=[mp2], use_audio_in_video=True), "video[0].audio: ")
    assert message.startswith("video[0].audio: audio codec 'mp2' is not accepted (expected one of aac, mp3, opus, ")
    # The same file without its audio heard: the video is decoded, its audio stream never is.
    assert preprocessor("x", videos=[mp2])["video_grid_thw"].shape == (1, 3)


def test_an_audio_file_as_a_video_says_so(preprocessor):
    wav = sound_file(sample_audio(0, seconds=0.1), "WAV")
    message = rejects(lambda: preprocessor("x", videos=[wav]), "video[0]: no video stream in")
    assert message == (
        f"video[0]: no video stream in {len(wav)} bytes (a RIFF 'WAVE' file ({hex_head(wav)}): an audio-only "
        "file; expected MP4/MOV/WebM/MKV)"
    )


@pytest.mark.parametrize(
    ("codec", "fmt"),
    [
        ("libx264", "mp4"),
        ("libx265", "mp4"),
        ("mpeg4", "mp4"),
        ("libsvtav1", "mp4"),
        ("png", "mov"),
        ("libx264", "matroska"),
        ("libvpx", "webm"),
        ("libvpx-vp9", "webm"),
    ],
)
def test_the_accepted_formats_give_the_processors_output_on_their_frames(preprocessor, codec, fmt):
    """Each accepted container and codec: ``preprocess``'s tensors are the HF processor's on the
    frames FFmpeg decodes from the file by itself (the frames go to the processor channels first,
    only the frames it keeps)."""
    data = video_file(FRAMES, codec, fmt)
    frames = decoded_by_ffmpeg(data)
    assert len(frames) == len(FRAMES)
    got = preprocessor.decode_wire(preprocessor("What happens?", videos=[data]))
    metadata = {"total_num_frames": len(frames), "fps": float(VIDEO_FPS), "width": 64, "height": 48}
    prompt = preprocessor.chat_prompt("What happens?", 0, 0, 1)
    want = preprocessor.processor(
        text=[prompt], videos=[np.stack(frames)], video_metadata=[metadata], return_tensors="np"
    )
    np.testing.assert_array_equal(got["input_ids"], want["input_ids"][0])
    for name in ("pixel_values_videos", "video_grid_thw"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    np.testing.assert_array_equal(got["second_per_grid_ts"], np.asarray(want["video_second_per_grid"], np.float32))


def test_frame_counts_are_checked_as_declared_then_as_decoded(preprocessor):
    """A file that declares its frame count (MP4/MOV) is refused from its header; one that does not
    (WebM) while decoding, one frame past the limit."""
    five = limited(preprocessor, max_video_frames=5)
    assert rejects(lambda: five("x", videos=[video_file(FRAMES, "mpeg4", "mp4")]), "video[0]: ") == (
        "video[0]: more than 5 frames (max_video_frames; the stream declares 6; sample the video down before "
        "sending it)"
    )
    assert rejects(lambda: five("x", videos=[video_file(FRAMES, "libvpx-vp9", "webm")]), "video[0]: ") == (
        "video[0]: more than 5 frames (max_video_frames; sample the video down before sending it)"
    )
    assert limited(preprocessor, max_video_frames=6)("x", videos=[video_file(FRAMES, "libvpx-vp9", "webm")])


def test_empty_and_cut_short_files_say_what_they_are(preprocessor):
    assert rejects(lambda: preprocessor("x", videos=[b""]), "video[0]: ") == (
        f"video[0]: cannot decode 0 bytes as a video (MP4/MOV/WebM/MKV): {VIDEO_EXPECTED}, found no bytes at all"
    )
    assert rejects(lambda: preprocessor("x", [], [b"RIFF...."]), "audio[0]: ") == (
        f"audio[0]: cannot decode 8 bytes as audio (WAV/FLAC/OGG/MP3): {AUDIO_EXPECTED}, found a RIFF header cut "
        "short (52 49 46 46 2e 2e 2e 2e)"
    )


def test_the_demuxer_options_forbid_other_files_and_decoders():
    """What every video is opened with: its demuxer alone, no protocol (the bytes come from memory),
    the allow-listed decoders alone (also for the streams FFmpeg probes), no external references."""
    from mmserve.serving.preprocess import AUDIO_IN_VIDEO_CODECS, VIDEO_CODECS
    from mmserve.serving.preprocess.media import _open_video

    mjpeg = video_file(FRAMES, "mjpeg", "mp4")
    with _open_video(mjpeg, "mov") as container:  # opened (its header), but its decoder never was
        assert container.format.name.startswith("mov") and container.streams.video[0].codec_context.pix_fmt is None
    from mmserve.serving.preprocess import media

    decoders = media._DEMUXER_OPTIONS["codec_whitelist"].split(",")
    assert "mjpeg" not in decoders and {"h264", "libdav1d", "pcm_s16le", "aac"} <= set(decoders)
    assert len(decoders) == len({d for ds in (*VIDEO_CODECS.values(), *AUDIO_IN_VIDEO_CODECS.values()) for d in ds})
    assert media._DEMUXER_OPTIONS["protocol_whitelist"] == "none" and media._MOV_OPTIONS["enable_drefs"] == "0"


# -- 2. audio: formats sniffed before libsndfile ------------------------------------------------------
WAVE = sample_audio(1, seconds=0.5)


@pytest.mark.parametrize(
    ("name", "make", "found"),
    [
        ("Sun AU", lambda: sound_file(WAVE, "AU"), "a Sun AU file"),
        ("AIFF", lambda: sound_file(WAVE, "AIFF"), "an AIFF file"),
        ("CAF", lambda: sound_file(WAVE, "CAF"), "a CAF file"),
        ("raw PCM", lambda: (WAVE * 32767).astype("<i2").tobytes(), "no known header"),
        ("ID3 then AU", lambda: id3_tag() + sound_file(WAVE, "AU"), "an ID3 tag of 42 bytes, then a Sun AU file"),
    ],
)
def test_audio_formats_outside_the_list_are_refused(preprocessor, name, make, found):
    import soundfile

    data = make()
    if name != "raw PCM":  # a file libsndfile reads (it skips an ID3 tag, then reads whatever follows)
        assert soundfile.info(io.BytesIO(data)).frames == WAVE.size, name
    message = rejects(lambda: preprocessor("x", [], [data]), "audio[0]: ")
    head = hex_head(data[42:] if name == "ID3 then AU" else data)
    assert message == (
        f"audio[0]: cannot decode {len(data)} bytes as audio (WAV/FLAC/OGG/MP3): {AUDIO_EXPECTED}, "
        f"found {found} ({head})"
    )


def test_audio_encodings_outside_the_list_are_refused(preprocessor):
    adpcm = sound_file(WAVE, "WAV", "IMA_ADPCM")
    message = rejects(lambda: preprocessor("x", [], [adpcm]), "audio[0]: ")
    assert message == (
        "audio[0]: WAV audio encoded as IMA_ADPCM is not accepted "
        "(expected PCM_U8, PCM_16, PCM_24, PCM_32, FLOAT, DOUBLE, ULAW, ALAW)"
    )


@pytest.mark.parametrize(
    ("fmt", "subtype", "prefix"),
    [
        ("WAV", "PCM_16", b""),
        ("WAV", "FLOAT", b""),
        ("WAV", "PCM_U8", b""),
        ("FLAC", None, b""),
        ("OGG", "VORBIS", b""),
        ("OGG", "OPUS", b""),
        ("MP3", None, b""),
        ("MP3", None, id3_tag()),
    ],
)
def test_the_accepted_audio_formats_still_decode(preprocessor, fmt, subtype, prefix):
    data = prefix + sound_file(WAVE, fmt, subtype)
    (clip,) = preprocessor.media.clips([data], [])
    assert clip.seconds == pytest.approx(0.5, abs=0.03) and clip.samples.dtype == np.float32
    assert preprocessor("x", [], [data])["input_features"].shape[0] == 1


# -- 3. max_decoded_bytes and max_prompt_tokens, counted before decoding --------------------------------
def test_decoded_bytes_are_counted_per_request_before_decoding(preprocessor):
    images = [png(100, 100), png(100, 100)]
    small = limited(preprocessor, max_decoded_bytes=50_000)
    assert rejects(lambda: small("x", images), "image[1]: ") == (
        "image[1]: 100x100 pixels decode to 30000 bytes (RGB), over the 20000 left of the limit of 50000 "
        "decoded bytes per request (max_decoded_bytes; the items before it took 30000)"
    )
    assert limited(preprocessor, max_decoded_bytes=60_000)("x", images)["image_grid_thw"].shape == (2, 3)

    video = encode_video(FRAMES)  # 6 frames of 64x48: 55296 bytes of RGB
    assert rejects(lambda: limited(preprocessor, max_decoded_bytes=55_295)("x", videos=[video]), "video[0]: ") == (
        "video[0]: 6 frames of 64x48 decode to 55296 bytes (RGB), over the limit of 55295 decoded bytes per "
        "request (max_decoded_bytes)"
    )
    assert limited(preprocessor, max_decoded_bytes=55_296)("x", videos=[video])["video_grid_thw"].shape == (1, 3)

    stereo = sound_file(np.stack([WAVE, WAVE], axis=1), "FLAC")  # read as 8000 x 2 float32: 64000 bytes
    with_image = limited(preprocessor, max_decoded_bytes=90_000)
    assert rejects(lambda: with_image("x", images[:1], [stereo]), "audio[0]: ") == (
        "audio[0]: 8000 samples x 2 channels decode to 64000 bytes (float32), over the 60000 left of the limit "
        "of 90000 decoded bytes per request (max_decoded_bytes; the items before it took 30000)"
    )
    assert limited(preprocessor, max_decoded_bytes=94_000)("x", images[:1], [stereo])["input_features"].shape[0] == 1


def test_a_video_audio_track_is_counted_too(preprocessor):
    data = encode_video(sample_video(2, frames=12), audio=sample_audio(4, seconds=1.0))  # 112x84: 338688 bytes
    message = rejects(
        lambda: limited(preprocessor, max_decoded_bytes=338_688 + 40_000)("x", videos=[data], use_audio_in_video=True),
        "video[0].audio: the ",
    )
    assert message == (  # PyAV hands the track over in chunks of 1024 samples
        "video[0].audio: the 1024 samples after 9216 decode to 4096 bytes (float32), over the 3136 left of the "
        "limit of 378688 decoded bytes per request (max_decoded_bytes; the items before it took 375552)"
    )
    assert limited(preprocessor, max_decoded_bytes=338_688 + 64_000)("x", videos=[data], use_audio_in_video=True)


def test_media_tokens_are_counted_before_decoding(preprocessor):
    """The processor's own token counts, asked before decoding, are those of its output; a request
    whose images and videos make more than max_prompt_tokens is refused before they are decoded."""
    plan = preprocessor.plan
    for width, height, frames in [(64, 48, 6), (112, 84, 5), (250, 130, 4), (1920, 1080, 2), (30, 500, 3)]:
        data = encode_video(sample_video(6, frames=frames, size=(width, height)))
        out = preprocessor("x", videos=[data])
        assert plan.video_tokens(frames, width, height) == int(out["video_grid_thw"].prod()) // 4, (width, height)
    for width, height in [(64, 48), (1000, 700), (4096, 4096), (29, 800)]:
        out = preprocessor("x", [png(width, height)])
        assert plan.image_tokens(width, height) == int(out["image_grid_thw"].prod()) // 4, (width, height)

    video = encode_video(sample_video(6, frames=6, size=(250, 130)))
    image_tokens, video_tokens = plan.image_tokens(100, 100), plan.video_tokens(6, 250, 130)
    few = limited(preprocessor, max_prompt_tokens=image_tokens + video_tokens - 1)
    assert rejects(lambda: few("x", [png(100, 100)], videos=[video]), "video[0]: ") == (
        f"video[0]: 6 frames of 250x130 make {video_tokens} placeholder tokens, over the {video_tokens - 1} left "
        f"of the limit of {image_tokens + video_tokens - 1} prompt tokens (max_prompt_tokens; the media before "
        f"it make {image_tokens})"
    )


def test_the_bomb_is_refused_before_anything_is_decoded(preprocessor, monkeypatch):
    """256 PNG frames of 1920x1080 in 2 MB: refused from its header, by max_decoded_bytes, or, with
    that raised, by the tokens its frames would make; the file is opened once, for its header, and
    never for decoding."""
    from mmserve.serving.preprocess import media

    bomb = bomb_video()
    opened = []
    open_video = media._open_video

    def counted(payload: bytes, demuxer: str) -> Any:
        opened.append(demuxer)
        return open_video(payload, demuxer)

    monkeypatch.setattr(media, "_open_video", counted)
    assert rejects(lambda: preprocessor("x", videos=[bomb]), "video[0]: ") == (
        "video[0]: 256 frames of 1920x1080 decode to 1592524800 bytes (RGB), over the limit of 268435456 "
        "decoded bytes per request (max_decoded_bytes)"
    )
    assert rejects(lambda: limited(preprocessor, max_decoded_bytes=2**31)("x", videos=[bomb]), "video[0]: ") == (
        "video[0]: 256 frames of 1920x1080 make 92160 placeholder tokens, over the limit of 32768 prompt tokens "
        "(max_prompt_tokens)"
    )
    assert opened == ["mov", "mov"]  # one header each
    assert len(preprocessor("x", videos=[encode_video(FRAMES)])["video_grid_thw"]) == 1
    assert opened[2:] == ["mov", "mov"]  # an accepted video: its header, then its frames


# -- 4. frames sampled before they are converted ---------------------------------------------------------
@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_5_omni"])
def sampling(request, tiny_models, tmp_path_factory):
    """A copy of a tiny checkpoint whose video processor samples frames (2 per second, at least 4),
    its Preprocessor and its HF processor."""
    from transformers import AutoProcessor

    from mmserve.serving.preprocess import Preprocessor

    source = tiny_models[request.param]
    model = tmp_path_factory.mktemp(f"{request.param}_sampling")
    for path in source.iterdir():
        if path.name != "model.safetensors":  # the processor and the config are all preprocess reads
            shutil.copy(path, model / path.name)
    config = json.loads((source / "processor_config.json").read_text())
    config["video_processor"].update(do_sample_frames=True, fps=2.0)
    (model / "processor_config.json").write_text(json.dumps(config))
    preprocessor = Preprocessor(model)
    assert preprocessor.plan is not None and preprocessor.plan.samples
    return request.param, preprocessor, AutoProcessor.from_pretrained(model)


@pytest.mark.parametrize("frames", [24, 31, 6])
def test_only_the_frames_kept_are_converted_and_the_output_is_the_processors(sampling, frames, monkeypatch):
    """With sampling on, ``preprocess`` holds only the frames the processor keeps, and its output
    is the HF processor's own on every frame of the video (its own sampling): the same frames, the
    same seconds per temporal patch, the same tokens. Also when the frame count the file declares
    is wrong (a second pass converts the right frames)."""
    from mmserve.serving.preprocess.media import MediaDecoder

    family, preprocessor, processor = sampling
    passes: list[int] = []  # frames kept in each decoding pass
    decode_kept = MediaDecoder._decode_kept

    def counted(self, what, payload, demuxer, kept, *args):
        passes.append(len(kept))
        return decode_kept(self, what, payload, demuxer, kept, *args)

    monkeypatch.setattr(MediaDecoder, "_decode_kept", counted)
    video = sample_video(8, frames=frames)
    data = encode_video(video)
    decoded = preprocessor.media.video(0, data)
    kept = processor.video_processor.sample_frames(
        metadata=_metadata(frames), **preprocessor.plan.video_kwargs
    ).tolist()
    assert decoded.frames.shape == (len(kept), 3, 84, 112) and decoded.total_frames == frames
    np.testing.assert_array_equal(decoded.frames, video[kept].transpose(0, 3, 1, 2))
    assert len(kept) < frames

    prompt = preprocessor.chat_prompt("What happens?", 0, 0, 1)
    want = processor(text=[prompt], videos=[video], video_metadata=[_metadata(frames)], return_tensors="np")
    seconds = "second_per_grid_ts" if family == "qwen2_5_vl" else "video_second_per_grid"
    header = MediaDecoder._video_header
    for lie in (0, 7, -3):  # the frame count the header declares: right, too many, too few
        if lie:

            def lying(self, *args, lie=lie, header=header):
                width, height, fps, count = header(self, *args)
                return width, height, fps, count + lie

            monkeypatch.setattr(MediaDecoder, "_video_header", lying)
        passes.clear()
        got = preprocessor("What happens?", videos=[data])
        assert passes == ([len(kept)] if lie == 0 else [passes[0], len(kept)]), (lie, passes)
        np.testing.assert_array_equal(got["input_ids"], want["input_ids"][0], err_msg=f"lie {lie}")
        np.testing.assert_array_equal(got["pixel_values_videos"], want["pixel_values_videos"])
        np.testing.assert_array_equal(got["video_grid_thw"], want["video_grid_thw"])
        np.testing.assert_array_equal(got[seconds], np.asarray(want[seconds], np.float32))


def _metadata(frames: int) -> Any:
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(total_num_frames=frames, fps=float(VIDEO_FPS), width=112, height=84)


# -- 5. peak RSS of one request, in a fresh process ---------------------------------------------------
QWEN_VISION_FEATURE_BYTES = 4 * 2 * 14 * 14 * 3 * 4
"""float32 features per placeholder token of Qwen vision: merge² x temporal patch x patch² x 3 x 4 bytes."""

PEAK_RSS = r"""
import json, pickle, re, resource, sys
from pathlib import Path

def status(key):
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024

from mmserve.serving.preprocess import PreprocessError, Preprocessor
from mmserve_dev.samples import encode_audio, encode_image, encode_video, sample_audio, sample_image, sample_video

preprocessor = Preprocessor(sys.argv[1])
# One small request of each kind first: the decoders and the processor's code are loaded.
preprocessor("x", [encode_image(sample_image())], [encode_audio(sample_audio())], videos=[encode_video(sample_video())])
request = pickle.loads(Path(sys.argv[2]).read_bytes())
try:
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) counts from here
    peak = lambda: status("VmHWM")
except OSError:  # no reset: the process's peak so far (loading included: an overestimate)
    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
idle = status("VmRSS")
try:
    outcome = {"tokens": int(preprocessor(**request)["input_ids"].size)}
except PreprocessError as exc:
    outcome = {"refused": str(exc)}
print(json.dumps({**outcome, "idle": idle, "peak": peak() - idle}))
"""


def peak_rss(model: Path, request: dict[str, Any], tmp_path: Path, name: str) -> dict[str, Any]:
    """``request`` (Preprocessor keyword arguments) in a fresh process: its peak RSS above the RSS
    after loading (and one small request), and what became of it."""
    path = tmp_path / f"{name}.pickle"
    path.write_bytes(pickle.dumps(request))
    done = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, str(model), str(path)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"{name}: peak RSS {result['peak'] / 2**20:.0f} MiB above the idle {result['idle'] / 2**20:.0f} MiB; {result}"
    )
    return result


def bomb_video() -> bytes:
    """256 identical PNG frames of 1920x1080 in MOV at 8 fps (32 s): 2 MB that decode to 1.6 GB of RGB."""
    frame = np.full((1, 1080, 1920, 3), (90, 120, 200), np.uint8)
    return video_file(np.broadcast_to(frame, (256, 1080, 1920, 3)), "png", "mov", fps=8)


def test_peak_rss_of_the_worst_accepted_request_and_of_the_bomb(tiny_models, tmp_path):
    """The worst requests the default limits accept, each in a fresh process, stay under
    ``instance_memory_bound``; the bomb is refused from its header at almost no cost.

    Worst: every image, audio and video count at its limit; the decoded bytes within 2% of
    ``max_decoded_bytes`` and the prompt within 3% of ``max_prompt_tokens`` (the processor's float
    work grows with both), and the same budget spent on 1080p frames (the largest frames, each
    resized by the processor through a float32 copy)."""
    from mmserve.serving.preprocess import PreprocessLimits, Preprocessor, instance_memory_bound

    limits = PreprocessLimits()
    bound = instance_memory_bound(limits, QWEN_VISION_FEATURE_BYTES)
    model = tiny_models["qwen2_5_omni"]
    processor = Preprocessor(model).processor.video_processor
    assert processor.merge_size**2 * processor.temporal_patch_size * processor.patch_size**2 * 12 == (
        QWEN_VISION_FEATURE_BYTES
    )

    image = png(4096, 4096)  # max_image_pixels
    stereo = np.stack([sample_audio(9, seconds=30.0, sample_rate=48_000)] * 2, axis=1)
    clip = sound_file(stereo, "WAV", rate=48_000)  # the 30-s window, 48 kHz stereo: 11.5 MB of float32
    frames = np.broadcast_to(np.full((1, 672, 896, 3), (60, 90, 120), np.uint8), (78, 672, 896, 3))
    video = video_file(frames, "png", "mov", fps=4)  # 602112-pixel frames: 768 tokens per 2 frames, no resize
    worst = {"text": "What happens?", "images": [image] * 2, "audios": [clip] * 2, "videos": [video]}
    decoded = 2 * 4096 * 4096 * 3 + 2 * 48_000 * 30 * 2 * 4 + 78 * 896 * 672 * 3
    assert 0.98 * limits.max_decoded_bytes <= decoded <= limits.max_decoded_bytes
    hd = video_file(np.broadcast_to(frames[:1, :1, :1], (43, 1080, 1920, 3)), "png", "mov", fps=8)
    assert 43 * 1920 * 1080 * 3 <= limits.max_decoded_bytes < 44 * 1920 * 1080 * 3

    result = peak_rss(model, worst, tmp_path, "worst")
    assert 0.97 * limits.max_prompt_tokens <= result.get("tokens", 0) <= limits.max_prompt_tokens, result
    assert result["peak"] < bound, f"{result['peak']} bytes over the bound of {bound}"
    result = peak_rss(model, {"text": "What happens?", "videos": [hd]}, tmp_path, "hd")
    assert "tokens" in result and result["peak"] < bound, result
    result = peak_rss(model, {"text": "What happens?", "videos": [bomb_video()]}, tmp_path, "bomb")
    assert "max_decoded_bytes" in result.get("refused", ""), result
    assert result["peak"] < 64 * 2**20, result  # refused from its header: no frame decoded

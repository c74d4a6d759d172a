"""Raw request -> the model's own HF processor output: what the ``preprocess`` Triton model runs.

Contract
--------
``Preprocessor(model)(text, images, audios, pcm, apply_chat_template=True, messages=None, videos=())`` returns
``input_ids`` (chat template applied, every media placeholder expanded) and the feature tensors of
``mmserve.serving.contract`` of the modalities the request has, as numpy arrays.

* ``text``: the prompt, ``str`` or UTF-8 ``bytes`` (what Triton's BYTES tensors hold). With
  ``apply_chat_template`` (the default) it is the user's message: one user turn holds the images,
  then the audio clips, then the text. Without it, it is the whole raw prompt, placeholders included.
* ``images``: encoded files (PNG, JPEG, WebP, GIF, BMP, TIFF; no other decoder is ever tried).
* ``audios``: encoded files (WAV, FLAC, OGG, MP3: ``AUDIO_FORMATS``, told from their first bytes
  before libsndfile sees them), mixed down to mono, resampled to the feature extractor's rate.
* ``pcm``: ``(samples, sample_rate)`` pairs of mono float PCM; they follow ``audios`` in the prompt.
* ``videos``: encoded files (MP4/MOV or WebM/MKV, told from their first bytes and opened with that
  FFmpeg demuxer alone; codecs ``VIDEO_CODECS``), for families with video; every frame decoded, those
  the HF video processor keeps (its own sampling) converted to RGB and given to it with the file's
  frame rate, which it times the video by; in the user turn after the images.
* ``messages``: a whole conversation instead of ``text`` (which must then be empty, and
  ``apply_chat_template`` true): UTF-8 JSON (``str`` or ``bytes``), an array of
  ``{"role": "system"|"user"|"assistant"|"tool", "content": <string> | [<part>, ...]}`` (an
  assistant's ``tool_calls``, a tool's ``tool_call_id`` beside: ``messages``) with parts
  ``{"type": "text", "text": <string>}``, ``{"type": "image"}``, ``{"type": "audio"}``, ``{"type": "video"}``. No other key
  is accepted anywhere (the chat templates read any ``image``/``audio``/``text`` key as a part of
  that kind); media parts only in user messages; an array content is non-empty; the last message
  is the user's or a tool's (the prompt ends with the generation prompt: the model answers it). The media
  parts refer, in order of appearance across the whole conversation, to ``images`` (image parts)
  and to the clips (audio parts: ``audios``, then ``pcm``), and their counts must match. The model's
  chat template renders the conversation, the parts in their order.
* ``tools``: with ``messages``, the function tools (UTF-8 JSON array of OpenAI tools) the chat
  template is given (``apply_chat_template(tools=...)``).

Over JSON transports (Triton's HTTP generate endpoint) bytes can't travel, so a media element may
also be a ``data:<mime>;base64,<...>`` URL.

Limits (``PreprocessLimits``; each is a ``parameters`` entry of the same name in config.pbtxt)
-------------------------------------------------------------------------------------------
===========================  ==================  ==========================================================
parameter                    default             what it bounds
===========================  ==================  ==========================================================
``max_request_bytes``        67108864 (64 MiB)   text (or the messages JSON) + every media element as
                                                 received (encoded files, data URLs, float32 PCM);
                                                 checked before any decoding or JSON parsing
``max_messages``             64                  messages of a conversation (``messages``)
``max_images``               the engine's        images per request; default and ceiling: mm_llm's
                                                 ``limit_mm_per_prompt`` (4 when unknown)
``max_image_pixels``         16777216 (16 MP)    width*height of one image, read from its header before
                                                 any pixel is decoded, whatever PIL's global
                                                 ``MAX_IMAGE_PIXELS`` (which can only refuse earlier)
``max_audio_clips``          the engine's        ``audio`` and ``audio_pcm`` clips together per request;
                                                 default and ceiling as ``max_images`` (2 when unknown)
``max_audio_seconds``        the model's window  one clip. Default (``None``; ``"window"`` or empty in
                                                 config.pbtxt): ``n_samples / sampling_rate`` of the
                                                 feature extractor, 30 s for Whisper-style encoders. A
                                                 longer clip is rejected, never silently cut; a value
                                                 above the window is refused when the model loads
``max_total_audio_seconds``  60                  all clips of a request together
``max_videos``               the engine's        videos per request (families with video); default and
                                                 ceiling: ``limit_mm_per_prompt`` (1 when it has none); 0
                                                 refuses video
``max_video_seconds``        60                  one video, as its stream declares it, then as decoded
``max_video_frames``         256                 frames decoded per video, as declared, then counted
                                                 (decoding stops past it); only those the processor keeps
                                                 are converted to RGB
``max_video_frame_pixels``   2073600 (1080p)     width*height of a frame, from the stream's header first,
                                                 then from the first frame (all must have its size)
``max_decoded_bytes``        268435456 (256 MiB) what decoding creates for the request: RGB of the images
                                                 and of the video frames kept, float32 samples of the
                                                 audio files (every channel), each item counted from its
                                                 header before it is decoded
``max_prompt_tokens``        32768               ``input_ids`` after expansion (template, text, media
                                                 placeholders): bounds one request's work and tensors; the
                                                 placeholder tokens of images and videos (the processor's
                                                 own count) are counted before they are decoded. The
                                                 engine still checks its own ``max_model_len`` (4096 in
                                                 mm_llm's model.json) and answers with its own message
===========================  ==================  ==========================================================

Sample rates must lie in 1..768000 Hz (``MAX_SAMPLE_RATE``): a decoded clip is read no further than
its duration limit, so a highly compressed "audio bomb" can't expand past it either. With these
limits one request adds at most ``instance_memory_bound(limits, feature_bytes_per_token)`` to an
instance's resident memory (2.97 GiB at the defaults for Qwen vision; docs/RELIABILITY.md, Limits).

Errors
------
Every rejection is a ``PreprocessError`` (an ``mmserve.errors.InputError``: Triton ``INVALID_ARG``,
HTTP 400) whose message names the input and the item, then what is wrong, then the limit if one
applies: ``<input>[<item>]: <what is wrong> (<limit name>)``, e.g.
``image[1]: 100000000 pixels (10000x10000) exceeds the limit of 16777216 (max_image_pixels)``.
Items the processor itself rejects (an extreme aspect ratio, a clip too short to give one audio
embedding) are named too: when the processor fails, or an item yields no placeholder, each item is
processed again on its own to find it (on that error path only; success costs nothing more).
Non-finite values (NaN/Inf) are refused in the decoded audio and in every float feature tensor:
they would poison the engine's KV cache for later, unrelated requests.

Errors of ``messages`` name the place: ``messages: ...`` (the JSON as a whole, the media counts),
``messages[i]: ...`` (a message), ``messages[i].content[j]: ...`` (a part), e.g.
``messages: 2 image parts but 1 image given``.

Control tokens in user text
---------------------------
With the chat template applied, the tokenizer's special tokens typed by the user (``<|im_start|>``,
``<|im_end|>``, ``<|IMAGE|>``, ``<|AUDIO|>``, ...) must never act as template markers or placeholders.
``user_control_tokens="escape"`` (the default) tokenizes them as plain text (``escaping``: the
processor never sees the user's text on that path); ``"reject"`` refuses the request. In a
conversation every text, of any role, is such a text. With ``apply_chat_template=False`` the caller
writes the whole prompt on purpose, placeholders included, and it is used as it is.

Modules
-------
``limits`` (``PreprocessLimits``, ``PreprocessError``, torch threads per instance), ``messages``
(the conversation), ``media`` (image, audio and video decoding with their guards), ``escaping`` (control
tokens), ``processor`` (``Preprocessor``: the whole step), ``request`` (a request's Triton tensors).
"""

from mmserve.serving.preprocess.escaping import CONTROL_TOKEN_POLICIES, ControlTokenPolicy
from mmserve.serving.preprocess.limits import (
    PreprocessError,
    PreprocessLimits,
    available_cores,
    instance_memory_bound,
    threads_per_instance,
)
from mmserve.serving.preprocess.media import (
    AUDIO_FORMATS,
    AUDIO_IN_VIDEO_CODECS,
    IMAGE_FORMATS,
    MAX_SAMPLE_RATE,
    VIDEO_CODECS,
    VIDEO_CONTAINERS,
    payload_bytes,
)
from mmserve.serving.preprocess.messages import decode_text, parse_messages
from mmserve.serving.preprocess.processor import Preprocessor
from mmserve.serving.preprocess.request import PreprocessRequest, parse_preprocess_request

__all__ = [
    "AUDIO_FORMATS",
    "AUDIO_IN_VIDEO_CODECS",
    "CONTROL_TOKEN_POLICIES",
    "IMAGE_FORMATS",
    "MAX_SAMPLE_RATE",
    "VIDEO_CODECS",
    "VIDEO_CONTAINERS",
    "ControlTokenPolicy",
    "PreprocessError",
    "PreprocessLimits",
    "PreprocessRequest",
    "Preprocessor",
    "available_cores",
    "decode_text",
    "instance_memory_bound",
    "parse_messages",
    "parse_preprocess_request",
    "payload_bytes",
    "threads_per_instance",
]

"""What travels between clients and the models, with no heavy import (the client uses it).

* The request and response tensors of the public model (``mm_ensemble``) and of
  ``mm_llm``: Triton's vLLM backend's names plus the raw media inputs. The model repository's
  ``config.pbtxt`` files list the same tensors for Triton; ``tests/test_serving.py`` checks that they
  agree. The feature tensors between ``preprocess`` and ``mm_llm`` are the families' business
  (``mmserve.serving.contract``).
* How the class of an error travels to clients on Triton 2.51 (``mmserve.triton_seam``: ERROR_CODE_TAG):

Triton 2.51 drops the error code on the paths decoupled models answer on (gRPC stream responses
carry only a message; the HTTP generate endpoints answer 400 for any model error), so the models
start every error message with its class, ``[UNAVAILABLE] the engine failed ...``. Triton's own
answers about a model being unloaded or loaded carry no tag: ``TRITON_UNAVAILABLE`` recognizes them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: its name, dtype, symbolic dims and meaning."""

    name: str
    dtype: str
    """numpy's name of its dtype (``object`` for Triton's BYTES/TYPE_STRING). For a family's feature
    field, the HF processor's output dtype; validation accepts any dtype of the same kind (floating
    point or integer): offline callers may pass e.g. bfloat16."""
    dims: tuple[str | int, ...]
    """Symbolic dims (named when variable, an int when fixed), e.g. ``("images", 3)``."""
    meaning: str
    optional: bool = False
    """A family's feature field that may be left out (or sent empty) even with items."""

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def is_float(self) -> bool:
        return self.dtype.startswith(("float", "bfloat"))

    @property
    def shape(self) -> str:
        return "(" + ", ".join(str(d) for d in self.dims) + ")"

    @property
    def triton_dims(self) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else -1 for d in self.dims)


def _flag(name: str, meaning: str) -> TensorSpec:
    return TensorSpec(name, "bool", (1,), meaning)


# ------------------------------------------------------------------------------------- requests
TEXT_INPUT = TensorSpec(
    "text_input",
    "object",
    (1,),
    "the prompt (UTF-8); required unless messages. mm_llm echoes it before the output unless exclude_input_in_output",
)
MESSAGES = TensorSpec(
    "messages",
    "object",
    (1,),
    "a whole conversation instead of text_input: a UTF-8 JSON "
    "array of chat messages whose media parts refer, in order, to image, video and the audio clips "
    "(docs/tensors.md)",
)
RAW_MEDIA_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("image", "object", ("images",), "encoded image files (PNG, JPEG, ...) or data: URLs"),
    TensorSpec("audio", "object", ("clips",), "encoded audio files (WAV, FLAC, MP3, ...) or data: URLs"),
    TensorSpec("audio_pcm", "float32", ("samples",), "one mono clip of float PCM, after the audio files"),
    TensorSpec("audio_sample_rate", "int32", (1,), "audio_pcm's sample rate in Hz; required with it"),
    _flag("apply_chat_template", "wrap text_input in the model's chat template (default true)"),
)
VIDEO = TensorSpec(
    "video", "object", ("videos",), "encoded video files (MP4, MOV, WebM, MKV) or data: URLs; models with video only"
)
TOOLS = TensorSpec(
    "tools",
    "object",
    (1,),
    "the function tools of a conversation (messages), for the chat template: a UTF-8 JSON array of "
    'OpenAI tools {"type": "function", "function": {...}} (docs/tensors.md)',
)
USE_AUDIO_IN_VIDEO = _flag(
    "use_audio_in_video",
    "each video's audio track is heard too, its placeholders interleaved with the frames' "
    "(Qwen2.5-Omni; the HF processor's use_audio_in_video; default false)",
)
PREPROCESS_INPUTS: tuple[TensorSpec, ...] = (TEXT_INPUT, *RAW_MEDIA_INPUTS, MESSAGES, VIDEO, TOOLS, USE_AUDIO_IN_VIDEO)
"""What ``preprocess`` takes: one raw request (a prompt in ``text_input``, or a conversation in ``messages``)."""

STREAM = _flag("stream", "one response per generated delta (default false: one response)")
SAMPLING_PARAMETERS = TensorSpec(
    "sampling_parameters", "object", (1,), "vLLM SamplingParams as a JSON object (mmserve.serving.sampling)"
)
FLAG_INPUTS: tuple[TensorSpec, ...] = (
    STREAM,
    _flag(
        "exclude_input_in_output",
        "leave text_input out of a non-streamed text_output (a stream never echoes it: false is refused)",
    ),
    _flag("return_finish_reason", 'add finish_reason ("None" until the final response)'),
    _flag("return_cumulative_logprob", "add cumulative_logprob (the output's so far)"),
    _flag("return_logprobs", "add logprobs (JSON; null unless sampling_parameters asks for logprobs)"),
    _flag("return_num_input_tokens", "add num_input_tokens"),
    _flag("return_num_output_tokens", "add num_output_tokens"),
)
"""The boolean switches of a generation request, as Triton's vLLM backend names them."""
CANCEL_KEY = TensorSpec(
    "cancel_key",
    "object",
    (1,),
    "a secret of the client's own (16 to 128 bytes, e.g. a random token): only a cancel that repeats "
    "it, for this request's id, cancels this request (mmserve.client.new_cancel_key); without it the "
    "request can be cancelled only by cancelling its own stream or connection",
)
GENERATION_INPUTS: tuple[TensorSpec, ...] = (STREAM, SAMPLING_PARAMETERS, *FLAG_INPUTS[1:], CANCEL_KEY)
"""How to generate: what ``mm_llm`` takes beside the prompt (in this order in the configs)."""
PUBLIC_INPUTS: tuple[TensorSpec, ...] = (*PREPROCESS_INPUTS, *GENERATION_INPUTS)
"""What ``mm_ensemble`` takes."""
CANCEL = TensorSpec(
    "cancel",
    "object",
    (1,),
    "a control request to mm_llm: cancel the request in flight whose Triton request id this is and "
    "whose cancel_key the control request repeats (mmserve.client.cancel_tensors); answered alike "
    "whether or not such a request exists",
)
DRAIN = TensorSpec(
    "drain",
    "float32",
    (1,),
    "a control request to mm_llm before a stop: refuse new requests, "
    "give those in flight this many seconds, then end them UNAVAILABLE; answered once none is "
    "in flight (mmserve.drain); only with operator_key",
)
LORA_ADAPTERS = TensorSpec(
    "lora_adapters",
    "object",
    (1,),
    'a control request to mm_llm: change the LoRA adapters served while serving, JSON {"load": '
    '{name: folder}}, {"unload": [name]} or {"reload": true} (multi_lora.json again); answered with '
    "text_output, the adapters now served as JSON {name: folder} (mmserve.serving.lora); only with operator_key",
)
OPERATOR_KEY = TensorSpec(
    "operator_key",
    "object",
    (1,),
    "the operator's key (mmserve.operator), which a drain or a change of the adapters must carry: refused without it",
)

# ------------------------------------------------------------------------------------ responses
OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_output", "object", ("texts",), "the generated text (the delta when streaming)"),
    TensorSpec("output_ids", "int64", ("tokens",), "the generated token ids (the delta when streaming)"),
    TensorSpec(
        "finish_reason", "object", ("texts",), 'stop, length, abort; "None" before the last (return_finish_reason)'
    ),
    TensorSpec("cumulative_logprob", "float32", ("values",), "(return_cumulative_logprob)"),
    TensorSpec("logprobs", "object", ("texts",), "per token, JSON (return_logprobs)"),
    TensorSpec(
        "prompt_logprobs",
        "object",
        ("texts",),
        "per prompt token, JSON: null for the first, then {token id: {logprob, rank, decoded_token}}; "
        "in the first response (sampling_parameters.prompt_logprobs)",
    ),
    TensorSpec("num_input_tokens", "uint32", ("values",), "prompt length (return_num_input_tokens)"),
    TensorSpec("num_output_tokens", "uint32", ("values",), "tokens generated so far (return_num_output_tokens)"),
)
"""What ``mm_llm`` (and so ``mm_ensemble``) answers."""


def names(specs: tuple[TensorSpec, ...]) -> tuple[str, ...]:
    return tuple(spec.name for spec in specs)


# --------------------------------------------------------------------------------------- errors

CODES = ("INVALID_ARG", "UNAVAILABLE", "CANCELLED", "INTERNAL")
TAG = re.compile(r"\[(" + "|".join(CODES) + r")\] ")
"""The tag in a message; not always at its start (Triton's ensemble prefixes "in ensemble '...', ")."""
TRITON_UNAVAILABLE = ("unknown model", "has no available versions", "is not ready", "unloading", "Server is stopping")
"""What Triton says (code INTERNAL or NOT_FOUND) of a model that is not loaded or being (un)loaded."""


def tagged(code: str, message: str) -> str:
    return f"[{code}] {message}"


def finish_reason(value: str | None) -> str | None:
    """A ``finish_reason`` output as a reason: None for a response before the last (which carries
    ``"None"``, as Triton's vLLM backend sends it) or for an absent or empty one."""
    return None if value in (None, "", "None") else value


def code_of(message: str) -> str | None:
    """The class of an error message: its tag, ``UNAVAILABLE`` for Triton's own "model not
    available" answers, else None."""
    tag = TAG.search(message)
    if tag:
        return tag.group(1)
    if any(marker in message for marker in TRITON_UNAVAILABLE):
        return "UNAVAILABLE"
    return None

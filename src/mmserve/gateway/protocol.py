"""The request of ``POST /v1/chat/completions`` as pydantic models, and how a bad one is told.

What is accepted is what the gateway can serve faithfully; everything else is refused with a 400
that names the field, never silently dropped:

* messages: ``system`` (and ``developer``, its newer name), ``user``, ``assistant`` (with its
  ``tool_calls``, content then optional) and ``tool`` (``tool_call_id``) turns, any number, content
  a string or a list of parts. User parts: ``text``, ``image_url`` (``data:`` URLs;
  ``http(s)`` when the gateway allows remote media; ``detail`` accepted and ignored: the model's
  processor picks the resolution), ``input_audio`` (``{"data": base64, "format": "wav"|"mp3"|"flac"|
  "ogg"}``), ``audio_url`` (vLLM's: a ``data:`` URL of an audio file; ``http(s)`` when remote media
  are allowed), ``video_url`` (vLLM's: the same for a video file, for models that take video), in
  any order. System and assistant parts: ``text``. A message's ``name`` is accepted
  and ignored (the chat templates have no place for it).
* sampling: ``max_tokens``/``max_completion_tokens`` (absent: up to the model's context length),
  ``temperature``, ``top_p``, ``presence_penalty``, ``frequency_penalty``, ``seed``, ``stop``,
  ``logit_bias``, ``n`` (up to ``MAX_N`` choices, each its own request on the engine, seeded
  ``seed + index`` as vLLM seeds its parallel samples), ``logprobs``/``top_logprobs``, vLLM's ``prompt_logprobs`` (not streamed, as vLLM); vLLM's extensions ``top_k``,
  ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
  ``bad_words``, ``allowed_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``,
  ``spaces_between_special_tokens``, ``stream_interval``; ``echo`` (vLLM echoes a last assistant
  message; a conversation here ends with a user's or a tool's: nothing to echo). Ranges are the
  engine's (``mmserve.serving.sampling``), checked there and answered 400.
* structured output: ``response_format`` (``text``, ``json_object``, ``json_schema`` with its
  ``schema``; ``strict`` accepted: the output follows the schema either way) and vLLM's
  ``structured_outputs`` extension (one of ``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``), as vLLM's server maps them: ``response_format`` sets the constraint of
  ``structured_outputs``. Checked by ``mm_llm`` (``mmserve.serving.sampling``) and vLLM's front end,
  answered 400.
* vLLM's ``mm_processor_kwargs``: ``{"use_audio_in_video": true}`` only (Qwen2.5-Omni hears each
  video's audio track too); other processor settings are the deployment's.
* tool calling: ``tools`` (functions), ``tool_choice`` (``none``, ``auto``, the default with
  tools, ``required``, a named function), ``parallel_tool_calls``, as ``vllm serve
  --enable-auto-tool-choice --tool-call-parser hermes`` serves them (``mmserve.gateway.tools``).
* ``stream``, ``stream_options`` (``include_usage``; ``include_obfuscation`` ignored).
* ignored (no effect on the output): ``user``, ``metadata``, ``safety_identifier``,
  ``prompt_cache_key``, ``service_tier`` (``IGNORED``), and the fields of ``UNSUPPORTED`` at their
  defaults (``modalities: ["text"]``, ``store: false``, ...).
* refused: the legacy ``functions``/``function_call``, audio output, predicted outputs, web search,
  reasoning effort, stored completions, and vLLM's extensions this chain doesn't take (a chat
  template or processor settings per request, truncation, beam search, reasoning, disaggregation,
  ...), each with its reason (``UNSUPPORTED``); any other field (``unknown_field``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from mmserve.chat import Strict, TextPart, Tool, ToolMessage, problem
from mmserve.gateway.errors import APIError, invalid

AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")


# -- content parts ---------------------------------------------------------------------------------
class ImageURL(Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(Strict):
    data: str
    format: Literal["wav", "mp3", "flac", "ogg"]


class AudioPart(Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioURL(Strict):
    url: str


class AudioURLPart(Strict):
    type: Literal["audio_url"]
    audio_url: AudioURL


class VideoURL(Strict):
    url: str


class VideoURLPart(Strict):
    type: Literal["video_url"]
    video_url: VideoURL


UserPart = Annotated[TextPart | ImagePart | AudioPart | AudioURLPart | VideoURLPart, Field(discriminator="type")]


# -- messages -------------------------------------------------------------------------------------
class SystemMessage(Strict):
    role: Literal["system", "developer"]
    content: str | list[TextPart]
    name: str | None = None


class UserMessage(Strict):
    role: Literal["user"]
    content: str | list[UserPart]
    name: str | None = None


class ToolCallFunction(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    """A call the assistant made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(Strict):
    role: Literal["assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class JSONSchema(Strict):
    """``response_format.json_schema``: OpenAI's wrapper of a JSON schema."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the grammar backend holds the output to the schema either way


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # ignored: no obfuscation padding here


class ChatCompletionRequest(Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    n: int | None = Field(default=None, ge=1, le=16)  # MAX_N
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    prompt_logprobs: int | None = Field(default=None, ge=-1)  # vLLM's: per prompt token, not streamed
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # vLLM's extensions of the OpenAI API
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    stream_interval: int | None = None
    echo: bool | None = None  # vLLM echoes a last assistant message: a conversation here ends with a user's or tool's
    return_token_ids: bool | None = None  # each choice (each chunk's, streamed) carries its token ids
    structured_outputs: dict[str, Any] | None = None  # vLLM's constraints, checked by mm_llm's parser
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    use_audio_in_video: bool = False  # vLLM's mm_processor_kwargs.use_audio_in_video (Qwen2.5-Omni)
    parallel_tool_calls: bool | None = None  # false: at most one call per choice
    # accepted, no effect
    user: str | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None


MAX_N = 16
"""The most choices per request (``n``): each is a request of its own on the engine."""

IGNORED = ("user", "metadata", "safety_identifier", "prompt_cache_key", "service_tier")


def _default(*values: Any):
    return lambda value: value is None or value in values


UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "functions": (_default([]), "function calling is not supported by this server"),
    "function_call": (_default("none"), "function calling is not supported by this server"),
    "modalities": (_default(["text"]), 'this model answers in text only (modalities: ["text"])'),
    "audio": (_default(), "audio output is not supported: this model answers in text"),
    "prediction": (_default(), "predicted outputs are not supported by this server"),
    "web_search_options": (_default(), "web search is not supported by this server"),
    "reasoning_effort": (_default(), "reasoning_effort is not supported by this model"),
    "verbosity": (_default(), "verbosity is not supported by this model"),
    "store": (_default(False), "stored completions are not supported by this server"),
    # vLLM's extensions of the chat API that this chain does not take
    **dict.fromkeys(
        ("chat_template", "chat_template_kwargs", "documents"),
        (_default(), "preprocess renders every conversation with the model's own chat template"),
    ),
    "add_generation_prompt": (_default(True), "the prompt always ends with the generation prompt"),
    "continue_final_message": (_default(False), "a conversation ends with a user or tool message"),
    "add_special_tokens": (_default(False), "the chat template places the special tokens"),
    "mm_processor_kwargs": (
        lambda value: value is None or (isinstance(value, dict) and set(value) <= {"use_audio_in_video"}),
        "preprocess runs the model's processor with its deployment's settings (config.pbtxt); of "
        "mm_processor_kwargs only use_audio_in_video is taken",
    ),
    "media_io_kwargs": (
        _default(),
        "preprocess runs the model's processor with its deployment's settings (config.pbtxt)",
    ),
    **dict.fromkeys(
        ("truncate_prompt_tokens", "truncation_side"),
        (_default(), "prompts are not truncated here: one over the context is refused"),
    ),
    "use_beam_search": (_default(False), "beam search is not served"),
    "length_penalty": (_default(1.0), "beam search is not served"),
    "include_reasoning": (_default(True), "these models have no reasoning parser"),
    "thinking_token_budget": (_default(), "these models have no reasoning parser"),
    **dict.fromkeys(
        (
            "kv_transfer_params",
            "ec_transfer_params",
            "priority",
            "cache_salt",
            "request_id",
            "session_id",
            "vllm_xargs",
            "logprob_token_ids",
            "return_tokens_as_token_ids",
            "return_token_offsets",
            "return_prompt_text",
            "return_mm_kwargs",
            "mm_payload",
            "watermarking",
            "repetition_detection",
            "routed_experts_prompt_start",
        ),
        (_default(), "this vLLM extension is not served by this gateway"),
    ),
}
"""Fields the gateway knows but can't honour (OpenAI's, then vLLM's extensions): (value that is
harmless, why it is refused)."""


def parse_request(body: Any) -> ChatCompletionRequest:
    """The validated request, or an ``APIError`` (400) naming the field."""
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, found {type(body).__name__}", code="invalid_json")
    body = dict(body)
    if "use_audio_in_video" in body:  # a field of the model below, not of the API: mm_processor_kwargs's
        raise invalid("use_audio_in_video: unknown field", param="use_audio_in_video", code="unknown_field")
    for name, (harmless, why) in UNSUPPORTED.items():
        if name in body:
            value = body.pop(name)
            if not harmless(value):
                raise invalid(why, param=name, code="unsupported")
            if name == "mm_processor_kwargs" and value:
                body["use_audio_in_video"] = value["use_audio_in_video"]
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc, body) from None
    if request.prompt_logprobs is not None and request.stream and request.prompt_logprobs != 0:
        raise invalid("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
    if request.top_logprobs is not None and not request.logprobs:
        raise invalid("top_logprobs needs logprobs: true", param="top_logprobs")
    if (
        request.max_tokens is not None
        and request.max_completion_tokens is not None
        and request.max_tokens != request.max_completion_tokens
    ):
        raise invalid("max_tokens and max_completion_tokens differ; give one", param="max_completion_tokens")
    if request.response_format is not None and request.response_format.type == "json_schema":
        if request.response_format.json_schema is None:
            raise invalid(
                'response_format: type "json_schema" needs its json_schema', param="response_format.json_schema"
            )
    elif request.response_format is not None and request.response_format.json_schema is not None:
        raise invalid(
            f'response_format: json_schema is only allowed with type "json_schema", found {request.response_format.type!r}',
            param="response_format.json_schema",
        )
    if request.stream_options is not None and not request.stream:
        raise invalid("stream_options is only allowed with stream: true", param="stream_options")
    _check_tools(request, body)
    return request


def _check_tools(request: ChatCompletionRequest, body: dict[str, Any]) -> None:
    """vLLM's rules (``ChatCompletionRequest.check_tool_usage``): ``tool_choice`` defaults to
    ``auto`` with tools, names one of them, and a named one excludes other structured outputs."""
    if request.tools == []:
        raise invalid(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
            param="tools",
        )
    if "tool_choice" not in body and request.tools:
        request.tool_choice = "auto"
    choice = request.tool_choice
    if choice is None or choice == "none":
        return
    if not request.tools:
        raise invalid("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {tool.function.name for tool in request.tools}:
            raise invalid(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                param="tool_choice",
            )
        if any(key in (request.structured_outputs or {}) for key in ("json", "regex", "choice")):
            raise invalid(
                "You can only either use constraints for structured outputs or tools, not both.",
                param="structured_outputs",
            )


def validation_error(exc: ValidationError, data: Any) -> APIError:
    """pydantic's most specific error, as a 400 naming the field (``mmserve.chat.problem``)."""
    found = problem(exc, data)
    return invalid(str(found), param=found.param or None, code=found.code)

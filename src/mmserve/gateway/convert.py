"""OpenAI chat request -> the Triton request tensors of ``mm_ensemble``, and mm_llm's
``logprobs`` output -> OpenAI's.

The conversation travels whole in the ``messages`` tensor (UTF-8 JSON, ``preprocess`` applies the
model's chat template): ``[{"role", "content": str | [{"type": "text", "text"} | {"type": "image"} |
{"type": "audio"} | {"type": "video"}]}]`` (an assistant's ``tool_calls``, a tool's
``tool_call_id`` beside), the request's ``tools`` in the ``tools`` tensor; its media parts refer, in order of appearance, to the
``image``, ``audio`` and ``video`` items (encoded files), which the gateway decodes from
the request's base64 (or fetches, for remote URLs when allowed). The media bytes are not decoded
here: ``preprocess`` checks and decodes them (and answers ``[INVALID_ARG]`` for a bad file). The
media parts of the whole request are counted against the limits first, before anything is decoded
or fetched (``check_media_counts``), as ``vllm serve`` refuses more than ``limit_mm_per_prompt``
items; remote ones are then fetched a few at a time (``FETCHES_IN_FLIGHT``).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmserve import dataurl
from mmserve.gateway import tools
from mmserve.gateway.errors import APIError, invalid
from mmserve.gateway.protocol import (
    AssistantMessage,
    AudioPart,
    AudioURLPart,
    ChatCompletionRequest,
    ImagePart,
    SystemMessage,
    TextPart,
    ToolMessage,
    VideoURLPart,
)

Fetch = Callable[[str, str], Awaitable[bytes]]
"""``fetch(url, param)``: the bytes of a remote (http/https) image or audio file, or an ``APIError``."""

MEDIA_LIMITS: Mapping[str, int] = {"image": 4, "audio": 2, "video": 1}
"""Media items per request and modality when the gateway is told nothing else: the shipped
``mm_llm/model.json``'s ``limit_mm_per_prompt`` (and ``preprocess``'s defaults); the gateway's
``--limit-mm-per-prompt`` sets them (set it to the engine's when that is changed)."""

FETCHES_IN_FLIGHT = 4
"""Remote media items of one request fetched at once (``--media-fetches-in-flight``)."""

_MEDIA_NOUNS = {"image": ("image", "images"), "audio": ("audio clip", "audio clips"), "video": ("video", "videos")}


def _media_kind(part: Any) -> str | None:
    if isinstance(part, ImagePart):
        return "image"
    if isinstance(part, AudioURLPart | AudioPart):
        return "audio"
    if isinstance(part, VideoURLPart):
        return "video"
    return None


def check_media_counts(request: ChatCompletionRequest, limits: Mapping[str, int]) -> None:
    """Refuse a request with more media items of a modality than ``limits`` (modality -> most items
    per request; a modality absent is not limited here) with a 400 naming the first part over the
    limit. Only the parts are counted: nothing is decoded or fetched before this."""
    counts: dict[str, int] = {}
    first_over: dict[str, str] = {}
    for i, message in enumerate(request.messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            kind = _media_kind(part)
            if kind is None:
                continue
            counts[kind] = counts.get(kind, 0) + 1
            if kind in limits and counts[kind] > limits[kind]:
                first_over.setdefault(kind, f"messages[{i}].content[{j}]")
    if first_over:
        kind, where = next(iter(first_over.items()))  # the modality that went over first
        (one, many), count, limit = _MEDIA_NOUNS[kind], counts[kind], limits[kind]
        raise invalid(
            f"{where}: the request has {count} {one if count == 1 else many}; "
            + (f"at most {limit} may be provided in one request" if limit else f"this server takes no {many}")
            + " (--limit-mm-per-prompt)",
            param=where,
            code="too_many_media_items",
        )


async def _fetch_all(fetch: Fetch, jobs: Sequence[tuple[str, str]], in_flight: int) -> list[bytes]:
    """``fetch(url, param)`` of every job, at most ``in_flight`` at once; the first failure cancels
    the fetches still running and is raised."""
    results = [b""] * len(jobs)
    queue = iter(enumerate(jobs))

    async def worker() -> None:
        for index, (url, param) in queue:  # one iterator shared by the workers
            results[index] = await fetch(url, param)

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(min(max(1, in_flight), len(jobs))):
                group.create_task(worker())
    except BaseExceptionGroup as failed:
        first = next((exc for exc in failed.exceptions if isinstance(exc, APIError)), failed.exceptions[0])
        raise first from None
    return results


@dataclass
class Conversation:
    """What the request's messages become: the ``messages`` JSON and the media, in order."""

    messages: list[dict[str, Any]]
    images: list[bytes] = field(default_factory=list)
    audios: list[bytes] = field(default_factory=list)
    videos: list[bytes] = field(default_factory=list)


def b64decode(data: str, param: str, what: str) -> bytes:
    """Strict base64 (whitespace allowed) -> bytes; ``APIError`` when malformed or empty."""
    try:
        return dataurl.b64decode(data, what)
    except dataurl.DataURLError as exc:
        raise invalid(f"{param}: {exc}", param=param) from None


def data_url_bytes(url: str, param: str) -> bytes:
    """The payload of a ``data:<type>;base64,<data>`` URL."""
    try:
        return dataurl.data_url_payload(url)
    except dataurl.DataURLError as exc:
        raise invalid(f"{param}: {exc}", param=param) from None


_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
"""A URL's scheme (RFC 3986), read without parsing the rest: the host is read by the HTTP client's
own parser only (``media.MediaFetcher``), never by a second one that may read it otherwise."""


def media_source(url: str, param: str, remote: bool, kind: str = "image") -> bytes | str:
    """An ``image_url.url`` (``audio_url.url``): the bytes of a data URL, or the http(s) URL to
    fetch (when ``remote``)."""
    if dataurl.is_data_url(url):
        return data_url_bytes(url, param)
    scheme = match.group(1).lower() if (match := _SCHEME.match(url)) else ""
    if scheme in ("http", "https"):
        if not remote:
            raise invalid(
                f"{param}: remote {kind} URLs are disabled on this server (its operator may enable "
                f"them: --allow-remote-media); send the {kind} as a data: URL",
                param=param,
                code="remote_media_disabled",
            )
        return url
    raise invalid(
        f"{param}: expected a data: URL (or http(s) when enabled), found scheme {scheme or 'none'!r}", param=param
    )


def audio_bytes(data: str, param: str) -> bytes:
    """``input_audio.data``: base64 (a data URL is accepted too)."""
    if dataurl.is_data_url(data):
        return data_url_bytes(data, param)
    return b64decode(data, param, "the audio data")


async def conversation(
    request: ChatCompletionRequest,
    fetch: Fetch | None = None,
    max_bytes: int | None = None,
    *,
    limits: Mapping[str, int] | None = None,
    fetches_in_flight: int = FETCHES_IN_FLIGHT,
) -> Conversation:
    """The request's messages in ``preprocess``'s form, with the media bytes in order of appearance.
    ``fetch``: how to get a remote image (``None``: remote URLs are refused); ``max_bytes``: the
    largest media item (decoded) taken; ``limits``: the most media items per modality
    (``check_media_counts``, before anything else; ``None``: not counted here);
    ``fetches_in_flight``: the most remote items fetched at once."""
    if limits is not None:
        check_media_counts(request, limits)

    def bounded(data: bytes, param: str) -> bytes:
        if max_bytes is not None and len(data) > max_bytes:
            raise invalid(
                f"{param}: {len(data)} bytes, more than the limit of {max_bytes} (--media-max-bytes)",
                param=param,
                code="media_too_large",
            )
        return data

    out = Conversation(messages=[])
    remote: list[tuple[list[bytes], int, str, str]] = []  # (images or audios, index there, URL, param)

    def add(items: list[bytes], url: str, param: str, kind: str) -> None:
        source = media_source(url, param, remote=fetch is not None, kind=kind)
        if isinstance(source, str):
            remote.append((items, len(items), source, param))
            source = b""
        items.append(bounded(source, param))

    for i, message in enumerate(request.messages):
        role = "system" if isinstance(message, SystemMessage) else message.role
        extra: dict[str, Any] = {}
        if isinstance(message, AssistantMessage) and message.tool_calls:
            extra["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        elif isinstance(message, ToolMessage):
            extra["tool_call_id"] = message.tool_call_id
        if message.content is None:  # an assistant's: a call without text (or nothing, as vLLM renders it)
            out.messages.append({"role": role, "content": None, **extra} if extra else {"role": role, "content": ""})
            continue
        if isinstance(message.content, str):
            out.messages.append({"role": role, "content": message.content, **extra})
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
            elif isinstance(part, ImagePart):
                parts.append({"type": "image"})
                add(out.images, part.image_url.url, f"{where}.image_url.url", "image")
            elif isinstance(part, AudioURLPart):
                parts.append({"type": "audio"})
                add(out.audios, part.audio_url.url, f"{where}.audio_url.url", "audio")
            elif isinstance(part, VideoURLPart):
                parts.append({"type": "video"})
                add(out.videos, part.video_url.url, f"{where}.video_url.url", "video")
            elif isinstance(part, AudioPart):
                parts.append({"type": "audio"})
                param = f"{where}.input_audio.data"
                out.audios.append(bounded(audio_bytes(part.input_audio.data, param), param))
        if not parts:
            raise invalid(f"messages[{i}].content: empty list", param=f"messages[{i}].content")
        out.messages.append({"role": role, "content": parts, **extra})
    if remote:
        assert fetch is not None
        fetched = await _fetch_all(fetch, [(url, param) for _, _, url, param in remote], fetches_in_flight)
        for (items, index, _, _), data in zip(remote, fetched, strict=True):
            items[index] = data
    return out


def sampling_parameters(
    request: ChatCompletionRequest, choice: int = 0, *, lora_name: str | None = None
) -> dict[str, Any]:
    """mm_llm's ``sampling_parameters`` (vLLM ``SamplingParams`` names) of the request's choice
    ``choice`` (``n`` > 1: one request per choice, seeded ``seed + choice`` as vLLM seeds the
    parallel samples of one request); ``lora_name``: the adapter the request's ``model`` names."""
    params: dict[str, Any] = {}
    if lora_name is not None:
        params["lora_name"] = lora_name
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    params["max_tokens"] = max_tokens  # None (JSON null): up to the context length; mm_llm's default is 16
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "stop",
        "logit_bias",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "bad_words",
        "allowed_token_ids",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "stream_interval",
    ):
        value = getattr(request, name)
        if value is not None:
            params[name] = value
    if request.seed is not None:
        params["seed"] = request.seed + choice
    if request.logprobs:
        params["logprobs"] = request.top_logprobs or 0  # 0: the sampled token's only
    if request.prompt_logprobs is not None:
        params["prompt_logprobs"] = request.prompt_logprobs
    structured = dict(request.structured_outputs or {})
    response_format = request.response_format
    if response_format is not None and response_format.type == "json_object":
        structured["json_object"] = True  # as vLLM's server: response_format sets the constraint
    elif response_format is not None and response_format.json_schema is not None:
        structured["json"] = response_format.json_schema.schema_
    if structured:
        params["structured_outputs"] = structured
    params.update(tools.sampling(request))  # mm_llm constrains the calls as vLLM's server does
    return params


def request_tensors(
    request: ChatCompletionRequest, conv: Conversation, *, lora_name: str | None = None
) -> list[dict[str, np.ndarray]]:
    """The named tensors (``mmserve.wire`` names) of the Triton request of each of the request's
    ``n`` choices: the same but for their ``sampling_parameters`` (the seed). ``lora_name``: the
    LoRA adapter that answers (mm_llm's ``multi_lora.json`` name), None: the base model."""
    first = _request_tensors(request, conv, lora_name)
    return [first] + [
        {**first, "sampling_parameters": _sampling_tensor(request, choice, lora_name)}
        for choice in range(1, request.n or 1)
    ]


def _sampling_tensor(request: ChatCompletionRequest, choice: int, lora_name: str | None) -> np.ndarray:
    params = sampling_parameters(request, choice, lora_name=lora_name)
    return np.array([json.dumps(params).encode()], dtype=np.object_)


def _request_tensors(
    request: ChatCompletionRequest, conv: Conversation, lora_name: str | None
) -> dict[str, np.ndarray]:

    def flag(value: bool) -> np.ndarray:
        return np.array([value], dtype=bool)

    tensors = {
        "messages": np.array([json.dumps(conv.messages, ensure_ascii=False).encode()], dtype=np.object_),
        "stream": flag(bool(request.stream)),
        "sampling_parameters": _sampling_tensor(request, 0, lora_name),
        "exclude_input_in_output": flag(True),
        "return_finish_reason": flag(True),
    }
    # Each output asked for is a tensor in every streamed response (~40 µs of server CPU each,
    # docs/PERFORMANCE.md): the prompt's length only where usage is reported; the completion's is
    # counted from output_ids (``Delta.num_output_tokens``).
    if not request.stream or (request.stream_options is not None and request.stream_options.include_usage):
        tensors["return_num_input_tokens"] = flag(True)
    if request.logprobs:
        tensors["return_logprobs"] = flag(True)
    if conv.images:
        tensors["image"] = _bytes_array(conv.images)
    if conv.audios:
        tensors["audio"] = _bytes_array(conv.audios)
    if conv.videos:
        tensors["video"] = _bytes_array(conv.videos)
        if request.use_audio_in_video:
            tensors["use_audio_in_video"] = flag(True)
    if request.tools:
        dumped = [tool.model_dump(exclude_none=True) for tool in request.tools]
        tensors["tools"] = np.array([json.dumps(dumped, ensure_ascii=False).encode()], dtype=np.object_)
    return tensors


def _bytes_array(items: Sequence[bytes]) -> np.ndarray:
    array = np.empty(len(items), dtype=np.object_)
    array[:] = list(items)
    return array


def openai_logprobs(
    steps: list[dict[str, dict[str, Any]]], token_ids: Sequence[int], top_logprobs: int
) -> list[dict[str, Any]]:
    """mm_llm's ``logprobs`` (per generated token ``{token_id: {logprob, rank, decoded_token}}``: the
    sampled token and the top ``top_logprobs``) -> OpenAI's ``logprobs.content`` entries.

    Faithful but for one detail: ``bytes`` are the UTF-8 of vLLM's decoded token text, so a token
    holding part of a multi-byte character shows U+FFFD's bytes where OpenAI gives the raw ones.
    """
    if len(steps) != len(token_ids):
        raise APIError(500, "logprobs and output ids disagree", type="server_error", code="internal_error")

    def entry(token_id: str, info: dict[str, Any]) -> dict[str, Any]:
        token = info.get("decoded_token") or ""
        logprob = info.get("logprob")
        logprob = -9999.0 if logprob is None or logprob == float("-inf") else float(logprob)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}

    content = []
    for step, sampled in zip(steps, token_ids, strict=True):
        info = step.get(str(sampled))
        if info is None:
            raise APIError(500, "the sampled token's logprob is missing", type="server_error", code="internal_error")
        top = sorted(
            ((k, v) for k, v in step.items() if v.get("rank") is not None and v["rank"] <= top_logprobs),
            key=lambda kv: kv[1]["rank"],
        )[:top_logprobs]
        content.append({**entry(str(sampled), info), "top_logprobs": [entry(k, v) for k, v in top]})
    return content

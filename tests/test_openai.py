"""The OpenAI-compatible gateway (``python -m mmserve.gateway``) against the session's real tritonserver,
with the official ``openai`` SDK as the client.

Greedy outputs equal the Triton path: the offline-vLLM references of the e2e workload (the same media
and prompts as test_e2e_server.py) and ``mmserve.client`` through ``mm_ensemble``; a multi-turn
conversation (an image in an earlier turn) equals ``mm_ensemble`` given the prompt the model's own
chat template renders of it. Streaming, usage, logprobs, stop strings, errors (400 for bad input,
503 when Triton is unreachable) and a client's disconnect (the engine request is aborted).
Fast tests of the same code without a server: test_gateway_unit.py.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from mmserve_dev.samples import WEATHER_TOOL

from utils import (
    COLOR_SCHEMA,
    MAX_TOKENS,
    PARALLEL,
    PARALLEL_REFERENCES,
    PROMPT_LOGPROBS,
    PROMPT_LOGPROBS_CASE,
    PROMPT_LOGPROBS_REFERENCE,
    ROOT,
    STRUCTURED,
    STRUCTURED_MAX_TOKENS,
    STRUCTURED_REFERENCES,
    Relay,
    assert_cancel_stopped_the_engine,
    assert_meets_constraint,
    assert_prompt_logprobs_equal,
    generated_after_cancel,
    wait_for,
)
from utils import client as triton_client
from utils import sampling as _sampling

pytestmark = pytest.mark.server

GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS}


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


class Gateway:
    """``python -m mmserve.gateway`` in a subprocess on a free port; always stopped."""

    def __init__(self, triton_url: str, log: Path, *extra_args: str, env: dict[str, str] | None = None) -> None:
        from mmserve_dev.triton import free_ports

        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "mmserve.gateway",
                    "--triton-url",
                    triton_url,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--log-level",
                    "warning",
                    *extra_args,
                ],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )
        deadline = time.time() + 60
        while True:
            try:
                if _get(f"{self.url}/v1/models")[0] == 200:
                    return
            except OSError:
                pass
            if self.process.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"the gateway did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)

    def sdk(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=180)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def gateway(server, tmp_path_factory, tiny_models):
    """The gateway as scripts/serve.sh starts it: text-only requests rendered by the gateway and sent
    to mm_llm directly (--tokenizer: the served checkpoint), the others through mm_ensemble."""
    gateway = Gateway(
        server.grpc, tmp_path_factory.mktemp("gateway") / "gateway.log", "--tokenizer", str(tiny_models["qwen2_5_omni"])
    )
    try:
        yield gateway
    finally:
        gateway.stop()


@pytest.fixture(scope="module")
def sdk(gateway):
    return gateway.sdk()


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def user_turn(case) -> dict:
    """The case's request as one user message: its images, then its clips, then its text (the order
    of mm_ensemble's ``text_input`` template and of the references)."""
    return {
        "role": "user",
        "content": [*map(image_part, case.images), *map(audio_part, case.audios), {"type": "text", "text": case.text}],
    }


# -- outputs --------------------------------------------------------------------------------------
@pytest.mark.parametrize("case_name", ["text_only#0", "image#0", "audio#0", "image_audio#1"])
def test_greedy_output_equals_the_triton_path(server, references, sdk, case_name):
    case = references[case_name]
    reply = sdk.chat.completions.create(model="mm_ensemble", messages=[user_turn(case)], **GREEDY)
    choice = reply.choices[0]
    assert choice.message.content == case.output
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    triton = triton_client(server).generate(case.text, case.images, case.audios, **_sampling())
    assert triton.text == case.output
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (triton.num_input_tokens, MAX_TOKENS)
    assert triton.num_input_tokens is not None
    assert reply.usage.total_tokens == triton.num_input_tokens + MAX_TOKENS


def test_audio_url_parts_as_vllm_serve_takes_them(references, sdk):
    """An ``audio_url`` part (a data: URL of the WAV file) is the same clip as ``input_audio``."""
    case = references["audio#0"]
    url = "data:audio/wav;base64," + base64.b64encode(case.audios[0]).decode()
    content = [{"type": "audio_url", "audio_url": {"url": url}}, {"type": "text", "text": case.text}]
    reply = sdk.chat.completions.create(model="mm_ensemble", messages=[{"role": "user", "content": content}], **GREEDY)
    assert reply.choices[0].message.content == case.output


def test_video_url_parts_reach_the_model(server, sdk):
    """A ``video_url`` part (a data: URL of a video file) answers as the same video sent to
    mm_ensemble with the client (whose tokens equal HF transformers': tests/test_e2e_server.py)."""
    from mmserve_dev.samples import encode_video, sample_video

    video = encode_video(sample_video(21, frames=6))
    url = "data:video/quicktime;base64," + base64.b64encode(video).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What happens?"}]
    reply = sdk.chat.completions.create(model="mm_ensemble", messages=[{"role": "user", "content": content}], **GREEDY)
    triton = triton_client(server).generate("What happens?", videos=[video], **_sampling())
    assert reply.choices[0].message.content == triton.text


def test_a_video_with_its_audio_as_vllm_serve_takes_it(server, sdk):
    """A ``video_url`` with an audio track and vLLM's ``mm_processor_kwargs: {"use_audio_in_video":
    true}`` answers as mm_ensemble with the client's ``use_audio_in_video`` (whose tokens equal HF
    transformers': tests/test_e2e_server.py); other processor settings are refused by name."""
    import openai

    from mmserve_dev.samples import VIDEO_FPS, encode_video, sample_audio, sample_video

    frames = sample_video(23, frames=26)
    video = encode_video(frames, audio=sample_audio(24, seconds=len(frames) / VIDEO_FPS))
    url = "data:video/quicktime;base64," + base64.b64encode(video).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What happens?"}]
    reply = sdk.chat.completions.create(
        model="mm_ensemble",
        messages=[{"role": "user", "content": content}],
        extra_body={"mm_processor_kwargs": {"use_audio_in_video": True}},
        **GREEDY,
    )
    triton = triton_client(server).generate("What happens?", videos=[video], use_audio_in_video=True, **_sampling())
    assert reply.choices[0].message.content == triton.text
    with pytest.raises(openai.BadRequestError, match="only use_audio_in_video"):
        sdk.chat.completions.create(
            model="mm_ensemble",
            messages=[{"role": "user", "content": content}],
            extra_body={"mm_processor_kwargs": {"fps": 2}},
            **GREEDY,
        )


def test_response_format_json_schema_equals_the_offline_engine(references, sdk):
    """Extracting fields from an image as JSON (``response_format: json_schema``): offline vLLM's
    greedy output under the same schema, valid against it; streamed, the same text."""
    reference = STRUCTURED_REFERENCES["json"]
    request = {
        "model": "mm_ensemble",
        "messages": [user_turn(reference)],
        "temperature": 0.0,
        "max_tokens": STRUCTURED_MAX_TOKENS,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "colors", "schema": COLOR_SCHEMA, "strict": True},
        },
    }
    content = sdk.chat.completions.create(**request).choices[0].message.content
    assert content is not None and content == reference.output
    assert_meets_constraint("json", content)
    chunks = sdk.chat.completions.create(**request, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference.output


@pytest.mark.parametrize("kind", ["choice", "regex"])
def test_vllms_structured_outputs_extension(references, sdk, kind):
    """vLLM's ``structured_outputs`` field (``extra_body`` in the SDK), as ``vllm serve`` takes it."""
    reference = STRUCTURED_REFERENCES[kind]
    reply = sdk.chat.completions.create(
        model="mm_ensemble",
        messages=[user_turn(reference)],
        temperature=0.0,
        max_tokens=STRUCTURED_MAX_TOKENS,
        extra_body={"structured_outputs": STRUCTURED[kind]},
    )
    content = reply.choices[0].message.content
    assert content is not None and content == reference.output
    assert_meets_constraint(kind, content)


def test_multi_turn_conversation_with_an_image_in_an_earlier_turn(server, references, tiny_models, sdk):
    """The media of every turn in order: the model sees the first turn's image and the last turn's
    clip; the reference is mm_ensemble on the prompt the model's chat template renders."""
    from mmserve_dev.hf_reference import load_processor

    image, clip = references["image#2"].images[0], references["audio#3"].audios[0]
    messages = [
        {"role": "system", "content": "You are a careful assistant."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Look:"}, image_part(image), {"type": "text", "text": "What is it?"}],
        },
        {"role": "assistant", "content": "A small picture."},
        {"role": "user", "content": [audio_part(clip), {"type": "text", "text": "And this sound?"}]},
    ]
    reply = sdk.chat.completions.create(model="mm_ensemble", messages=messages, **GREEDY)

    hf_messages = [
        {"role": "system", "content": "You are a careful assistant."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Look:"}, {"type": "image"}, {"type": "text", "text": "What is it?"}],
        },
        {"role": "assistant", "content": "A small picture."},
        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "And this sound?"}]},
    ]
    prompt = load_processor(tiny_models["qwen2_5_omni"]).apply_chat_template(
        hf_messages, add_generation_prompt=True, tokenize=False
    )
    triton = triton_client(server).generate(prompt, [image], [clip], apply_chat_template=False, **_sampling())
    assert reply.choices[0].message.content == triton.text
    assert reply.usage.prompt_tokens == triton.num_input_tokens
    # ... and the earlier turns count: the last turn alone gives another prompt
    alone = sdk.chat.completions.create(model="mm_ensemble", messages=messages[-1:], **GREEDY)
    assert alone.usage.prompt_tokens < reply.usage.prompt_tokens


WEATHER = WEATHER_TOOL
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Oslo|Rome)"\}\}\n</tool_call>'
TOOL_CHOICES: dict[str, dict[str, Any]] = {
    "named": {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "required": {"tool_choice": "required", "parallel_tool_calls": False},  # one call, then the end
    "auto": {"tool_choice": "auto", "structured_outputs": {"regex": HERMES_CALL}},  # made to call
}


@pytest.mark.parametrize("choice", TOOL_CHOICES)
def test_tool_calls_are_the_engines_calls(server, sdk, tiny_models, choice):
    """A tool call of each kind through the gateway (the SDK, whole and streamed) is what vLLM's own
    hermes parser reads in the engine's text for the same conversation through ``mm_ensemble``;
    required and named calls are held to the tools by the engine (the text is a call of one of them)."""
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    fields = TOOL_CHOICES[choice]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    request: dict[str, Any] = {
        "model": "mm_ensemble",
        "messages": messages,
        "tools": [WEATHER, TIME],
        "max_tokens": 160,
        "temperature": 0.0,
    }
    hf_messages = [
        messages[0],
        {
            **messages[1],
            "content": [],
            "tool_calls": [{**messages[1]["tool_calls"][0], "function": {"name": "get_time", "arguments": {}}}],
        },
        messages[2],
    ]  # vLLM's form (the client sends the conversation as it is)
    reference = triton_client(server).generate(
        messages=hf_messages, max_tokens=160, temperature=0.0, tools=[WEATHER, TIME], **fields
    )
    vllm_request = ChatCompletionRequest.model_validate({**request, **fields})
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen2_5_omni"])
    found = Hermes2ProToolParser(tokenizer, vllm_request.tools).extract_tool_calls(reference.text, vllm_request)
    assert found.tools_called and reference.finish_reason == "stop", reference  # a call, and the end
    expected = [(c.function.name, c.function.arguments) for c in found.tool_calls]
    if choice != "auto":
        assert {name for name, _ in expected} <= {"get_weather", "get_time"}
        assert choice == "required" or {name for name, _ in expected} == {"get_weather"}

    extra = {"structured_outputs": fields["structured_outputs"]} if "structured_outputs" in fields else {}
    options = {key: value for key, value in fields.items() if key != "structured_outputs"}
    reply = sdk.chat.completions.create(**request, **options, extra_body=extra)
    message = reply.choices[0].message
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == expected
    assert reply.choices[0].finish_reason == ("stop" if choice == "named" else "tool_calls")
    assert message.content in ("", None) and found.content in ("", None)

    chunks = sdk.chat.completions.create(**request, **options, extra_body=extra, stream=True)
    joined: dict[int, list[str]] = {}
    for chunk in chunks:
        for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            name, arguments = joined.setdefault(call.index, ["", ""])
            joined[call.index] = [name + (call.function.name or ""), arguments + (call.function.arguments or "")]
    assert [tuple(joined[k]) for k in sorted(joined)] == expected


def test_stream_chunks_concatenate_to_the_full_text(references, sdk):
    case = references["image_audio#2"]
    full = sdk.chat.completions.create(model="mm_ensemble", messages=[user_turn(case)], **GREEDY)
    chunks = list(
        sdk.chat.completions.create(
            model="mm_ensemble",
            messages=[user_turn(case)],
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) > 1
    assert "".join(deltas) == full.choices[0].message.content == case.output
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert len({c.id for c in chunks}) == 1


def test_a_long_stream_arrives_while_it_is_generated(sdk):
    """A 1,500-token stream reaches the client as the engine makes it: half its chunks before 80 %
    of its time (with the server in a session of its own, the client got the whole stream in one
    burst at its end: docs/PERFORMANCE.md, "One scheduling group")."""
    start = time.monotonic()
    stream = sdk.chat.completions.create(
        model="mm_ensemble",
        messages=[{"role": "user", "content": "Count."}],
        stream=True,
        max_tokens=1500,
        extra_body={"ignore_eos": True},
    )
    arrivals = [time.monotonic() - start for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
    first, median, last = arrivals[0], arrivals[len(arrivals) // 2], arrivals[-1]
    print(f"\n{len(arrivals)} chunks: first {first:.2f} s, median {median:.2f} s, last {last:.2f} s")
    assert len(arrivals) > 10
    assert median - first < 0.8 * (last - first)


def test_logprobs_stop_and_seed(references, sdk):
    case = references["text_only#1"]
    reply = sdk.chat.completions.create(
        model="mm_ensemble", messages=[user_turn(case)], logprobs=True, top_logprobs=2, **GREEDY
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == MAX_TOKENS
    for entry in content:  # greedy: the sampled token is the most likely one
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob

    text = case.output  # stop at a string of the greedy output: the text before it, finish "stop"
    at = next(k for k in range(2, len(text) - 2) if text.find(text[k : k + 2]) == k and text[k : k + 2].strip())
    stopped = sdk.chat.completions.create(
        model="mm_ensemble", messages=[user_turn(case)], stop=[text[at : at + 2]], **GREEDY
    )
    assert stopped.choices[0].message.content == text[:at] and stopped.choices[0].finish_reason == "stop"

    sampled = [
        sdk.chat.completions.create(
            model="mm_ensemble", messages=[user_turn(case)], temperature=1.0, top_p=0.9, seed=7, max_tokens=MAX_TOKENS
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


def test_n_choices_equal_vllms_parallel_sampling(references, sdk):
    """``n: 2`` with a seed, on an image: the choices are offline vLLM's for ``SamplingParams(n=2,
    seed=...)`` (vLLM seeds its parallel samples ``seed + index``), streamed or not; usage counts
    the prompt once and every choice's tokens."""
    case = PARALLEL_REFERENCES[0]  # filled by the references fixture
    expected = [reference.output for reference in PARALLEL_REFERENCES]
    assert expected[0] != expected[1]  # the seeds tell the choices apart (else the check is blind)
    request = {"model": "mm_ensemble", "messages": [user_turn(case)], "max_tokens": MAX_TOKENS, **PARALLEL}
    reply = sdk.chat.completions.create(**request)
    assert [choice.message.content for choice in reply.choices] == expected
    assert [choice.index for choice in reply.choices] == [0, 1]
    assert reply.usage.prompt_tokens == case.prompt_tokens
    assert reply.usage.completion_tokens == sum(len(reference.ids or []) for reference in PARALLEL_REFERENCES)
    texts = ["", ""]
    for chunk in sdk.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == expected


def test_prompt_logprobs_equal_the_offline_engine(references, sdk):
    """vLLM's ``prompt_logprobs`` (``extra_body`` in the SDK): offline vLLM's on the raw image, at
    the completion's top level, as ``vllm serve`` answers them."""
    case = references[PROMPT_LOGPROBS_CASE]
    reply = sdk.chat.completions.create(
        model="mm_ensemble", messages=[user_turn(case)], extra_body={"prompt_logprobs": PROMPT_LOGPROBS}, **GREEDY
    )
    assert reply.choices[0].message.content == case.output
    assert reply.model_extra is not None
    assert_prompt_logprobs_equal(reply.model_extra["prompt_logprobs"], PROMPT_LOGPROBS_REFERENCE)


def test_models_and_health(gateway, sdk):
    assert [model.id for model in sdk.models.list()] == ["mm_ensemble"]
    status, body = _get(f"{gateway.url}/health")
    assert status == 200 and body["status"] == "ok"


# -- errors ---------------------------------------------------------------------------------------
def _bad_requests(references) -> dict[str, dict]:
    image = references["image#0"].images[0]
    text = {"type": "text", "text": "Describe."}
    return {
        "bad base64": {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@not base64@@"}},
                        text,
                    ],
                }
            ]
        },
        "unsupported audio format": {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "aac"}}, text],
                }
            ]
        },
        "n=17": {"messages": [{"role": "user", "content": "Hi"}], "n": 17},
        "unknown part type": {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, text],
                }
            ]
        },
        "http URL disabled": {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/picture.png"}}, text],
                }
            ]
        },
        "too many images (the gateway counts them)": {
            "messages": [{"role": "user", "content": [*[image_part(image)] * 5, text]}]
        },
        "not an image (Triton)": {"messages": [{"role": "user", "content": [image_part(b"not an image"), text]}]},
        "bad temperature (engine)": {"messages": [{"role": "user", "content": "Hi"}], "temperature": -1},
        "max_tokens above the context length (engine)": {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 100000,
        },
        "ends with the assistant (Triton)": {
            "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        },
    }


@pytest.mark.parametrize("stream", [False, True], ids=["no-stream", "stream"])
def test_bad_inputs_give_openai_shaped_400s(gateway, references, stream):
    import requests

    for name, request in _bad_requests(references).items():
        reply = requests.post(
            f"{gateway.url}/v1/chat/completions",
            timeout=120,
            json={"model": "mm_ensemble", "max_tokens": 4, "stream": stream, **request},
        )
        assert reply.status_code == 400, (name, reply.status_code, reply.text)
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["message"] and "[INVALID_ARG]" not in error["message"] and "Traceback" not in error["message"]
        print(f"{name}: {error['message'][:160]}")


def test_the_sdk_raises_bad_request(sdk):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="mm_ensemble", n=0, messages=[{"role": "user", "content": "Hi"}])
    assert info.value.param == "n"


def test_unreachable_triton_gives_503(tmp_path):
    import openai

    from mmserve_dev.triton import free_ports

    (nothing,) = free_ports(1)
    gateway = Gateway(f"127.0.0.1:{nothing}", tmp_path / "gateway.log")
    try:
        with pytest.raises(openai.APIStatusError) as info:
            gateway.sdk().chat.completions.create(model="mm_ensemble", messages=[{"role": "user", "content": "Hi"}])
        assert info.value.status_code == 503 and info.value.type == "service_unavailable"
        assert str(nothing) not in info.value.message
        status, body = _get(f"{gateway.url}/health")
        assert status == 503 and body["error"]["code"] == "service_unavailable"
    finally:
        gateway.stop()


def test_a_triton_that_comes_back_is_served_again(server, tmp_path):
    """A gateway whose Triton is away answers 503 (health and requests) for a while; once Triton
    answers on its address again (a relay to the live server), /health turns 200 and the next
    request is served (the health check asks on the channel the requests use, whose reconnect backoff
    is 5 s at most). Triton gone again: 503 again."""
    import openai

    from mmserve_dev.triton import free_ports

    (port,) = free_ports(1)
    gateway = Gateway(f"127.0.0.1:{port}", tmp_path / "gateway.log")
    sdk = gateway.sdk()
    messages: Any = [{"role": "user", "content": "Hi"}]
    try:
        away = time.monotonic() + 15  # several failed connects: the channel backs off
        while time.monotonic() < away:
            assert _get(f"{gateway.url}/health")[0] == 503
            with pytest.raises(openai.APIStatusError) as info:
                sdk.chat.completions.create(model="mm_ensemble", messages=messages, max_tokens=1)
            assert info.value.status_code == 503
            time.sleep(1)
        relay = Relay(port, server.grpc)
        try:
            back = time.monotonic()
            assert wait_for(lambda: _get(f"{gateway.url}/health")[0] == 200, timeout=60, interval=0.25)
            print(f"served again {time.monotonic() - back:.1f} s after Triton came back")
            reply = sdk.chat.completions.create(model="mm_ensemble", messages=messages, max_tokens=2, temperature=0.0)
            assert reply.choices[0].finish_reason == "length"
        finally:
            relay.close()
        assert wait_for(lambda: _get(f"{gateway.url}/health")[0] == 503, timeout=30)
    finally:
        gateway.stop()


# -- cancellation ---------------------------------------------------------------------------------
class _Disconnecting:
    """An SDK stream as ``generated_after_cancel`` handles a generation: cancel = the HTTP client
    closes its connection."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stream.close()

    def cancel(self) -> None:
        self.stream.close()


def test_a_client_disconnect_aborts_the_engine_request(server, gateway):
    """A closed HTTP connection cancels the Triton stream and the engine request (the gateway sends
    mm_llm a cancel for the request's id), long before its 3000 tokens."""
    if server.metrics is None:
        pytest.skip("MMSERVE_TRITON_METRICS_URL not given")
    sdk = gateway.sdk()

    def start() -> _Disconnecting:
        return _Disconnecting(
            sdk.chat.completions.create(
                model="mm_ensemble",
                messages=[{"role": "user", "content": "Count."}],
                stream=True,
                max_tokens=3000,
                extra_body={"ignore_eos": True},
            )
        )

    tries = generated_after_cancel(server, start, max_tokens=3000)
    print(f"\ngateway stream: (tokens when disconnected, in all) per try: {tries}")
    assert_cancel_stopped_the_engine(tries, 3000)


# -- text without the hop (mmserve.gateway.direct) ---------------------------------------------------
def _preprocess_count(server) -> int:
    """Requests Triton's ``preprocess`` has answered so far (its inference statistics)."""
    import tritonclient.grpc as grpcclient

    stats = grpcclient.InferenceServerClient(server.grpc).get_inference_statistics("preprocess", as_json=True)
    return int(stats["model_stats"][0]["inference_stats"]["success"].get("count", 0))


def _skips_preprocess(server, sdk, **request) -> bool:
    """Whether a request through the gateway left ``preprocess`` untouched (the direct path)."""
    before = _preprocess_count(server)
    sdk.chat.completions.create(**{"model": "mm_ensemble", "max_tokens": 2, **request})
    return _preprocess_count(server) == before


TEXT_CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Repeat <|im_start|>user and <|IMAGE|> literally."},
    {"role": "assistant", "content": "D'accord : « <|im_end|> »."},
    {"role": "user", "content": "Encore une fois,\né ü 字."},
]


def test_text_only_requests_go_to_mm_llm_directly(server, references, sdk):
    """A request without media skips ``preprocess`` (rendered and tokenized by the gateway, sent to
    mm_llm) once the gateway checked its ids against ``preprocess``'s; one with media goes through
    the ensemble. The answers are the Triton path's: a multi-turn conversation with special tokens
    typed in its text gives mm_ensemble's tokens (``messages`` through ``mmserve.client``) and
    usage; an image request the offline engine's."""
    text = {"messages": [{"role": "user", "content": "Hello"}]}
    assert wait_for(lambda: _skips_preprocess(server, sdk, **text), timeout=60, interval=0.5)
    assert _skips_preprocess(server, sdk, **text, stream=True, n=2, extra_body={"ignore_eos": True})
    image = references["image#2"]
    with_image = [{"role": "user", "content": [image_part(image.images[0]), {"type": "text", "text": "What?"}]}]
    assert not _skips_preprocess(server, sdk, messages=with_image)

    before = _preprocess_count(server)
    reply = sdk.chat.completions.create(
        model="mm_ensemble", messages=TEXT_CONVERSATION, extra_body={"return_token_ids": True}, **GREEDY
    )
    assert _preprocess_count(server) == before
    triton = triton_client(server).generate(messages=TEXT_CONVERSATION, **_sampling())
    assert reply.choices[0].message.content == triton.text and triton.text
    assert reply.choices[0].token_ids == list(triton.output_ids)
    assert reply.usage.prompt_tokens == triton.num_input_tokens


def test_a_refused_text_request_is_refused_as_preprocess_refuses_it(server, gateway, sdk):
    """A text-only request over one of ``preprocess``'s limits (its configuration, which the gateway
    reads from Triton): the same 400 message the ensemble gives, the request never reaching mm_llm."""
    assert wait_for(lambda: _skips_preprocess(server, sdk, messages=[{"role": "user", "content": "Hi"}]), timeout=60)
    messages = [{"role": "user", "content": f"turn {i}"} for i in range(65)]  # max_messages: 64
    from mmserve.client import ClientError

    with pytest.raises(ClientError) as ensemble:
        triton_client(server).generate(messages=messages, **_sampling())
    status, body = _post(gateway, {"model": "mm_ensemble", "messages": messages, "max_tokens": 2})
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"] in str(ensemble.value) and "max_messages" in body["error"]["message"]


def _post(gateway, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{gateway.url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_gateway_on_another_checkpoint_sends_text_through_the_ensemble(server, sdk, tiny_models, tmp_path):
    """--tokenizer naming a checkpoint whose chat template renders other ids than the served one's
    (InternVL's adds its own system turn): the check finds it, and text-only requests keep going
    through ``preprocess``, with the same answers as the direct gateway's."""
    other = Gateway(server.grpc, tmp_path / "gateway.log", "--tokenizer", str(tiny_models["internvl"]))
    try:
        request = {"messages": TEXT_CONVERSATION, "extra_body": {"return_token_ids": True}, **GREEDY}
        for _ in range(3):  # the first asks for the check; the ones after are answered once it ended
            assert not _skips_preprocess(server, other.sdk(), **request)
            time.sleep(1)
        assert wait_for(lambda: "differ from Triton's preprocess" in other.log.read_text(), timeout=30)
        ours = other.sdk().chat.completions.create(model="mm_ensemble", **request)
        direct = sdk.chat.completions.create(model="mm_ensemble", **request)
        assert ours.choices[0].token_ids == direct.choices[0].token_ids
    finally:
        other.stop()

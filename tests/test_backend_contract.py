"""Triton's vLLM backend's response contract, kept by CI: what its own L0 suites
(``ci/L0_additional_outputs_vllm``, ``L0_backend_vllm/enabled_stream``, ``vllm_backend``'s
``exclude_input_in_output`` cases) assert of a ``text_input`` request, asserted here of
``mm_ensemble`` with tritonclient's gRPC stream, as those suites send it.

The one input added to the backend's requests is ``apply_chat_template: false``: ``mm_ensemble``
wraps ``text_input`` in the model's chat template by default, the backend never does
(docs/tensors.md, "Triton's vLLM backend: what differs"). References: the checkpoint's tokenizer
(HF) for the prompt's and the output's tokens, the output's own logprobs for its cumulative logprob.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.server

PROMPT = "In this example,"  # the backend's suite's prompt: the tiny model's greedy output is whole characters
MAX_TOKENS = 16
FLAGS = (
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
)


def backend_request(
    server: Any, *, stream: bool, sampling: dict[str, Any], flags: dict[str, bool], **extra: Any
) -> list[tuple[Any, Any]]:
    """One request as the backend's suites send it (text_input, stream, sampling_parameters, the
    flags), over a gRPC stream: its (result, error) callbacks."""
    import tritonclient.grpc as grpcclient

    tensors: dict[str, np.ndarray] = {
        "text_input": np.array([PROMPT.encode()], dtype=np.object_),
        "stream": np.array([stream]),
        "apply_chat_template": np.array([False]),
        "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=np.object_),
        **{name: np.array([value]) for name, value in flags.items()},
        **{name: np.array([value]) for name, value in extra.items()},
    }
    inputs = []
    for name, value in tensors.items():
        inputs.append(grpcclient.InferInput(name, list(value.shape), "BYTES" if value.dtype == object else "BOOL"))
        inputs[-1].set_data_from_numpy(value)
    responses: list[tuple[Any, Any]] = []
    with grpcclient.InferenceServerClient(server.grpc) as client:
        client.start_stream(lambda result, error: responses.append((result, error)))
        client.async_stream_infer("mm_ensemble", inputs=inputs)
        client.stop_stream()
    assert responses
    return responses


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["qwen2_5_omni"])


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("logprobs", [None, 0, 2], ids=["no_logprobs", "logprobs0", "logprobs2"])
@pytest.mark.parametrize("flush_ms", [0, None], ids=["per_output", "paced"])
def test_additional_outputs(server, tokenizer, stream, logprobs, flush_ms):
    sampling: dict[str, Any] = {"temperature": "0", "top_p": "1", "max_tokens": MAX_TOKENS}
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    if flush_ms is not None:
        sampling["stream_flush_ms"] = flush_ms
    responses = backend_request(server, stream=stream, sampling=sampling, flags=dict.fromkeys(FLAGS, True))
    assert all(error is None for _, error in responses), responses
    results = [result for result, _ in responses]
    if stream and flush_ms == 0:  # a response per engine output, as the backend streams (vLLM merges the
        assert len(results) > 1  # outputs a busy server has not taken yet: not always one per token)
    ids = np.concatenate([result.as_numpy("output_ids") for result in results]).tolist()
    texts = [result.as_numpy("text_output")[0].decode() for result in results]
    generated = tokenizer.decode(ids)
    assert len(ids) == MAX_TOKENS and "\ufffd" not in generated  # whole characters: the checks below hold
    # A stream sends the generated text only; a whole answer echoes the prompt (exclude_input_in_output absent).
    assert "".join(texts) == (generated if stream else PROMPT + generated)

    # finish_reason: "None" before the last response (str(None), as the backend sends it), then why.
    reasons = [result.as_numpy("finish_reason")[0].decode() for result in results]
    assert reasons == ["None"] * (len(results) - 1) + ["length"]

    # num_input_tokens: the prompt's tokens, as the checkpoint's tokenizer counts them (no template).
    prompt_tokens = len(tokenizer(PROMPT).input_ids)
    assert all(result.as_numpy("num_input_tokens").tolist() == [prompt_tokens] for result in results)
    # num_output_tokens: this response's tokens.
    counts = [int(result.as_numpy("num_output_tokens")[0]) for result in results]
    assert counts == [len(result.as_numpy("output_ids")) for result in results] and sum(counts) == MAX_TOKENS

    # logprobs: null unless sampling_parameters asks; else per token, the sampled one ranked first
    # (greedy), at most logprobs + 1 entries, the rank-1 tokens spelling this response's text.
    steps: list[dict[str, dict[str, Any]]] = []
    for result, text in zip(results, texts, strict=True):
        value = json.loads(result.as_numpy("logprobs")[0])
        if logprobs is None:
            assert value is None
            continue
        assert len(value) == int(result.as_numpy("num_output_tokens")[0])
        for step, token in zip(value, result.as_numpy("output_ids").tolist(), strict=True):
            assert 1 <= len(step) <= logprobs + 1
            assert step[str(token)]["rank"] == 1
            assert sorted(entry["rank"] for entry in step.values())[0] == 1
        spelled = "".join(entry["decoded_token"] for step in value for entry in step.values() if entry["rank"] == 1)
        assert (spelled if stream else PROMPT + spelled) == text
        steps.extend(value)

    # cumulative_logprob: the output's so far, so it changes with every response; with logprobs,
    # the sum of the sampled tokens' logprobs.
    cumulative = [float(result.as_numpy("cumulative_logprob")[0]) for result in results]
    assert all(math.isfinite(value) and value < 0 for value in cumulative)
    assert all(a != b for a, b in zip([0.0, *cumulative], cumulative, strict=False))
    if steps:
        total = sum(step[str(token)]["logprob"] for step, token in zip(steps, ids, strict=True))
        assert cumulative[-1] == pytest.approx(total, abs=1e-3)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_outputs_only_when_asked(server, tokenizer, stream):
    """The backend's None and False cases: no flag, no output (and the text as in the contract)."""
    for flags in ({}, dict.fromkeys(FLAGS, False)):
        responses = backend_request(server, stream=stream, sampling={"temperature": "0"}, flags=flags)
        for result, error in responses:
            assert error is None
            for name in ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens"):
                assert result.as_numpy(name) is None, name


@pytest.mark.parametrize(("exclude", "echo"), [(None, True), (False, True), (True, False)])
def test_exclude_input_in_output_whole(server, tokenizer, exclude, echo):
    """The vllm_backend suite's cases: a whole answer echoes the prompt unless exclude_input_in_output."""
    extra = {} if exclude is None else {"exclude_input_in_output": exclude}
    responses = backend_request(server, stream=False, sampling={"temperature": "0"}, flags={}, **extra)
    ((result, error),) = responses
    assert error is None
    text = result.as_numpy("text_output")[0].decode()
    generated = tokenizer.decode(result.as_numpy("output_ids").tolist())
    assert text == (PROMPT + generated if echo else generated)


def test_stream_refuses_the_echo(server):
    """The enabled_stream suite's case: a stream with exclude_input_in_output false is refused (the
    backend's sentence in the message), the next request served."""
    responses = backend_request(
        server, stream=True, sampling={"temperature": "0"}, flags={}, exclude_input_in_output=False
    )
    ((result, error),) = responses
    assert result is None
    assert (
        "[INVALID_ARG] exclude_input_in_output: When streaming, `exclude_input_in_output` = False is not allowed."
        in (error.message())
    )
    ((result, error),) = backend_request(server, stream=False, sampling={"temperature": "0"}, flags={})
    assert error is None and result.as_numpy("text_output")[0].decode().startswith(PROMPT)

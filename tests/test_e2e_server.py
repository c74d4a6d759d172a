"""End to end through a real tritonserver: mm_ensemble (preprocess -> mm_llm),
mm_llm directly, gRPC streaming and HTTP generate, errors, cancellation, metrics, perf_analyzer.

Reference: the offline vLLM engine (same engine arguments as model_repository/mm_llm/model.json) on
the same raw inputs, computed before the server starts (one engine at a time on 2 cores). The
server and the references are session fixtures (conftest.py), shared with test_e2e_inputs.py and
test_faults.py. Requests go through the project's client (mmserve.client), as a user's would.

Against an already running server or container (serving the tiny default model), set
``MMSERVE_TRITON_GRPC_URL`` (and ``MMSERVE_TRITON_HTTP_URL``, ``MMSERVE_TRITON_METRICS_URL``), e.g.
``127.0.0.1:8001``; the suite then starts no server.
"""

from __future__ import annotations

import functools
import json
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmserve import settings

from utils import (
    CASES,
    ENTRIES,
    MAX_TOKENS,
    PROMPT_LOGPROBS,
    PROMPT_LOGPROBS_CASE,
    PROMPT_LOGPROBS_REFERENCE,
    ROOT,
    STRUCTURED,
    STRUCTURED_REFERENCES,
    assert_cancel_stopped_the_engine,
    assert_meets_constraint,
    assert_prompt_logprobs_equal,
    generated_after_cancel,
    http_generate,
    metric,
    send_tensors,
    settled_metrics,
    structured_sampling,
    wait_for,
)
from utils import client as _client
from utils import sampling as _sampling

pytestmark = pytest.mark.server


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("case_name", [f"{name}#0" for name in CASES])
def test_entries_match_offline_vllm(server, references, case_name, entry):
    case = references[case_name]
    result = _client(server, entry=entry).generate(case.text, case.images, case.audios, **_sampling())
    assert result.output_ids == case.ids
    assert result.text == case.output
    assert result.finish_reason == "length"
    assert result.num_output_tokens == MAX_TOKENS


def test_stream_deltas_concatenate_to_the_full_text(server, references):
    case = references["image_audio#1"]
    client = _client(server)
    deltas = list(client.stream(case.text, case.images, case.audios, **_sampling()))
    assert len(deltas) > 1
    assert "".join(deltas) == case.output
    streamed = client.generate(case.text, case.images, case.audios, stream=True, **_sampling())
    assert streamed.output_ids == case.ids


def test_streamed_responses_carry_every_output_asked_for(server, references):
    """Triton's vLLM backend's contract for its optional outputs, which mmserve's client and
    gateway ask for only in part: each one asked for is in every streamed response."""
    case = references["image_audio#1"]
    flags = ("stream", "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")
    tensors = {
        "text_input": np.array([case.text.encode()], dtype=object),
        "image": np.array(case.images, dtype=object),
        "audio": np.array(case.audios, dtype=object),
        "sampling_parameters": np.array([json.dumps(_sampling()).encode()], dtype=object),
        **{name: np.array([True]) for name in flags},
    }
    responses = [r for r in send_tensors(server, "mm_ensemble", tensors) if r.output_ids]
    assert len(responses) > 1
    assert sum((r.output_ids for r in responses), []) == case.ids
    assert all(r.num_input_tokens == case.prompt_tokens for r in responses), [r.num_input_tokens for r in responses]
    assert all(r.num_output_tokens == len(r.output_ids) for r in responses)
    assert [r.finish_reason for r in responses] == [None] * (len(responses) - 1) + ["length"]


def test_http_generate_agrees_with_grpc(server, references):
    if server.http is None:
        pytest.skip("MMSERVE_TRITON_HTTP_URL not given")
    from mmserve.client import MMClient

    http = MMClient(server.http, protocol="http")
    for name in ("image#2", "audio#2", "text_only#2"):
        case = references[name]
        assert http.generate(case.text, case.images, case.audios, **_sampling()).text == case.output
        assert http.generate(case.text, case.images, case.audios, stream=True, **_sampling()).text == case.output

    status, body = http_generate(server, "mm_ensemble", {"text_input": "x", "image": ["data:image/png;base64,AAAA"]})
    assert status == 400
    assert "image[0]: cannot decode 3 bytes as an image" in body["error"]


def test_input_echoed_unless_excluded(server, references):
    case = references["text_only#3"]
    echoed = _client(server).generate(case.text, exclude_input_in_output=False, **_sampling())
    assert echoed.text == case.text + case.output


def test_direct_mm_llm_agrees_with_ensemble(server, references, tiny_models):
    direct = _client(server, direct=True, model=tiny_models["qwen2_5_omni"])
    for name in ("image_audio#0", "two_images#1"):
        case = references[name]
        assert direct.generate(case.text, case.images, case.audios, **_sampling()).output_ids == case.ids


@pytest.mark.parametrize("entry", ENTRIES)
def test_concurrent_streaming_requests(server, references, entry):
    """All 20 requests of the workload streaming at once (mixed modalities, staggered arrivals)."""
    client = _client(server, entry=entry)
    results: dict[str, str] = {}
    errors: list[BaseException] = []

    def run(name, case, delay):
        time.sleep(delay)
        try:
            results[name] = "".join(client.stream(case.text, case.images, case.audios, **_sampling()))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n, c, 0.02 * i)) for i, (n, c) in enumerate(references.items())]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert len(results) == len(references) >= 16
    mismatches = [n for n, c in references.items() if results[n] != c.output]
    assert not mismatches


def _error_of(fn) -> str:
    from mmserve.client import ClientError

    with pytest.raises(ClientError) as err:
        fn()
    return str(err.value)


def test_bad_requests_get_precise_errors_and_the_server_keeps_serving(server, references, tiny_models):
    client = _client(server)
    case = references["image_audio#0"]
    message = _error_of(lambda: client.generate("x", [b"not an image"], **_sampling()))
    assert "image[0]: cannot decode 12 bytes as an image" in message
    message = _error_of(lambda: client.generate("x", [], [b"RIFF...."], **_sampling()))
    assert "audio[0]: cannot decode 8 bytes as audio" in message
    from mmserve.client import MMClient

    http = [MMClient(server.http, "http", timeout=180)] if server.http else []
    for other in (client, *http):  # the client's videos= reach preprocess, which names what is wrong
        protocol = other.protocol
        message = _error_of(functools.partial(other.generate, "x", videos=[b"\x00\x00\x00\x18ftypmp42"], **_sampling()))
        assert "video[0]: cannot decode 12 bytes as a video" in message, (protocol, message)
    message = _error_of(lambda: client.generate("x", temperature=-1.0, max_tokens=4))
    assert "sampling_parameters: temperature must be non-negative" in message
    message = _error_of(lambda: client.generate("x", max_tokens=4, no_such_option=1))
    assert "sampling_parameters: unknown parameter(s) ['no_such_option']" in message
    message = _error_of(lambda: client.generate("word " * 5000, max_tokens=4))
    assert "maximum context length is 4096 tokens" in message and "5021" in message

    # Tensors that don't match the placeholders, straight to mm_llm.
    from mmserve.serving.preprocess import Preprocessor

    processed = Preprocessor(tiny_models["qwen2_5_omni"])(case.text, case.images, case.audios)
    image_id = int(np.bincount(processed["input_ids"]).argmax())  # the most frequent id: a placeholder
    ids = list(processed["input_ids"])
    ids.remove(image_id)
    processed["input_ids"] = np.array(ids, dtype=np.int64)
    message = _error_of(lambda: _send_to_mm_llm(server, processed))
    assert "prompt_token_ids: expected" in message and "found a run of" in message

    assert client.generate(case.text, case.images, case.audios, **_sampling()).output_ids == case.ids


@pytest.mark.parametrize("kind", sorted(STRUCTURED))
def test_structured_outputs_equal_the_offline_engine(server, references, kind):
    """vLLM's structured outputs in ``sampling_parameters`` through mm_ensemble: offline vLLM's
    greedy output under the same constraint (the raw image), and an output that meets it."""
    reference = STRUCTURED_REFERENCES[kind]
    result = _client(server).generate(reference.text, reference.images, **structured_sampling(kind))
    assert (result.output_ids, result.text) == (reference.ids, reference.output)
    assert_meets_constraint(kind, result.text)


@pytest.mark.parametrize("stream", [False, True], ids=["no-stream", "stream"])
def test_prompt_logprobs_equal_the_offline_engine(server, references, stream):
    """``sampling_parameters.prompt_logprobs`` through mm_ensemble on an image request: offline
    vLLM's on the raw image, per prompt token (the placeholders included), in the first response;
    the generated tokens unchanged."""
    case = references[PROMPT_LOGPROBS_CASE]
    result = _client(server).generate(
        case.text, case.images, stream=stream, **_sampling(), prompt_logprobs=PROMPT_LOGPROBS
    )
    assert result.output_ids == case.ids
    assert len(PROMPT_LOGPROBS_REFERENCE) == case.prompt_tokens
    assert_prompt_logprobs_equal(result.prompt_logprobs, PROMPT_LOGPROBS_REFERENCE)


@pytest.mark.parametrize(
    ("kind", "value", "says"),
    [
        ("regex", "(unclosed", "unclosed group"),
        ("json", {"type": "no-such-type"}, "no-such-type"),
        ("grammar", "root ::= undefined_rule", "undefined_rule"),
    ],
)
def test_a_constraint_the_engine_cannot_take_is_a_client_error(server, references, kind, value, says):
    """vLLM's front end compiles the constraint before the engine: a bad one is this request's
    [INVALID_ARG] naming the constraint and vLLM's reason, and the engine serves the next request
    as before."""
    client = _client(server)
    message = _error_of(lambda: client.generate("x", **{**_sampling(), "structured_outputs": {kind: value}}))
    assert f"[INVALID_ARG] sampling_parameters: structured_outputs.{kind}: " in message, message
    assert says in message, message
    case = references["text_only#1"]
    assert client.generate(case.text, **_sampling()).output_ids == case.ids


def _send_to_mm_llm(server, tensors: dict[str, np.ndarray]) -> None:
    sampling = np.array([json.dumps(_sampling()).encode()], dtype=object)
    send_tensors(server, "mm_llm", {**tensors, "sampling_parameters": sampling})


LONG_GENERATION: dict[str, Any] = {"max_tokens": 3000, "ignore_eos": True}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
def test_a_cancel_through_the_ensemble_stops_the_engine(server, stream):
    """Finding 7: a client's cancel reaches the engine through mm_ensemble long before the end.
    Triton's ensemble scheduler can't carry it into the running mm_llm step; the client sends
    mm_llm a cancel for the request's id beside the stream's (mmserve.client.cancel_on_engine)."""
    if server.metrics is None:
        pytest.skip("MMSERVE_TRITON_METRICS_URL not given")
    client = _client(server)
    tries = generated_after_cancel(
        server,
        lambda: client.start("Count.", stream=stream, **LONG_GENERATION),
        max_tokens=LONG_GENERATION["max_tokens"],
    )
    print(f"\nmm_ensemble, stream={stream}: (tokens when cancelled, in all) per try: {tries}")
    assert_cancel_stopped_the_engine(tries, LONG_GENERATION["max_tokens"])


def test_a_cancel_that_overtakes_its_request_ends_it_cancelled(server):
    """A cancel that reaches mm_llm before its request (still in preprocess) is kept for it: the
    request ends [CANCELLED] when it arrives, and the engine generates nothing for it."""
    from mmserve.client import ClientError, Generation, cancel_on_engine, new_cancel_key

    if server.metrics is None:
        pytest.skip("MMSERVE_TRITON_METRICS_URL not given")
    before = settled_metrics(server, "vllm:generation_tokens_total")["vllm:generation_tokens_total"]
    request_id, key = f"overtaken-{time.monotonic_ns()}", new_cancel_key()
    assert cancel_on_engine(server.grpc, request_id, key)
    tensors = {
        "text_input": np.array([b"Count."], dtype=object),
        "stream": np.array([True]),
        "sampling_parameters": np.array([json.dumps(LONG_GENERATION).encode()], dtype=object),
        "cancel_key": np.array([key], dtype=object),
    }
    with pytest.raises(ClientError) as error:
        list(Generation(server.grpc, "mm_ensemble", tensors, request_id=request_id))
    assert error.value.code == "CANCELLED", str(error.value)
    assert settled_metrics(server, "vllm:generation_tokens_total")["vllm:generation_tokens_total"] == before


def test_cancel_reaches_mm_llm_called_directly(server, tiny_models):
    if server.metrics is None:
        pytest.skip("MMSERVE_TRITON_METRICS_URL not given")
    direct = _client(server, direct=True, model=tiny_models["qwen2_5_omni"])  # preprocessed here: to mm_llm
    tries = generated_after_cancel(
        server,
        lambda: direct.start("Count.", stream=False, **LONG_GENERATION),
        max_tokens=LONG_GENERATION["max_tokens"],
    )
    print(f"\nmm_llm: (tokens when cancelled, in all) per try: {tries}")
    assert_cancel_stopped_the_engine(tries, LONG_GENERATION["max_tokens"])


def test_health_metadata_and_metrics(server, references):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc)
    assert client.is_server_live() and client.is_server_ready()
    for model in ("preprocess", "mm_llm", "mm_ensemble"):
        assert client.is_model_ready(model)
    inputs = {i.name: i.datatype for i in client.get_model_metadata("mm_ensemble").inputs}
    assert inputs["text_input"] == "BYTES" and inputs["image"] == "BYTES" and inputs["stream"] == "BOOL"
    if server.metrics is None:
        return
    _client(server).generate("Hello.", **_sampling())
    # mm_llm updates its metrics at most every 0.1 s (mmserve.serving.metrics.UPDATE_INTERVAL_S)
    assert wait_for(lambda: metric(server, "vllm:e2e_request_latency_seconds_count") >= 1, 10)
    assert metric(server, "vllm:prompt_tokens_total") > 0
    assert metric(server, "vllm:generation_tokens_total") >= MAX_TOKENS
    assert metric(server, "vllm:time_to_first_token_seconds_count") >= 1
    assert metric(server, "vllm:request_time_per_output_token_seconds_count") >= 1
    # The per-token histogram is opt-in (config.pbtxt report_inter_token_latency: a call per token).
    assert (
        "vllm:time_per_output_token_seconds" not in urllib.request.urlopen(server.metrics, timeout=10).read().decode()
    )


def test_perf_analyzer_against_the_ensemble(server, tmp_path):
    perf_analyzer = Path(settings.VENV.get(str(ROOT / ".venv"))) / "bin" / "perf_analyzer"
    data = {
        "data": [
            {
                "text_input": ["Describe it."],
                "stream": [True],
                "sampling_parameters": [json.dumps({"max_tokens": 8, "temperature": 0})],
            }
        ]
    }
    (tmp_path / "input.json").write_text(json.dumps(data))
    command = [
        str(perf_analyzer),
        "-m",
        "mm_ensemble",
        "-u",
        server.grpc,
        "-i",
        "grpc",
        "--streaming",
        "--input-data",
        str(tmp_path / "input.json"),
        "--concurrency-range",
        "2",
        "--measurement-mode",
        "count_windows",
        "--measurement-request-count",
        "8",
        "--stability-percentage",
        "100",
        "--max-trials",
        "10",
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Throughput:" in run.stdout


def test_a_video_with_its_audio_through_the_ensemble_equals_hf(server, omni_reference):
    """A video file with an audio track and ``use_audio_in_video`` (gRPC and HTTP) through
    mm_ensemble: HF transformers' greedy tokens on the frames and the waveform."""
    from mmserve.client import MMClient
    from mmserve_dev.samples import VIDEO_FPS, encode_video, sample_audio, sample_video

    from utils import hf_video_with_audio_tokens

    frames = sample_video(23, frames=26)
    audio = sample_audio(24, seconds=len(frames) / VIDEO_FPS)
    expected = hf_video_with_audio_tokens(omni_reference, frames, audio)
    video = encode_video(frames, audio=audio)
    result = _client(server).generate("What happens?", videos=[video], use_audio_in_video=True, **_sampling())
    assert result.output_ids == expected
    if server.http:
        over_http = MMClient(server.http, "http", timeout=180).generate(
            "What happens?", videos=[video], use_audio_in_video=True, **_sampling()
        )
        assert over_http.text == result.text


def test_a_video_through_the_ensemble_equals_hf(server, omni_reference):
    """A video file sent with the client (gRPC and HTTP) through mm_ensemble: the greedy tokens of
    HF transformers (the Omni thinker) on the frames the file was made from."""
    from mmserve.client import MMClient
    from mmserve_dev.hf_reference import chat_prompt
    from mmserve_dev.samples import encode_video, sample_video

    from utils import hf_video_tokens

    frames = sample_video(21, frames=6)
    text = chat_prompt("qwen2_5_omni", omni_reference.processor, ["video", "text:What happens?"])
    expected = hf_video_tokens(omni_reference, text, [frames])
    video = encode_video(frames)
    result = _client(server).generate("What happens?", videos=[video], **_sampling())
    assert result.output_ids == expected
    if server.http:
        over_http = MMClient(server.http, "http", timeout=180).generate("What happens?", videos=[video], **_sampling())
        assert over_http.text == result.text

"""``mmserve.serving.sampling``: strict ``sampling_parameters`` parsing and the engine-transport guard.

No engine: the guard is checked against vLLM's own msgpack codec, the one the engine core uses.
"""

from __future__ import annotations

import json
import re

import msgspec
import pytest
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from mmserve.errors import InputError
from mmserve.serving.sampling import SUPPORTED, check_engine_transport, parse_sampling_parameters


def parse(params: object, *, stream: bool = False, cumulative_logprob: bool = False) -> SamplingParams:
    text = params if isinstance(params, str) else json.dumps(params)
    return parse_sampling_parameters(text, stream=stream, cumulative_logprob=cumulative_logprob)


BAD = [
    # the document
    ("{", "invalid JSON"),
    ("[" * 100_000, "invalid JSON"),
    ('{"seed": ' + "9" * 5000 + "}", "invalid JSON"),
    ("[1]", "expected a JSON object, found list"),
    ('"max_tokens"', "expected a JSON object, found str"),
    ({"bogus": 1}, r"unknown parameter(s) ['bogus']"),
    ({"zeta": 1, "alpha": 2, "top_p": 0.5}, r"unknown parameter(s) ['alpha', 'zeta']"),
    # real SamplingParams fields this server refuses
    ({"structural_tag": "x"}, r"unknown parameter(s) ['structural_tag']"),
    ({"extra_args": {"a": 1}}, "parameter(s) ['extra_args'] not supported by this server"),
    ({"output_kind": 0}, "parameter(s) ['output_kind'] not supported by this server"),
    ({"_eos_token_id": 2}, "parameter(s) ['_eos_token_id'] not supported by this server"),
    (
        {"detokenize": False, "flat_logprobs": True},
        "parameter(s) ['detokenize', 'flat_logprobs'] not supported by this server",
    ),
    ({"prompt_logprobs": -2}, "prompt_logprobs: expected `int` >= -1, found -2"),
    ({"thinking_token_budget": 5}, "['thinking_token_budget'] not supported"),
    # ints
    ({"max_tokens": "many"}, "max_tokens: expected `int | null`, found 'many'"),
    ({"max_tokens": " 12 "}, "max_tokens: expected `int | null`, found ' 12 '"),
    ({"max_tokens": 16.5}, "max_tokens: expected `int | null`, found 16.5"),
    ({"max_tokens": "16.5"}, "max_tokens: expected `int | null`, found '16.5'"),
    ({"max_tokens": True}, "max_tokens: expected `int | null`, found true"),
    ({"max_tokens": [16]}, "max_tokens: expected `int | null`, found a list of 1 item(s)"),
    ({"max_tokens": {"v": 16}}, "max_tokens: expected `int | null`, found an object"),
    ({"max_tokens": 0}, "max_tokens: expected `int` >= 1, found 0"),
    ({"max_tokens": 2**31}, "max_tokens: expected `int` <= 2147483647, found 2147483648"),
    ({"max_tokens": "1e400"}, "max_tokens: number out of range, found '1e400'"),
    ({"min_tokens": -1}, "min_tokens: expected `int` >= 0, found -1"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be less than or equal to max_tokens=10"),
    ({"top_k": -2}, "top_k: expected `int` >= -1, found -2"),
    ({"top_k": 2.5}, "top_k: expected `int`, found 2.5"),
    ({"seed": 2**70}, "seed: expected `int` <= 9223372036854775807, found 1180591620717411303424"),
    ({"seed": 2**63}, "seed: expected `int` <= 9223372036854775807, found 9223372036854775808"),
    ({"seed": -1}, "seed: expected `int` >= 0, found -1"),
    ({"logprobs": -2}, "logprobs: expected `int` >= -1, found -2"),
    ({"logprobs": False}, "logprobs: expected `int | null`, found false"),
    ({"n": 2}, "n: only 1 completion per request is served, found 2"),
    ({"n": "2"}, "only 1 completion"),
    ({"n": None}, "n: expected `int`, found null"),
    # floats
    ('{"temperature": NaN}', "temperature: expected a finite float, found NaN"),
    ('{"top_p": Infinity}', "top_p: expected a finite float, found Infinity"),
    ({"temperature": "nan"}, "temperature: expected a finite float, found 'nan'"),
    ({"temperature": "1e999"}, "temperature: number out of range, found '1e999'"),
    ({"temperature": 10**400}, "temperature: number out of range"),
    ({"temperature": True}, "temperature: expected `float`, found true"),
    ({"temperature": None}, "temperature: expected `float`, found null"),
    ({"temperature": -1}, "temperature must be non-negative, got -1.0."),
    ({"top_p": 2}, "top_p must be in (0, 1]"),
    ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2]"),
    ({"min_p": "1.5"}, "min_p must be in [0, 1]"),
    # bools
    ({"ignore_eos": 2}, "ignore_eos: expected `bool`, found 2"),
    ({"ignore_eos": "abc"}, "ignore_eos: expected `bool`, found 'abc'"),
    ({"ignore_eos": "yes"}, "ignore_eos: expected `bool`, found 'yes'"),
    ({"skip_special_tokens": None}, "skip_special_tokens: expected `bool`, found null"),
    # stop, bad_words
    ({"stop": 5}, "stop: expected `str | array | null`, found 5"),
    ({"stop": [1]}, "stop[0]: expected `str`, found 1"),
    ({"stop": ["a", ""]}, "stop[1]: expected `str` of length >= 1, found ''"),
    ({"stop": ""}, "stop: expected `str` of length >= 1, found ''"),
    ({"stop": ["x"] * 33}, "stop: expected `array` of length <= 32, found a list of 33 item(s)"),
    ({"stop": "y" * 257}, "stop: expected `str` of length <= 256"),
    ({"stop": "\ud800"}, "stop: a lone surrogate is not valid Unicode"),
    ({"bad_words": "word"}, "bad_words: expected `array | null`, found 'word'"),
    ({"bad_words": [None]}, "bad_words[0]: expected `str`, found null"),
    # token id lists
    ({"stop_token_ids": 5}, "stop_token_ids: expected `array | null`, found 5"),
    ({"stop_token_ids": [1, -3]}, "stop_token_ids[1]: expected `int` >= 0, found -3"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids[0]: expected `int` <= 2147483647, found 2147483648"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids[0]: expected `int`, found 'a'"),
    ({"allowed_token_ids": []}, "allowed_token_ids: expected `array` of length >= 1, found a list of 0 item(s)"),
    ({"allowed_token_ids": [1.5]}, "allowed_token_ids[0]: expected `int`, found 1.5"),
    # logit_bias
    ({"logit_bias": {"x": 1}}, "logit_bias: expected token id keys (integer strings in [0, 2147483647]), found 'x'"),
    ({"logit_bias": {"-5": 1}}, "logit_bias: expected token id keys"),
    ({"logit_bias": {"99999999999": 1}}, "logit_bias: expected token id keys"),
    ({"logit_bias": {"5": 1e9}}, "logit_bias['5']: expected float in [-100, 100], found 1000000000.0"),
    ({"logit_bias": {"5": "much"}}, "logit_bias['5']: expected float in [-100, 100], found 'much'"),
    ('{"logit_bias": {"5": NaN}}', "logit_bias['5']: expected float in [-100, 100], found NaN"),
    ({"logit_bias": [[5, 1.0]]}, "logit_bias: expected `object | null`, found a list of 1 item(s)"),
    # structured outputs
    ({"structured_outputs": "a+"}, "structured_outputs: expected `object | null`, found 'a+'"),
    ({"structured_outputs": {}}, "structured_outputs: expected exactly one of ['json', 'regex', 'choice', 'grammar', "),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "], found regex, choice"),
    (
        {"structured_outputs": {"regex": "a", "structural_tag": "{}"}},
        "structured_outputs: unknown field `structural_tag`",
    ),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex: expected `str` of length >= 1, found ''"),
    ({"structured_outputs": {"grammar": "x" * 65537}}, "structured_outputs.grammar: expected `str` of length <= 65536"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice: expected `array` of length >= 1"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice[1]: expected `str`, found 1"),
    (
        {"structured_outputs": {"choice": ["a", ""]}},
        "structured_outputs.choice[1]: expected `str` of length >= 1, found ''",
    ),
    ({"structured_outputs": {"json": 5}}, "structured_outputs.json: expected `str | object | null`, found 5"),
    ({"structured_outputs": {"json": "{"}}, "structured_outputs.json: not valid JSON"),
    ({"structured_outputs": {"json": {"enum": ["x" * 70000]}}}, "structured_outputs.json: expected a JSON schema of"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object: expected true"),
    (
        {"structured_outputs": {"json_object": True, "disable_any_whitespace": 2}},
        "structured_outputs.disable_any_whitespace: expected `bool`, found 2",
    ),
]


@pytest.mark.parametrize(("params", "message"), BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_rejects(params: object, message: str) -> None:
    with pytest.raises(InputError, match=re.escape(message)) as info:
        parse(params)
    assert str(info.value).startswith("sampling_parameters: ")


GOOD = [
    (None, {"max_tokens": 16, "temperature": 1.0, "logprobs": None, "stop": [], "seed": None}),
    ("", {"max_tokens": 16}),
    ({}, {"max_tokens": 16}),
    ({"max_tokens": 16.0}, {"max_tokens": 16}),
    (
        {"max_tokens": "7", "temperature": "0.5", "ignore_eos": "true"},
        {"max_tokens": 7, "temperature": 0.5, "ignore_eos": True},
    ),
    ({"max_tokens": "12", "top_k": "-1", "min_tokens": "2.0"}, {"max_tokens": 12, "top_k": -1, "min_tokens": 2}),
    ({"ignore_eos": 1, "skip_special_tokens": 0}, {"ignore_eos": True, "skip_special_tokens": False}),
    ({"max_tokens": 2**31 - 1}, {"max_tokens": 2**31 - 1}),
    ({"seed": None, "stop": None, "logit_bias": None}, {"max_tokens": 16, "seed": None}),
    ({"max_tokens": None}, {"max_tokens": None}),  # vLLM's None: up to the context length
    ({"prompt_logprobs": "2"}, {"prompt_logprobs": 2}),
    ({"prompt_logprobs": None}, {"prompt_logprobs": None}),
    ({"seed": 0}, {"seed": 0}),
    ({"seed": 2**63 - 1}, {"seed": 2**63 - 1}),
    ({"seed": "42"}, {"seed": 42}),
    ({"n": 1.0}, {"n": 1}),
    ({"temperature": 0}, {"temperature": 0.0}),
    ({"temperature": 1, "top_p": "1", "min_p": 0.1}, {"temperature": 1.0, "top_p": 1.0, "min_p": 0.1}),
    (
        {"repetition_penalty": "1.1e0", "presence_penalty": -2, "frequency_penalty": 2.0},
        {"repetition_penalty": 1.1, "presence_penalty": -2.0, "frequency_penalty": 2.0},
    ),
    (
        {
            "ignore_eos": False,
            "skip_special_tokens": "FALSE",
            "spaces_between_special_tokens": "0",
            "include_stop_str_in_output": "1",
        },
        {
            "ignore_eos": False,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "include_stop_str_in_output": True,
        },
    ),
    ({"stop": "END"}, {"stop": ["END"]}),
    ({"stop": ["a", "bc"]}, {"stop": ["a", "bc"]}),
    ({"stop_token_ids": [2, "3", 4.0, 2]}, {"stop_token_ids": [2, 3, 4]}),
    ({"bad_words": ["x", "y"]}, {"bad_words": ["x", "y"]}),
    ({"allowed_token_ids": [0, 1, 2]}, {"allowed_token_ids": [0, 1, 2]}),
    ({"logit_bias": {"5": 2.5}}, {"logit_bias": {5: 2.5}}),
    ({"logit_bias": {"0": -100, "7": "100"}}, {"logit_bias": {0: -100.0, 7: 100.0}}),
    ({"logprobs": 3}, {"logprobs": 3}),
    ({"logprobs": -1}, {"logprobs": -1}),
]


STRUCTURED = [
    ({"regex": "[a-c]{3}"}, StructuredOutputsParams(regex="[a-c]{3}")),
    ({"choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
    ({"json": {"type": "object"}}, StructuredOutputsParams(json={"type": "object"})),
    ({"json": '{"type": "object"}', "regex": None}, StructuredOutputsParams(json={"type": "object"})),
    ({"grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
    (
        {"json_object": "true", "disable_any_whitespace": True, "whitespace_pattern": " "},
        StructuredOutputsParams(json_object=True, disable_any_whitespace=True, whitespace_pattern=" "),
    ),
]


@pytest.mark.parametrize(("value", "expected"), STRUCTURED, ids=[f"structured{i}" for i in range(len(STRUCTURED))])
def test_structured_outputs_reach_vllms_params(value: dict[str, object], expected: StructuredOutputsParams) -> None:
    """vLLM's own ``StructuredOutputsParams``, which survives the engine's msgpack round trip."""
    params = parse({"structured_outputs": value})
    assert params.structured_outputs == expected
    decoded = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(_engine_request(params)))
    assert decoded.sampling_params.structured_outputs == expected
    assert parse({"structured_outputs": None}).structured_outputs is None


@pytest.mark.parametrize(("params", "expected"), GOOD, ids=[f"good{i}" for i in range(len(GOOD))])
def test_accepts(params: object, expected: dict[str, object]) -> None:
    result = parse_sampling_parameters(
        None if params is None else params if isinstance(params, str) else json.dumps(params),
        stream=False,
    )
    for name, value in expected.items():
        got = getattr(result, name)
        assert got == value and type(got) is type(value), (name, got, value)
    assert result.output_kind == RequestOutputKind.FINAL_ONLY


def test_stream_and_cumulative_logprob_flags() -> None:
    from mmserve.serving.sampling import parse_generation_parameters

    assert parse({}, stream=True).output_kind == RequestOutputKind.DELTA
    # The cumulative logprob needs the sampled tokens' logprobs: 0 more unless the client chose a number.
    assert parse({}, cumulative_logprob=True).logprobs == 0
    assert parse({"logprobs": 5}, cumulative_logprob=True).logprobs == 5
    assert parse({"logprobs": None}, cumulative_logprob=True).logprobs == 0
    assert parse({}).logprobs is None
    asked = parse_generation_parameters('{"logprobs": 0}', stream=False, cumulative_logprob=True)
    assert asked.logprobs_asked and asked.params.logprobs == 0
    assert not parse_generation_parameters("{}", stream=False, cumulative_logprob=True).logprobs_asked


def test_table_covers_only_real_fields() -> None:
    assert set(SUPPORTED) <= set(SamplingParams.__struct_fields__)


# -- the guard -----------------------------------------------------------------------------------
# SamplingParams built directly, bypassing the parser: vLLM's constructor accepts every one of them,
# and each would have ended the engine core's input thread (msgspec decode of EngineCoreRequest).
WEDGING = [
    ({"max_tokens": 16.0}, "Expected `int | null`, got `float` - at `$.max_tokens`"),
    ({"max_tokens": True}, "Expected `int | null`, got `bool` - at `$.max_tokens`"),
    ({"ignore_eos": 1}, "Expected `bool`, got `int` - at `$.ignore_eos`"),
    ({"logit_bias": {"5": 1.0}}, "Expected `int`, got `str` - at `key` in `$.logit_bias`"),
]


def _engine_request(params: SamplingParams) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id="r",
        prompt_token_ids=[1, 2],
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )


@pytest.mark.parametrize(("kwargs", "detail"), WEDGING, ids=[f"wedging{i}" for i in range(len(WEDGING))])
def test_guard_rejects_what_the_engine_core_cannot_decode(kwargs: dict[str, object], detail: str) -> None:
    params = SamplingParams(**kwargs)  # vLLM's constructor lets it through
    # What the engine core's input thread does with it (EngineCoreProc.process_input_sockets):
    with pytest.raises(msgspec.ValidationError):
        MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(_engine_request(params)))
    with pytest.raises(
        InputError, match=re.escape(f"sampling_parameters: rejected by the engine's request decoder: {detail}")
    ):
        check_engine_transport(params)


def test_guard_rejects_what_the_front_end_cannot_encode() -> None:
    with pytest.raises(InputError, match="rejected by the engine's request encoder: can't serialize ints"):
        check_engine_transport(SamplingParams(seed=2**70))


def test_guard_passes_what_the_engine_core_decodes() -> None:
    params = parse({"max_tokens": 8, "stop": ["x"], "logit_bias": {"5": 1}, "seed": 3, "top_k": 4})
    check_engine_transport(params)
    decoded = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(_engine_request(params)))
    assert decoded.sampling_params.logit_bias == {5: 1.0} and decoded.sampling_params.max_tokens == 8

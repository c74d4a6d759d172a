"""The Triton models' logic without a server: preprocessing, request parsing, sampling parameters."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from mmserve_dev.samples import AUDIO_SAMPLE_RATE, decode_audio, encode_audio, encode_image, sample_audio, sample_image

from utils import rejects


@pytest.fixture(scope="module")
def preprocessor(tiny_models):
    from mmserve.serving.preprocess import Preprocessor

    return Preprocessor(tiny_models["qwen2_5_omni"])


def test_preprocess_matches_the_hf_processor_on_decoded_media(preprocessor, omni_reference):
    import base64

    from mmserve_dev.hf_reference import chat_prompt

    image, audio = sample_image(3), sample_audio(3)
    png = encode_image(image)
    out = preprocessor("Describe.", [png], [encode_audio(audio)])
    text = chat_prompt("qwen2_5_omni", omni_reference.processor, ["image", "audio", "text:Describe."])
    wave = decode_audio(encode_audio(audio))
    ref = omni_reference.processor_inputs(text, [image], [wave])
    assert out["input_ids"].tolist() == ref["input_ids"][0].tolist()
    # The patches travel as uint8, before the processor's rescale and normalize (a quarter of the
    # bytes); decoded as mm_llm decodes them they are the processor's own float32 values.
    assert "pixel_values" not in out and out["pixel_values_uint8"].dtype == np.uint8
    assert out["pixel_values_uint8"].nbytes * 4 == ref["pixel_values"].numpy().nbytes
    decoded = preprocessor.decode_wire(out)
    assert "pixel_values_uint8" not in decoded
    for name in ("pixel_values", "image_grid_thw"):
        assert decoded[name].dtype == ref[name].numpy().dtype
        np.testing.assert_array_equal(decoded[name], ref[name].numpy())
    # Audio: the processor pads the clip to its 30-s window; preprocess keeps only the valid frames
    # (all the model reads), which are the processor's own values.
    mask = ref["feature_attention_mask"].numpy()
    frames = int(mask.sum())
    assert out["feature_attention_mask"].shape == (1, frames) < mask.shape and not mask[:, frames:].any()
    for name in ("input_features", "feature_attention_mask"):
        assert out[name].dtype == ref[name].numpy().dtype
        np.testing.assert_array_equal(out[name], ref[name].numpy()[..., :frames])
    # The image processor is transformers' torchvision backend, its fastest (the PIL backend takes
    # ~3x as long on a 448x448 image and its resize differs by up to 0.03 after normalization).
    assert type(preprocessor.processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    assert type(preprocessor.processor.image_processor).__module__.endswith("image_processing_qwen2_vl")
    # The same image as a data URL (what JSON clients send) gives the same tensors.
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    np.testing.assert_array_equal(preprocessor("Describe.", [url])["pixel_values_uint8"], out["pixel_values_uint8"])


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen2_5_vl"])
def test_uint8_patches_decode_to_the_processors_own_values(tiny_models, family):
    """``PatchNormalization`` on the processor's uint8 patches (rescale and normalize off) gives its
    float32 ``pixel_values`` bit for bit: random images of many sizes, aspect ratios and modes, one
    or several per call."""
    from PIL import Image
    from transformers import AutoImageProcessor

    from mmserve.families import get_family

    processor = AutoImageProcessor.from_pretrained(tiny_models[family])
    decode = get_family(family).wire_decoders(tiny_models[family])["image"]
    rng = np.random.default_rng(11)
    for trial in range(8):
        images = []
        for _ in range(1 + trial % 3):
            width, height = (int(v) for v in rng.integers(28, 700, size=2))
            pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
            images.append(Image.fromarray(pixels).convert(["RGB", "L", "RGBA"][trial % 3]))
        reference = processor(images=images, return_tensors="np")
        raw = processor(images=images, return_tensors="np", do_rescale=False, do_normalize=False)
        assert raw["pixel_values"].dtype == np.uint8
        decoded = decode({"pixel_values_uint8": raw["pixel_values"], "image_grid_thw": raw["image_grid_thw"]})
        assert decoded["pixel_values"].dtype == np.float32
        np.testing.assert_array_equal(decoded["pixel_values"], reference["pixel_values"])
        np.testing.assert_array_equal(decoded["image_grid_thw"], reference["image_grid_thw"])


def test_wire_images_carry_an_identity_per_image(tiny_models):
    """Images as ``preprocess`` sends them (``pixel_values_uint8``) get an identity per image, which
    vLLM takes for the item's hash (``multi_modal_uuids``): the same for an image alone, first or
    second beside another (an earlier turn's image is a cache hit), different for images that differ
    in one value; none where the grid does not split the patches (the decoded fields' checks refuse
    it) and none for float ``pixel_values`` (vLLM hashes those itself)."""
    from transformers import AutoImageProcessor

    from mmserve.families import get_family

    family = get_family("qwen2_5_omni")
    processor = AutoImageProcessor.from_pretrained(tiny_models["qwen2_5_omni"])
    decoders = family.wire_decoders(tiny_models["qwen2_5_omni"])
    a, b = sample_image(1, size=(112, 84)), sample_image(2, size=(140, 84))

    def wire(images):
        raw = processor(images=images, return_tensors="np", do_rescale=False, do_normalize=False)
        return {"pixel_values_uint8": raw["pixel_values"], "image_grid_thw": raw["image_grid_thw"]}

    def ids_of(tensors):
        item_ids: dict[str, list[str]] = {}
        decoded = family.decode_wire(tensors, decoders, item_ids=item_ids)
        return decoded, item_ids.get("image")

    decoded, ab = ids_of(wire([a, b]))
    assert ab is not None and len(set(ab)) == 2
    assert ids_of(wire([b, a]))[1] == ab[::-1]
    assert ids_of(wire([a]))[1] == ab[:1] and ids_of(wire([b]))[1] == ab[1:]
    changed = wire([a])
    changed["pixel_values_uint8"] = changed["pixel_values_uint8"].copy()
    changed["pixel_values_uint8"][-1, -1] ^= 1
    assert ids_of(changed)[1] not in (None, ab[:1])
    unsplittable = wire([a, b])
    rows = int(np.prod(unsplittable["image_grid_thw"], axis=1).sum())
    unsplittable["image_grid_thw"] = np.array([[1, 0, 0], [1, 1, rows]])  # the rows add up, an image has none
    assert ids_of(unsplittable)[1] is None
    assert ids_of(decoded)[1] is None  # float pixel_values


def test_audio_features_are_the_full_window_ones_on_the_valid_frames(preprocessor, omni_reference):
    """preprocess pads clips just past the longest one (not to the 30-s window) and cuts the
    padding: every valid frame must still be bit-identical to the processor's default output, for
    one or two clips of any length, loud, quiet or silent."""
    from mmserve_dev.hf_reference import chat_prompt

    rng = np.random.default_rng(7)
    for trial in range(12):
        seconds = rng.uniform(0.1, 29.5, size=1 + trial % 2)
        clips = [
            (rng.standard_normal(int(s * AUDIO_SAMPLE_RATE)) * rng.uniform(1e-3, 1.0)).astype(np.float32)
            for s in seconds
        ]
        if trial % 4 == 0:
            clips[0][:] = 0.0
        out = preprocessor("Hi", pcm=[(clip, AUDIO_SAMPLE_RATE) for clip in clips])
        text = chat_prompt("qwen2_5_omni", omni_reference.processor, ["audio"] * len(clips) + ["text:Hi"])
        ref = omni_reference.processor_inputs(text, audios=clips)
        mask = ref["feature_attention_mask"].numpy()
        frames = int(mask.sum(-1).max())
        assert out["input_ids"].tolist() == ref["input_ids"][0].tolist()
        np.testing.assert_array_equal(out["feature_attention_mask"], mask[:, :frames])
        np.testing.assert_array_equal(out["input_features"], ref["input_features"].numpy()[..., :frames])


def test_preprocess_empty_modalities_and_pcm(preprocessor):
    out = preprocessor("Hi")
    assert list(out) == ["input_ids"]  # no feature tensor for a modality the request lacks
    wave = sample_audio(1, seconds=1.0, sample_rate=8000)
    resampled = preprocessor("Hi", pcm=[(wave, 8000)])
    direct = preprocessor("Hi", pcm=[(sample_audio(1, seconds=1.0), AUDIO_SAMPLE_RATE)])
    assert resampled["feature_attention_mask"].sum() == direct["feature_attention_mask"].sum() == 100


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen2_5_vl", "qwen2_audio"])
def test_a_prompt_without_media_is_tokenized_without_the_processor(tiny_models, family, monkeypatch):
    """Text alone goes to the tokenizer, not through the HF processor, with the processor's own ids
    (templated and raw); a prompt with a placeholder still goes to the processor (and its checks)."""
    from transformers import AutoProcessor

    from mmserve.serving.preprocess import PreprocessError, Preprocessor
    from mmserve_dev.hf_reference import chat_prompt

    reference = AutoProcessor.from_pretrained(tiny_models[family])
    text = "Tell me, wörld: 你好 ¿what is 2+2? 😀"
    templated = chat_prompt(family, reference, [f"text:{text}"])
    expected = {
        True: reference(text=[templated], return_tensors="np")["input_ids"][0].tolist(),
        False: reference(text=[text], return_tensors="np")["input_ids"][0].tolist(),
    }
    preprocessor = Preprocessor(tiny_models[family])
    calls = []
    processor_call = type(preprocessor.processor).__call__

    def recorded(self, **kwargs):
        calls.append(kwargs)
        return processor_call(self, **kwargs)

    monkeypatch.setattr(type(preprocessor.processor), "__call__", recorded)
    for apply_chat_template in (True, False):
        out = preprocessor(text, apply_chat_template=apply_chat_template)
        assert out["input_ids"].tolist() == expected[apply_chat_template]
    assert calls == []
    token = preprocessor.placeholder_ids["audio" if family == "qwen2_audio" else "image"][0]
    with pytest.raises(PreprocessError, match="placeholder"):
        preprocessor(f"{token} {text}", apply_chat_template=False)
    assert len(calls) >= 1


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda p: p("x", [b"junk"]), r"image\[0\]: cannot decode 4 bytes as an image"),
        (lambda p: p("x", [], [b"RIFF0000WAVE"]), r"audio\[0\]: cannot decode 12 bytes as audio"),
        (lambda p: p("x", ["data:image/png,abc"]), r"image\[0\]: a data URL must be base64-encoded"),
        (
            lambda p: p("x", pcm=[(np.zeros(0, np.float32), AUDIO_SAMPLE_RATE)]),
            r"audio_pcm\[0\]: expected a non-empty mono clip",
        ),
        (
            lambda p: p("<|vision_bos|><|IMAGE|><|vision_eos|>x", apply_chat_template=False),
            r"text_input: 1 <\|IMAGE\|> placeholder\(s\) in the prompt, but 0 image item\(s\) given",
        ),
    ],
)
def test_preprocess_errors_name_the_input_and_item(preprocessor, call, message):
    from mmserve.serving.preprocess import PreprocessError

    with pytest.raises(PreprocessError, match=message):
        call(preprocessor)


def test_sampling_parameters():
    from vllm.sampling_params import RequestOutputKind

    from mmserve.errors import InputError
    from mmserve.serving.sampling import parse_sampling_parameters

    params = parse_sampling_parameters('{"max_tokens": "7", "temperature": "0.5", "ignore_eos": "true"}', stream=True)
    assert (params.max_tokens, params.temperature, params.ignore_eos) == (7, 0.5, True)
    assert params.output_kind == RequestOutputKind.DELTA
    assert parse_sampling_parameters(None, stream=False, cumulative_logprob=True).logprobs == 0
    for text, message in [
        ("{", "invalid JSON"),
        ("[1]", "expected a JSON object"),
        ('{"bogus": 1}', r"unknown parameter\(s\) \['bogus'\]"),
        ('{"max_tokens": "many"}', "max_tokens: expected `int | null`, found 'many'"),
        ('{"top_p": 2}', "top_p"),
        ('{"n": 2}', "only 1 completion"),
    ]:
        with pytest.raises(InputError, match=message):
            parse_sampling_parameters(text, stream=False)


def test_parse_request_groups_tensors_by_modality():
    from mmserve.families import get_family
    from mmserve.serving.llm import RequestError, parse_request

    tensors: dict[str, np.ndarray] = {
        "input_ids": np.arange(10, dtype=np.int64),
        "pixel_values": np.zeros((0, 0), np.float32),
        "image_grid_thw": np.zeros((0, 3), np.int64),
        "input_features": np.ones((1, 128, 3000), np.float32),
        "feature_attention_mask": np.ones((1, 3000), np.int32),
        "stream": np.array([True]),
        "text_input": np.array([b"hello"], dtype=object),
    }
    request = parse_request(get_family("qwen2_5_omni"), tensors.get)
    assert request.stream and request.text_input == "hello"
    assert request.prompt["prompt_token_ids"] == list(range(10))
    assert set(request.prompt["multi_modal_data"]) == {"audio"}
    with pytest.raises(
        RequestError,
        match=r"input_features: the qwen2_5_vl model takes no such input \(it takes \['image_embeds', "
        r"'image_grid_thw', 'pixel_values', 'pixel_values_videos', 'second_per_grid_ts', 'video_embeds', "
        r"'video_grid_thw'\]\)",
    ):
        parse_request(get_family("qwen2_5_vl"), tensors.get)
    with pytest.raises(RequestError, match="input_ids: expected a non-empty INT64 tensor"):
        parse_request(get_family("qwen2_5_omni"), lambda name: None)
    # Video tensors: grouped for Qwen2.5-VL (next to empty image and audio tensors, as preprocess sends
    # them), refused by name for a family without video (Qwen2-Audio).
    video: dict[str, np.ndarray] = {
        "input_ids": np.arange(10, dtype=np.int64),
        "pixel_values": np.zeros((0, 0), np.float32),
        "input_features": np.zeros((0, 0, 0), np.float32),
        "pixel_values_videos": np.ones((2 * 4 * 4, 1176), np.float32),
        "video_grid_thw": np.array([[2, 4, 4]], np.int64),
        "second_per_grid_ts": np.array([0.5], np.float32),
    }
    assert set(parse_request(get_family("qwen2_5_vl"), video.get).prompt["multi_modal_data"]) == {"video"}
    with pytest.raises(RequestError, match=r"pixel_values_videos: the qwen2_audio model takes no such input"):
        parse_request(get_family("qwen2_audio"), video.get)


def test_parse_request_decodes_uint8_patches(tiny_models, preprocessor):
    """``pixel_values_uint8`` (what preprocess sends) reaches the engine as the same float32
    ``pixel_values`` a client running the HF processor sends; what can't be decoded is refused,
    naming the tensor."""
    from mmserve.errors import InputError
    from mmserve.families import get_family
    from mmserve.serving.llm import parse_request

    family = get_family("qwen2_5_omni")
    decoders = family.wire_decoders(tiny_models["qwen2_5_omni"])
    wire = preprocessor("Describe.", [encode_image(sample_image(5, size=(90, 60)))])
    hf = preprocessor.decode_wire(wire)

    def image_data(tensors):
        request = parse_request(family, tensors.get, wire_decoders=decoders)
        return request.prompt["multi_modal_data"]["image"]

    from_wire, from_hf = image_data(wire), image_data(hf)
    assert from_wire["pixel_values"].dtype == np.float32
    np.testing.assert_array_equal(from_wire["pixel_values"], from_hf["pixel_values"])
    assert set(from_wire) == set(from_hf) == {"pixel_values", "image_grid_thw"}

    both = {**wire, "pixel_values": hf["pixel_values"]}
    with pytest.raises(
        InputError, match=r"image, pixel_values_uint8: expected pixel_values or pixel_values_uint8, not both"
    ):
        image_data(both)
    narrow = {**wire, "pixel_values_uint8": wire["pixel_values_uint8"][:, :100]}
    with pytest.raises(
        InputError,
        match=r"image, pixel_values_uint8: expected uint8 of shape \(patches, 1176\), found uint8 of shape \(\d+, 100\)",
    ):
        image_data(narrow)
    with pytest.raises(InputError, match=r"pixel_values_uint8: the qwen2_5_omni model takes no such input"):
        parse_request(family, wire.get)  # no decoders: the tensor is refused, not ignored


def _model_config(name: str, repository: str = "model_repository"):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from utils import ROOT

    text = (ROOT / repository / name / "config.pbtxt").read_text()
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def _triton_type(dtype: str) -> str:
    from tritonclient.utils import np_to_triton_dtype

    name = np_to_triton_dtype(np.dtype(dtype))
    return "TYPE_STRING" if name == "BYTES" else "TYPE_" + name


def _listed(tensors) -> list[tuple[str, str, list[int], bool]]:
    """(name, type, dims, optional) of a config's inputs or outputs, in order."""
    from tritonclient.grpc import model_config_pb2

    return [
        (t.name, model_config_pb2.DataType.Name(t.data_type), list(t.dims), getattr(t, "optional", False))
        for t in tensors
    ]


def _expected(specs, required=()) -> list[tuple[str, str, list[int], bool]]:
    return [(s.name, _triton_type(s.dtype), list(s.triton_dims), s.name not in required) for s in specs]


def test_model_repository_configs_follow_the_tensor_contract():
    """Every config.pbtxt lists exactly the tensors of mmserve.wire and mmserve.serving.contract (names,
    types, dims, optional, order), and the ensemble wires preprocess's outputs to mm_llm's inputs."""
    from mmserve import wire
    from mmserve.serving.contract import FEATURE_TENSORS, INPUT_IDS, MM_LLM_INPUTS

    preprocess, llm, ensemble = (_model_config(n) for n in ("preprocess", "mm_llm", "mm_ensemble"))
    outputs = [entry[:3] for entry in _expected(wire.OUTPUTS)]
    # text_input is required everywhere (or messages, a conversation), but marked optional so that
    # the model answers its absence.
    assert {"text_input", "messages", "image", "audio"} <= set(wire.names(wire.PREPROCESS_INPUTS))
    assert _listed(preprocess.input) == _expected(wire.PREPROCESS_INPUTS)
    assert [entry[:3] for entry in _listed(preprocess.output)] == [
        entry[:3] for entry in _expected((INPUT_IDS, *FEATURE_TENSORS))
    ]
    assert _listed(llm.input) == _expected(MM_LLM_INPUTS, required=("input_ids",))
    assert [entry[:3] for entry in _listed(llm.output)] == outputs
    assert llm.model_transaction_policy.decoupled
    assert _listed(ensemble.input) == _expected(wire.PUBLIC_INPUTS)
    assert [entry[:3] for entry in _listed(ensemble.output)] == outputs

    # The ensemble feeds every preprocess output to the same-named mm_llm input, its own inputs to the
    # same-named inputs of each step, and exposes mm_llm's outputs under their own names.
    first, second = ensemble.ensemble_scheduling.step
    assert (first.model_name, second.model_name) == ("preprocess", "mm_llm")
    assert dict(first.input_map) == {name: name for name in wire.names(wire.PREPROCESS_INPUTS)}
    assert first.input_map["messages"] == "messages"
    internal = {first.output_map[name]: name for name in first.output_map}
    assert set(internal.values()) == {s.name for s in (INPUT_IDS, *FEATURE_TENSORS)}
    assert {key: value for key, value in second.input_map.items() if value in internal} == {
        name: f"_{name}" for name in internal.values()
    }
    assert {key: value for key, value in second.input_map.items() if value not in internal} == {
        name: name for name in wire.names((wire.TEXT_INPUT, *wire.GENERATION_INPUTS))
    }
    assert dict(second.output_map) == {name: name for name in wire.names(wire.OUTPUTS)}


def test_the_encoder_repository_follows_the_tensor_contract():
    """``encode`` takes what preprocess outputs and outputs the encoded tensors; ``mm_ensemble_encoded``
    has mm_ensemble's inputs and outputs, gives encode what it reads (the features it consumes, each
    item's extent) and mm_llm every preprocess output it does not consume, encode's outputs and the
    request's own inputs."""
    from mmserve import wire
    from mmserve.families import FAMILIES
    from mmserve.serving.contract import ENCODED_TENSORS, FEATURE_TENSORS, INPUT_IDS

    consumed = frozenset().union(*(family.replaced_by_encoded for family in FAMILIES.values()))

    encode = _model_config("encode", "model_repository_encoder")
    assert _listed(encode.input) == _expected(FEATURE_TENSORS)
    assert _listed(encode.output) == _expected(ENCODED_TENSORS, required=wire.names(ENCODED_TENSORS))
    ensemble, plain = _model_config("mm_ensemble_encoded", "model_repository_encoder"), _model_config("mm_ensemble")
    assert (_listed(ensemble.input), _listed(ensemble.output)) == (_listed(plain.input), _listed(plain.output))
    first, second, third = ensemble.ensemble_scheduling.step
    assert (first.model_name, second.model_name, third.model_name) == ("preprocess", "encode", "mm_llm")
    assert first == plain.ensemble_scheduling.step[0]
    produced = {name: f"_{name}" for name in wire.names((INPUT_IDS, *FEATURE_TENSORS))}
    assert dict(first.output_map) == produced
    reads = frozenset().union(*(family.encoder_reads for family in FAMILIES.values()))
    assert {"image_grid_thw", "video_grid_thw", "image_num_patches", "chunk_counts"} <= reads
    assert dict(second.input_map) == {name: internal for name, internal in produced.items() if name in reads}
    encoded = {name: f"_{name}" for name in wire.names(ENCODED_TENSORS)}
    assert dict(second.output_map) == encoded
    own = {name: name for name in wire.names((wire.TEXT_INPUT, *wire.GENERATION_INPUTS))}
    kept = {name: internal for name, internal in produced.items() if name not in consumed}
    assert dict(third.input_map) == {**kept, **encoded, **own}
    assert dict(third.output_map) == dict(plain.ensemble_scheduling.step[1].output_map)


def test_the_client_names_only_tensors_of_the_contract():
    """mmserve.client spells tensor names itself (it imports no torch): each one it sends or reads is
    a tensor of mmserve.wire or mmserve.serving.contract."""
    import ast

    from mmserve import wire
    from mmserve.serving.contract import MM_LLM_INPUTS

    from utils import ROOT

    known = set(wire.names((*wire.PUBLIC_INPUTS, *wire.OUTPUTS, *MM_LLM_INPUTS)))
    tree = ast.parse((ROOT / "src" / "mmserve" / "client.py").read_text())
    named: set[object] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("tensors", "processed", "body", "flags")
            and isinstance(node.slice, ast.Constant)
        ):
            named.add(node.slice.value)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("get", "optional", "first")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            named.add(node.args[0].value)
        elif (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Dict)
            and any(isinstance(t, ast.Name) and t.id in ("tensors", "flags", "body") for t in node.targets)
        ):
            named.update(k.value for k in node.value.keys if isinstance(k, ast.Constant))
    assert len(named) >= 12, named  # the check sees the client's names
    assert named <= known, named - known


class _StubRunner:
    """What ``LLMService`` needs of an engine runner, without an engine (``engine`` None: the
    watcher stops at once); ``shutdown`` blocks until ``release`` is set."""

    def __init__(self, model) -> None:
        import threading

        self.engine_args, self.vocab_size, self.max_model_len, self.engine = {"model": str(model)}, None, None, None
        self.in_shutdown, self.release = threading.Event(), threading.Event()

    def kill_processes(self) -> None:
        pass

    def shutdown(self, timeout: float = 60.0) -> None:
        self.in_shutdown.set()
        self.release.wait(10)


def test_the_client_sends_tools_to_the_template_and_to_the_engine(monkeypatch, preprocessor):
    """``MMClient(...).generate(messages=..., tools=..., tool_choice=...)``: the tools go in
    ``preprocess``'s ``tools`` tensor (the chat template) and, with the choice, in
    ``sampling_parameters`` (the engine's constraint); over HTTP as JSON; directly, to the
    preprocessor itself."""
    import json

    from mmserve.client import MMClient
    from mmserve_dev.samples import WEATHER_TOOL

    sent: dict[str, object] = {}
    monkeypatch.setattr(MMClient, "start_tensors", lambda self, tensors, model=None: sent.update(tensors))
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    MMClient("127.0.0.1:1").start(messages=messages, tools=[WEATHER_TOOL], tool_choice="required")
    assert json.loads(sent["tools"][0]) == [WEATHER_TOOL]  # type: ignore[index]
    sampling = json.loads(sent["sampling_parameters"][0])  # type: ignore[index]
    assert sampling["tools"] == [WEATHER_TOOL] and sampling["tool_choice"] == "required"

    direct = MMClient.__new__(MMClient)
    direct._preprocessor = preprocessor
    assert direct._tensors("", [], [], True, messages, (), [WEATHER_TOOL])["input_ids"].size
    rejects(
        lambda: direct._tensors("", [], [], True, messages, (), [{"type": "custom"}]),
        "tools[0].type: expected 'function'",
    )


def test_an_engine_failure_is_not_reported_once_the_model_stops(tiny_models):
    """A stop that comes while a failure is being handled: ``on_failure`` (mm_llm's
    ``unload_model``, which crashed tritonserver 2.51 when called during the model's finalize) is not
    called once ``shutdown`` began, and ``shutdown`` waits for a call in progress."""
    import threading

    from mmserve.serving.llm import LLMService

    # The stop comes while the failed engine is being shut down: no report.
    runner = _StubRunner(tiny_models["qwen2_5_omni"])
    reports: list[str] = []
    service = LLMService(runner, on_failure=reports.append)  # type: ignore[arg-type]  # a stand-in runner
    failing = threading.Thread(target=service.fail, args=("injected",))
    failing.start()
    assert runner.in_shutdown.wait(10)
    stopping = threading.Thread(target=service.shutdown)
    stopping.start()
    time.sleep(0.2)
    runner.release.set()
    failing.join(10)
    stopping.join(10)
    assert not failing.is_alive() and not stopping.is_alive()
    assert reports == []

    # The stop comes while the failure is being reported: the stop waits for the report to end.
    runner = _StubRunner(tiny_models["qwen2_5_omni"])
    runner.release.set()
    reporting, events = threading.Event(), []

    def slow_report(reason: str) -> None:
        reporting.set()
        time.sleep(0.5)
        events.append(f"reported {reason}")

    service = LLMService(runner, on_failure=slow_report)  # type: ignore[arg-type]  # a stand-in runner
    failing = threading.Thread(target=service.fail, args=("injected",))
    failing.start()
    assert reporting.wait(10)
    service.shutdown()
    events.append("stopped")
    failing.join(10)
    assert events == ["reported injected", "stopped"]


class _LoopRunner(_StubRunner):
    """A stand-in runner with a loop of its own; its streams never yield (a long generation)."""

    def __init__(self, model) -> None:
        import asyncio
        import threading

        super().__init__(model)
        self.release.set()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def submit(self, coro):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def stream(self, prompt, params, request_id, lora_request=None):
        import asyncio

        await asyncio.Event().wait()
        yield  # an async generator that never yields


def test_requests_stopped_before_they_ran_get_one_final_response(tiny_models):
    """A drain (or a stop) that ends requests whose task has not run its first step yet: each gets
    its final UNAVAILABLE response, and the drain returns only once they all did (a task cancelled
    before it runs never runs its own handler; the request would hold its model loaded)."""
    import threading

    from mmserve.serving.llm import GenerateRequest, LLMService

    runner = _LoopRunner(tiny_models["qwen2_5_omni"])
    service = LLMService(runner)  # type: ignore[arg-type]  # a stand-in runner
    finals: dict[int, list[str]] = {}

    class Sink:
        def __init__(self, k: int) -> None:
            self.k = k

        def send(self, outputs, *, final):
            finals.setdefault(self.k, []).append("output")

        def send_error(self, error):
            finals.setdefault(self.k, []).append(f"{type(error).__name__}: {error}")

        def send_final(self):
            finals.setdefault(self.k, []).append("final")

        def is_cancelled(self):
            return False

    stopping = "the server is stopping; retry on another replica or later"
    request = GenerateRequest(prompt={}, sampling_params=None, flags={"stream": True})
    # The loop is held busy: no request's task takes its first step before the drain ends them.
    hold = threading.Event()
    runner.loop.call_soon_threadsafe(hold.wait, 10)
    for k in range(8):
        service.submit(request, Sink(k), f"r{k}")
    drained: list[int] = []
    draining = threading.Thread(target=lambda: drained.append(service.drain(0.0)))
    draining.start()
    time.sleep(0.2)
    assert not finals and draining.is_alive()  # nothing answered while the loop is held
    hold.set()
    draining.join(10)
    assert drained == [8] and service.in_flight() == 0
    assert sorted(finals) == list(range(8))
    assert all(answers == ["UnavailableError: " + stopping] for answers in finals.values()), finals
    service.shutdown()
    runner.loop.call_soon_threadsafe(runner.loop.stop)


class _EndingRunner(_LoopRunner):
    """A stand-in runner whose streams end at once, unfinished (as an aborted vLLM request)."""

    async def stream(self, prompt, params, request_id, lora_request=None):
        return
        yield  # an async generator that ends before its first output


def test_a_drain_returns_once_the_final_responses_are_sent(tiny_models):
    """Requests that end within the drain's grace period: the drain returns only once their final
    responses are sent, not merely queued (mm_llm then sends UNAVAILABLE to every request still
    without one: it would replace a request's real ending)."""
    import threading

    from mmserve.serving.llm import GenerateRequest, LLMService

    runner = _EndingRunner(tiny_models["qwen2_5_omni"])
    service = LLMService(runner)  # type: ignore[arg-type]  # a stand-in runner
    sent: list[int] = []
    hold = threading.Event()

    class SlowSink:
        def __init__(self, k: int) -> None:
            self.k = k

        def send(self, outputs, *, final):
            raise AssertionError("no output expected")

        def send_error(self, error):
            raise AssertionError(f"no error expected: {error}")

        def send_final(self):
            hold.wait(10)  # Triton is slow to take it
            sent.append(self.k)

        def is_cancelled(self):
            return False

    request = GenerateRequest(prompt={}, sampling_params=None, flags={"stream": True})
    for k in range(4):
        service.submit(request, SlowSink(k), f"r{k}")
    drained: list[int] = []
    draining = threading.Thread(target=lambda: drained.append(service.drain(5.0)))
    draining.start()
    time.sleep(0.3)
    assert draining.is_alive() and not sent  # their finals are queued, not sent: the drain waits
    hold.set()
    draining.join(10)
    assert drained == [0] and sorted(sent) == [0, 1, 2, 3]
    service.shutdown()
    runner.loop.call_soon_threadsafe(runner.loop.stop)


def test_drain_without_a_server_says_so():
    """``python -m mmserve.drain`` (the pod's preStop) exits 1, quickly, when no server answers."""
    import subprocess
    import sys

    from mmserve_dev.triton import free_ports

    [port] = free_ports(1)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "mmserve.drain", "--url", f"127.0.0.1:{port}", "--grace-s", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "could not drain mm_llm" in done.stderr, done
    assert time.monotonic() - started < 30


def test_the_sender_guard_sends_one_final_and_lets_the_sender_go():
    """mmserve.serving.triton.TritonSink: the first final response goes out, anything after it is
    dropped; the sender object is released with the final send (Triton frees the request's response
    factory, which pins the model, only when it goes); a finished request is never asked whether it
    was cancelled (that crashes Triton 2.51)."""
    import weakref

    from mmserve.errors import UnavailableError
    from mmserve.serving.triton import TritonSink

    from utils import fake_pb_utils

    class Sender:
        def __init__(self) -> None:
            self.sent: list[tuple[Any, int]] = []
            self.polls = 0

        def send(self, response=None, flags=0) -> None:
            self.sent.append((response, flags))

        def is_cancelled(self) -> bool:
            self.polls += 1
            return False

    pb = fake_pb_utils()

    class Request:
        def __init__(self, sender: Sender) -> None:
            self._sender = sender

        def get_response_sender(self) -> Sender:
            return self._sender

    sender = Sender()
    request = Request(sender)
    before = TritonSink.unfinished()
    sink = TritonSink(pb, request)
    assert TritonSink.unfinished() == before + 1
    sink.send({"text_output": np.array([b"a"], dtype=object)}, final=False)
    assert not sink.is_cancelled() and sender.polls == 1
    sink.send_error(UnavailableError("the server is stopping"))
    sink.send_final()
    sink.send({"text_output": np.array([b"b"], dtype=object)}, final=True)
    assert [flags for _, flags in sender.sent] == [0, 1]
    response, _ = sender.sent[1]
    assert response.error.message().startswith("[UNAVAILABLE] the server is stopping")
    assert not sink.is_cancelled() and sender.polls == 1  # not asked once finished
    assert sink.finished and TritonSink.unfinished() == before
    held = weakref.ref(sender)
    del sender, request
    assert held() is None, "the guard still holds the sender after the final response"

    # Before a stop: every guard still without a final response gets one (but the one named).
    senders = [Sender() for _ in range(3)]
    sinks = [TritonSink(pb, Request(s)) for s in senders]
    sinks[0].send_final()
    assert TritonSink.end_unfinished(UnavailableError("the server is stopping"), but=sinks[2]) == 1
    assert [[flags for _, flags in s.sent] for s in senders] == [[1], [1], []]
    assert senders[1].sent[0][0].error.message().startswith("[UNAVAILABLE] the server is stopping")
    assert TritonSink.unfinished() == before + 1
    sinks[2].send_final()

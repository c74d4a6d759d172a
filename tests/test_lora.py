"""LoRA adapters (``mmserve.serving.lora``): ``multi_lora.json`` in Triton's vLLM backend's format, each
adapter checked when the model loads, a request's ``lora_name``; and on a real engine (Qwen2.5-VL's tiny
checkpoint with two tiny adapters built offline with ``peft``, ranks 8 and 16, on the language model's
attention and MLP projections): greedy tokens with an adapter = HF transformers + peft on the raw
inputs = vLLM raw with a ``LoRARequest`` = vLLM on ``preprocess``'s tensors of the files (and on the
encoder's outputs); base and both adapters in flight at once on the same prompt and image, prefilled
in steps with the prefix cache on, each its own tokens."""

from __future__ import annotations

import importlib
import json
import shutil
from typing import Any

import pytest

from mmserve_dev.samples import encode_image, sample_image

from utils import greedy, lora_engine, run_concurrently, served_adapters

FAMILY = "qwen2_5_vl"
CHUNK = 32


@pytest.fixture(scope="module")
def adapters(tiny_models):
    from mmserve_dev.tiny_adapters import build_all_adapters

    return build_all_adapters(families=(FAMILY,), checkpoints=tiny_models)[FAMILY]


def _model_dir(tmp_path, adapters):
    (tmp_path / "multi_lora.json").write_text(json.dumps({name: str(path) for name, path in adapters.items()}))
    return tmp_path


# -- multi_lora.json and the adapters' folders, checked when the model loads -------------------------
def test_adapters_are_read_in_the_vllm_backends_format(tmp_path, adapters):
    from mmserve.serving.lora import Adapters

    assert not Adapters.from_model_dir(tmp_path, {}).enabled  # LoRA off: multi_lora.json is not read
    folder = _model_dir(tmp_path, adapters)
    served = Adapters.from_model_dir(folder, {"enable_lora": "true", "max_lora_rank": 16})
    assert served.enabled and list(served.by_name) == ["lora_r8", "lora_r16"]
    assert [(a.rank, a.lora_id) for a in served.by_name.values()] == [(8, 1), (16, 2)]
    request = served.resolve("lora_r16")
    assert (request.lora_name, request.lora_int_id, request.lora_path) == ("lora_r16", 2, str(adapters["lora_r16"]))
    assert served.resolve(None) is None
    # a folder relative to the model's directory
    shutil.copytree(adapters["lora_r8"], tmp_path / "local")
    (tmp_path / "multi_lora.json").write_text(json.dumps({"local": "local"}))
    assert Adapters.from_model_dir(tmp_path, {"enable_lora": True}).by_name["local"].path == (tmp_path / "local")


def test_a_bad_adapter_fails_the_load_naming_it(tmp_path, adapters):
    from mmserve.serving.lora import AdapterError, Adapters

    on = {"enable_lora": True, "max_lora_rank": 16}
    with pytest.raises(AdapterError, match=r"multi_lora.json: enable_lora is set in model.json, and this file"):
        Adapters.from_model_dir(tmp_path, on)
    cases = {
        "not a folder": ({"sql": str(tmp_path / "missing")}, r"adapter 'sql': .*missing is not a folder"),
        "no config": ({"sql": str(tmp_path)}, r"adapter 'sql': .* is not a PEFT adapter \(no adapter_config.json\)"),
        "not a name map": (["sql"], r"expected an object of adapter names to folders"),
    }
    for entries, message in cases.values():
        (tmp_path / "multi_lora.json").write_text(json.dumps(entries))
        with pytest.raises(AdapterError, match=message):
            Adapters.from_model_dir(tmp_path, on)
    (tmp_path / "multi_lora.json").write_text("{")
    with pytest.raises(AdapterError, match="not valid JSON"):
        Adapters.from_model_dir(tmp_path, on)
    other = tmp_path / "prefix"
    shutil.copytree(adapters["lora_r8"], other)
    config = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "PREFIX_TUNING"}))
    (tmp_path / "multi_lora.json").write_text(json.dumps({"prefix": str(other)}))
    with pytest.raises(AdapterError, match=r"adapter 'prefix': .*expected peft_type LORA, found 'PREFIX_TUNING'"):
        Adapters.from_model_dir(tmp_path, on)
    _model_dir(tmp_path, adapters)
    with pytest.raises(AdapterError, match=r"adapter 'lora_r16': rank 16 exceeds max_lora_rank 8 \(model.json\)"):
        Adapters.from_model_dir(tmp_path, {"enable_lora": True, "max_lora_rank": 8})


def test_a_requests_adapter_is_one_the_model_serves(tmp_path, adapters):
    from mmserve.errors import InputError
    from mmserve.serving.lora import Adapters
    from mmserve.serving.sampling import parse_generation_parameters

    served = Adapters.from_model_dir(_model_dir(tmp_path, adapters), {"enable_lora": True})
    with pytest.raises(
        InputError, match=r"lora_name 'sql' is not an adapter of this model \(it serves \['lora_r16', 'lora_r8'\]\)"
    ):
        served.resolve("sql")
    with pytest.raises(InputError, match=r"lora_name 'sql': this model serves no LoRA adapters \(enable_lora is off"):
        Adapters({}).resolve("sql")
    assert parse_generation_parameters('{"lora_name": "lora_r8"}', stream=False).lora_name == "lora_r8"
    for bad in ('""', '"' + "a" * 257 + '"', "7"):
        with pytest.raises(InputError, match="lora_name"):
            parse_generation_parameters('{"lora_name": ' + bad + "}", stream=False)


def test_an_operators_update_of_the_adapters(tmp_path, adapters):
    """``parse_update``'s three forms, each bounded and checked; ``Adapters.updated`` keeps an adapter's id
    while its folder stays and gives a new one otherwise (never reused: no KV block of other weights)."""
    from mmserve.errors import InputError
    from mmserve.serving.lora import MAX_UPDATE_CHARS, AdapterError, Adapters, parse_update

    served = Adapters.from_model_dir(_model_dir(tmp_path, adapters), {"enable_lora": True, "max_lora_rank": 16})
    r8, r16 = str(adapters["lora_r8"]), str(adapters["lora_r16"])
    assert parse_update(served, '{"unload": ["lora_r8"]}') == {"lora_r16": r16}
    assert parse_update(served, json.dumps({"load": {"sql": r8}})) == {"lora_r8": r8, "lora_r16": r16, "sql": r8}
    assert parse_update(served, '{"reload": true}') == {"lora_r8": r8, "lora_r16": r16}
    for text, message in [
        ("{", "lora_adapters: invalid JSON"),
        ('{"drop": ["lora_r8"]}', 'expected one of {"load"'),
        ('{"load": {}, "unload": []}', 'expected one of {"load"'),
        ('{"unload": ["nope", "lora_r8"]}', r"unload: 'nope' not served \(it serves \['lora_r16', 'lora_r8'\]\)"),
        ('{"unload": []}', "unload: expected a non-empty list"),
        ('{"load": {"sql": 7}}', "load: expected a non-empty object of adapter names to folders"),
        ('{"reload": 1}', "reload: expected true"),
        (" " * (MAX_UPDATE_CHARS + 1), f"expected at most {MAX_UPDATE_CHARS} characters"),
    ]:
        with pytest.raises(InputError, match=message):
            parse_update(served, text)
    with pytest.raises(InputError, match="this model serves no LoRA adapters"):
        parse_update(Adapters({}), '{"reload": true}')

    unloaded = served.updated({"lora_r16": r16})
    assert unloaded.by_name["lora_r16"].lora_id == 2 and not served.new_in(unloaded)
    moved = unloaded.updated({"lora_r16": r8, "lora_r8": r8})  # a new folder under an old name: a new id
    assert [(a.name, a.lora_id) for a in moved.by_name.values()] == [("lora_r16", 3), ("lora_r8", 4)]
    assert [a.name for a in unloaded.new_in(moved)] == ["lora_r16", "lora_r8"]
    with pytest.raises(AdapterError, match=r"adapter 'bad': .*missing is not a folder"):
        served.updated({"bad": str(tmp_path / "missing")})


# -- on the engine -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory, adapters):
    return served_adapters(tmp_path_factory.mktemp("mm_llm"), adapters)


@pytest.fixture(scope="module")
def engine(tiny_models, served):
    with lora_engine(tiny_models[FAMILY], served, CHUNK) as runner:
        yield runner


@pytest.fixture(scope="module")
def references(tiny_models, adapters):
    """HF transformers, base and with each adapter (peft), for the text and the image request."""
    from peft import PeftModel

    from mmserve_dev.hf_reference import HFReference, chat_prompt

    image = sample_image(21, size=(280, 196))  # 70 placeholders: the prompt prefills in 3 steps
    out: dict[Any, Any] = {}
    for name in (None, *adapters):
        reference = HFReference(FAMILY, tiny_models[FAMILY])
        if name is not None:
            reference.model = PeftModel.from_pretrained(reference.model, str(adapters[name])).eval()
        for case, parts, images in (
            ("text", ["text:Tell a story."], []),
            ("image", ["image", "text:What is it?"], [image]),
        ):
            text = chat_prompt(FAMILY, reference.processor, parts)
            out[(case, name)] = reference.generate(text, images=images or None, max_new_tokens=12)
            out[(case, "text")] = text
    out["image"] = image
    return out


@pytest.mark.engine
def test_an_adapters_tokens_are_hf_and_pefts(engine, served, references, tiny_models):
    """Per adapter (and the base model), text and an image: HF + peft on the raw inputs = vLLM raw with
    the adapter's ``LoRARequest`` = vLLM on ``preprocess``'s tensors of the PNG with it (prefilled in
    steps of 32 tokens); each adapter's tokens differ from the base model's and from the other's."""
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt
    from mmserve.serving.preprocess import Preprocessor

    preprocessor = Preprocessor(tiny_models[FAMILY])
    family = get_family(FAMILY)
    image = references["image"]
    for case, images in (("text", []), ("image", [image])):
        text = references[(case, "text")]
        raw = {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}
        question = "What is it?" if images else "Tell a story."
        wire = preprocessor.decode_wire(preprocessor(question, [encode_image(i) for i in images]))
        processed = processed_prompt(family, wire["input_ids"], wire)
        assert not images or len(processed["prompt_token_ids"]) > 2 * CHUNK  # prefilled in several steps
        for name in (None, *served.by_name):
            want = references[(case, name)]
            lora = served.resolve(name)
            assert list(engine.generate_sync(raw, greedy(12), lora_request=lora).outputs[0].token_ids) == want, (
                case,
                name,
            )
            got = engine.generate_sync(processed, greedy(12), lora_request=lora).outputs[0].token_ids
            assert list(got) == want, f"{case}, {name}: vLLM on preprocess's tensors != HF + peft"
        answers = {tuple(references[(case, name)]) for name in (None, *served.by_name)}
        assert len(answers) == 3, f"{case}: an adapter answered as the base model (LoRA silently off?)"


@pytest.mark.engine
def test_adapters_and_the_base_model_in_flight_together(engine, served, references, tiny_models):
    """The same prompt and image under the base model and both adapters, twice each, in flight at once
    (the later ones prefill while the earlier decode; the prefix cache holds the first's blocks): each
    gets its own adapter's tokens; never another's cached KV blocks. The encoder's outputs in place of
    the image (encoder offload) give the adapter's answer too: the adapter leaves the tower alone."""
    from mmserve.encoder import Encoder, Towers
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt
    from mmserve.serving.preprocess import Preprocessor

    preprocessor = Preprocessor(tiny_models[FAMILY])
    family = get_family(FAMILY)
    wire = preprocessor("What is it?", [encode_image(references["image"])])
    decoded = preprocessor.decode_wire(wire)
    prompt = processed_prompt(family, decoded["input_ids"], decoded)
    names = [None, "lora_r8", "lora_r16"] * 2
    outputs = engine.submit(
        run_concurrently(
            engine, [prompt] * len(names), stagger_s=0.02, lora_requests=[served.resolve(n) for n in names]
        )
    ).result()
    assert outputs == [references[("image", name)] for name in names]

    encoded = preprocessor.decode_wire(Encoder(Towers(tiny_models[FAMILY]), cache_bytes=0).encoded(wire))
    assert "image_embeds" in encoded
    on_embeds = processed_prompt(family, encoded["input_ids"], encoded)
    for name in served.by_name:
        got = engine.generate_sync(on_embeds, greedy(12), lora_request=served.resolve(name)).outputs[0].token_ids
        assert list(got) == references[("image", name)], f"{name}: on the encoder's outputs"


def test_the_cpu_lora_ops_leave_base_model_rows_alone():
    """vLLM 0.32's PyTorch LoRA ops (the CPU platform's) gather the weights of index -1 (a token without
    an adapter) from the last adapter slot; the seam's ``skip_no_lora_rows`` leaves those rows as they
    were (the GPU kernels' early exit) and every other row as the stock op computes it."""
    import torch
    from vllm.lora.ops.torch_ops import lora_ops

    from mmserve import vllm_seam

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(5, 8, generator=generator)
    shrink_weights = torch.randn(2, 1, 4, 8, generator=generator)  # (slots, 1, rank, in)
    expand_weights = torch.randn(2, 1, 6, 4, generator=generator)  # (slots, 1, out, rank)
    indices = torch.tensor([0, -1, 1, -1, 1])
    stock_shrink = getattr(lora_ops.bgmv_shrink, "__wrapped__", lora_ops.bgmv_shrink)
    stock_expand = getattr(lora_ops.bgmv_expand, "__wrapped__", lora_ops.bgmv_expand)

    buffer = torch.zeros(5, 4)
    stock_shrink(inputs, shrink_weights, buffer, indices, 1.0)
    assert buffer[1].abs().sum() > 0  # the bug: a base-model row got the last slot's product
    fixed = torch.zeros(5, 4)
    vllm_seam.skip_no_lora_rows(stock_shrink)(inputs, shrink_weights, fixed, indices, 1.0)
    assert torch.equal(fixed[[1, 3]], torch.zeros(2, 4))
    assert torch.equal(fixed[[0, 2, 4]], buffer[[0, 2, 4]])

    output = torch.randn(5, 6, generator=generator)
    want = output.clone()
    stock_expand(fixed, expand_weights, want, indices, True)
    got = output.clone()
    vllm_seam.skip_no_lora_rows(stock_expand)(fixed, expand_weights, got, indices, True)
    assert torch.equal(got[[1, 3]], output[[1, 3]]) and torch.equal(got[[0, 2, 4]], want[[0, 2, 4]])
    # installed where vLLM's CPU punica wrapper looks the ops up (the plugin does it in every vLLM process)
    vllm_seam.fix_cpu_lora_ops()
    punica_cpu = importlib.import_module(vllm_seam.PUNICA_CPU)

    assert all(getattr(getattr(punica_cpu, n), "__mmserve_fix__", False) for n in ("bgmv_shrink", "bgmv_expand"))

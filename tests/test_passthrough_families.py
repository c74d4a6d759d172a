"""Qwen2.5-VL and Qwen2-Audio through the pass-through processor, and each family's counting rule
against its HF processor's own expansion."""

from __future__ import annotations

import pytest

from utils import ENGINE_ARGS, greedy, make_request, processed

FAMILY_CASES = {
    "qwen2_5_vl": {"text_only": [], "image_only": ["image"], "two_images": ["image", "image"]},
    "qwen2_audio": {"text_only": [], "audio_only": ["audio"], "two_audios": ["audio", "audio"]},
    "qwen2_5_omni": {"image_audio": ["image", "audio"], "interleaved": ["audio", "image", "audio"]},
}


@pytest.fixture(scope="module")
def references(tiny_models):
    from mmserve_dev.hf_reference import HFReference

    return {name: HFReference(name, tiny_models[name]) for name in FAMILY_CASES}


@pytest.mark.parametrize("family_name", list(FAMILY_CASES))
def test_counting_rule_matches_hf_expansion(references, family_name):
    """Each item's expected count (the family's rule on its tensors) equals the run the HF
    processor wrote into input_ids for it."""
    from mmserve.families import get_family
    from mmserve.inputs import processed_multi_modal_data
    from mmserve.passthrough.placeholders import placeholder_runs

    family, reference = get_family(family_name), references[family_name]
    vocab = reference.processor.tokenizer.get_vocab()
    hf_config = reference.model.config
    for parts in FAMILY_CASES[family_name].values():
        request = make_request(reference, "count", parts, seed=3)
        ids = request.hf_inputs["input_ids"][0].tolist()
        for modality, data in processed_multi_modal_data(family, request.hf_inputs).items():
            spec = family.modality(modality)
            assert spec is not None, modality
            from mmserve.passthrough.items import ProcessedItems

            items = ProcessedItems(data, spec, hf_config)
            runs = placeholder_runs(ids, vocab[spec.placeholder_token])
            assert [n for _, n in runs] == items.expected_tokens()
            assert len(items) == parts.count(modality)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_audio"])
def family_engine(request, tiny_models):
    from mmserve.engine import EngineRunner

    with EngineRunner(str(tiny_models[request.param]), **ENGINE_ARGS) as runner:
        yield request.param, runner


@pytest.mark.engine
def test_family_parity(family_engine, references, tiny_models):
    """HF transformers on the raw inputs = vLLM on them = vLLM on the processor's tensors = vLLM on
    the towers' outputs in their place (``mmserve.encoder``: the encoder offload's form)."""
    from mmserve.encoder import Encoder, Towers
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt

    family_name, engine = family_engine
    reference = references[family_name]
    encoder = Encoder(Towers(tiny_models[family_name]), cache_bytes=0)
    for case, parts in FAMILY_CASES[family_name].items():
        request = make_request(reference, case, parts, seed=5)
        expected = reference.generate(request.text, request.images, request.audios, max_new_tokens=12)
        raw = engine.generate_sync(request.raw_prompt(), greedy()).outputs[0].token_ids
        pre = engine.generate_sync(processed(family_name, request), greedy()).outputs[0].token_ids
        tensors = encoder.encoded(dict(request.hf_inputs))
        prompt = processed_prompt(get_family(family_name), tensors["input_ids"], tensors)
        encoded = engine.generate_sync(prompt, greedy()).outputs[0].token_ids
        assert list(raw) == expected, f"{family_name}/{case}: vLLM raw != HF"
        assert list(pre) == expected, f"{family_name}/{case}: vLLM processed != HF"
        assert list(encoded) == expected, f"{family_name}/{case}: vLLM on the encoders' outputs != HF"

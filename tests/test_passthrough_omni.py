"""Qwen2.5-Omni thinker through the pass-through processor on a real vLLM V1 engine (AsyncLLM).

Reference everywhere: HF transformers greedy generation on the raw inputs.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mmserve_dev.samples import AUDIO_SAMPLE_RATE

from utils import (
    ENGINE_ARGS,
    OMNI_CASES,
    greedy,
    make_request,
    processed,
    run_concurrently,
)

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def engine(tiny_models):
    from mmserve.engine import EngineRunner

    with EngineRunner(str(tiny_models["qwen2_5_omni"]), **ENGINE_ARGS) as runner:
        yield runner


def tokens(engine, prompt) -> list[int]:
    return list(engine.generate_sync(prompt, greedy()).outputs[0].token_ids)


@pytest.mark.parametrize("case", list(OMNI_CASES))
def test_parity_hf_raw_processed(engine, omni_workload, omni_encoder, case):
    request, reference = next((r, t) for r, t in omni_workload if r.name == f"{case}#0")
    assert len(reference) > 0
    assert tokens(engine, request.raw_prompt()) == reference, "vLLM on raw inputs != HF"
    assert tokens(engine, processed("qwen2_5_omni", request)) == reference, "vLLM on processed inputs != HF"
    assert tokens(engine, encoded(omni_encoder, request)) == reference, "vLLM on the encoders' outputs != HF"


def encoded(encoder, request) -> dict:
    """The request as ``mm_ensemble_encoded`` hands it to ``mm_llm``: the towers' outputs in place
    of the features (``mmserve.encoder.Encoder``)."""
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt

    tensors = encoder.encoded(dict(request.hf_inputs))
    return processed_prompt(get_family("qwen2_5_omni"), tensors["input_ids"], tensors)


def test_features_and_embeddings_batch_together(engine, omni_workload, omni_encoder):
    """The workload with every other request as the encoders' outputs, the rest as features, in
    flight together (vLLM batches the two forms of a modality apart): each = its HF reference."""
    prompts = [
        encoded(omni_encoder, r) if i % 2 else processed("qwen2_5_omni", r) for i, (r, _) in enumerate(omni_workload)
    ]
    outputs = engine.submit(run_concurrently(engine, prompts, stagger_s=0.02)).result()
    assert [r.name for (r, ref), out in zip(omni_workload, outputs, strict=True) if out != ref] == []


def test_bad_embeddings_are_named(engine, omni_workload, omni_encoder):
    """The encoded form is validated like the features, before the engine; the engine serves on."""
    request, reference = next((r, t) for r, t in omni_workload if r.name == "image_audio#0")
    good = encoded(omni_encoder, request)
    image, audio = good["multi_modal_data"]["image"], good["multi_modal_data"]["audio"]
    rows, hidden = image["image_embeds"].shape
    nan = image["image_embeds"].copy()
    nan[0, 0] = float("nan")
    cases = {
        "rows": (
            _with(good, "image", image_embeds=image["image_embeds"][:-1]),
            rf"image, image_embeds: expected {rows} rows \(one per placeholder token: .*\), found {rows - 1} rows",
        ),
        "width": (
            _with(good, "image", image_embeds=image["image_embeds"][:, :-1]),
            rf"image, image_embeds: expected {hidden} values per row \(the language model's hidden size\)",
        ),
        "nan": (
            _with(good, "image", image_embeds=nan),
            r"image, image_embeds: expected finite values, found 1 NaN/Inf",
        ),
        "both forms": (
            _with(good, "image", pixel_values=request.hf_inputs["pixel_values"]),
            r"image: expected only the fields .* unexpected field\(s\) \['pixel_values'\]",
        ),
        "lengths": (
            _with(good, "audio", audio_feature_lengths=None),
            r"audio: expected the fields .* \(missing \['audio_feature_lengths'\]\)",
        ),
        "audio rows": (
            _with(good, "audio", audio_feature_lengths=audio["audio_feature_lengths"] + 8),
            r"audio, audio_embeds: expected \d+ rows .* found \d+ rows",
        ),
    }
    for prompt, message in cases.values():
        with pytest.raises(Exception, match=message):
            tokens(engine, prompt)
    assert tokens(engine, good) == reference


def test_prompt_is_not_expanded_again(engine, omni_workload):
    request, _ = next((r, t) for r, t in omni_workload if r.name == "image_audio#0")
    prompt = processed("qwen2_5_omni", request)
    output = engine.generate_sync(prompt, greedy(1))
    assert list(output.prompt_token_ids) == prompt["prompt_token_ids"]


def test_concurrent_mixed_modalities_staggered(engine, omni_workload):
    # Alternate processed and raw inputs: one deployment serves both, in the same batches.
    prompts = [processed("qwen2_5_omni", r) if i % 2 == 0 else r.raw_prompt() for i, (r, _) in enumerate(omni_workload)]
    outputs = engine.submit(run_concurrently(engine, prompts, stagger_s=0.03)).result()
    mismatches = [r.name for (r, ref), out in zip(omni_workload, outputs, strict=True) if out != ref]
    assert len(outputs) >= 16
    assert not mismatches, f"differ from their single-request reference: {mismatches}"


def test_same_ids_different_images_do_not_share_cache(engine, omni_reference):
    a = make_request(omni_reference, "a", ["image"], seed=7)
    b = make_request(omni_reference, "b", ["image"], seed=8)
    assert a.hf_inputs["input_ids"].tolist() == b.hf_inputs["input_ids"].tolist()
    assert not torch.equal(a.hf_inputs["pixel_values"], b.hf_inputs["pixel_values"])
    ref_a = omni_reference.generate(a.text, a.images, a.audios, max_new_tokens=12)
    ref_b = omni_reference.generate(b.text, b.images, b.audios, max_new_tokens=12)
    assert ref_a != ref_b, "test images must lead to different outputs"
    # Sequential (a's prefix blocks are cached when b arrives), then concurrent.
    assert tokens(engine, processed("qwen2_5_omni", a)) == ref_a
    assert tokens(engine, processed("qwen2_5_omni", b)) == ref_b
    both = engine.submit(
        run_concurrently(engine, [processed("qwen2_5_omni", a), processed("qwen2_5_omni", b)], stagger_s=0)
    ).result()
    assert both == [ref_a, ref_b]


def _with(prompt, modality, **changes):
    bad = copy.deepcopy(prompt)
    fields = bad["multi_modal_data"][modality]
    for name, value in changes.items():
        if value is None:
            fields.pop(name)
        else:
            fields[name] = value
    return bad


def _error_cases(prompt, image_token_id):
    image, audio = prompt["multi_modal_data"]["image"], prompt["multi_modal_data"]["audio"]
    ids = prompt["prompt_token_ids"]
    first = ids.index(image_token_id)
    short_ids = copy.deepcopy(prompt)
    short_ids["prompt_token_ids"] = ids[:first] + ids[first + 1 :]
    mixed = copy.deepcopy(prompt)
    mixed["multi_modal_data"]["audio"] = [(torch.zeros(AUDIO_SAMPLE_RATE).numpy(), AUDIO_SAMPLE_RATE)]
    return {
        "missing field": (
            _with(prompt, "audio", feature_attention_mask=None),
            r"audio: expected the fields .* \(missing \['feature_attention_mask'\]\)",
        ),
        "unknown field": (
            _with(prompt, "image", pixel_values_videos=image["pixel_values"]),
            r"image: expected only the fields .* unexpected field\(s\) \['pixel_values_videos'\]",
        ),
        "wrong dtype": (
            _with(prompt, "image", pixel_values=image["pixel_values"].to(torch.uint8)),
            r"image, pixel_values: expected a floating-point tensor .* found dtype torch.uint8",
        ),
        "wrong rank": (
            _with(prompt, "image", image_grid_thw=image["image_grid_thw"][0]),
            r"image, image_grid_thw: expected rank 2 .* found rank 1 with shape \(3,\)",
        ),
        "pixel rows": (
            _with(prompt, "image", pixel_values=image["pixel_values"][:-4]),
            r"image, pixel_values: expected \d+ patches .* found \d+ rows",
        ),
        "mel bins": (
            _with(prompt, "audio", input_features=audio["input_features"][:, :64]),
            r"audio, input_features: expected 128 mel bins",
        ),
        "placeholder count": (
            short_ids,
            r"image item 0, prompt_token_ids: expected \d+ <\|IMAGE\|> tokens "
            r"\(image_grid_thw=\[.*\]\), found a run of \d+ at offset \d+",
        ),
        "mixed raw and processed": (mixed, r"expected all modalities of a request already processed, or all raw"),
    }


ERROR_CASES = [
    "missing field",
    "unknown field",
    "wrong dtype",
    "wrong rank",
    "pixel rows",
    "mel bins",
    "placeholder count",
    "mixed raw and processed",
]


@pytest.mark.parametrize("case", ERROR_CASES)
def test_bad_input_fails_alone_and_engine_keeps_serving(engine, omni_workload, omni_reference, case):
    request, reference = next((r, t) for r, t in omni_workload if r.name == "image_audio#1")
    prompt = processed("qwen2_5_omni", request)
    image_token_id = omni_reference.processor.tokenizer.convert_tokens_to_ids("<|IMAGE|>")
    bad, message = _error_cases(prompt, image_token_id)[case]
    with pytest.raises(ValueError, match=message):
        tokens(engine, bad)
    assert not engine.engine.errored
    assert tokens(engine, prompt) == reference

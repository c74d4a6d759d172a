"""InternVL (transformers' format) through the pass-through: the first family whose placeholders are
not Qwen's. Its count rule (tiles x image_seq_length) against the HF processor's expansion over many
image sizes, ``preprocess`` = the HF processor (the tiles per image read from its runs), bad inputs
named, and greedy tokens of HF transformers = vLLM on the raw images = vLLM on ``preprocess``'s
tensors, under chunked prefill, prefix caching and concurrency."""

from __future__ import annotations

import numpy as np
import pytest

from mmserve_dev.samples import encode_image, sample_image

from utils import ENGINE_ARGS, greedy, run_concurrently

FAMILY = "internvl"
CHUNK = 128


@pytest.fixture(scope="module")
def reference(tiny_models):
    from mmserve_dev.hf_reference import HFReference

    return HFReference(FAMILY, tiny_models[FAMILY])


@pytest.fixture(scope="module")
def preprocessor(tiny_models):
    from mmserve.serving.preprocess import Preprocessor

    return Preprocessor(tiny_models[FAMILY])


def hf_inputs(reference, images: list, question: str = "What is it?"):
    from mmserve_dev.hf_reference import chat_prompt

    text = chat_prompt(FAMILY, reference.processor, [*(["image"] * len(images)), f"text:{question}"])
    return text, reference.processor(text=[text], images=images or None, return_tensors="pt")


def items_of(reference, wire: dict):
    from mmserve.families import get_family
    from mmserve.inputs import processed_multi_modal_data
    from mmserve.passthrough.items import ProcessedItems

    family = get_family(FAMILY)
    spec = family.modality("image")
    assert spec is not None
    return spec, ProcessedItems(processed_multi_modal_data(family, wire)["image"], spec, reference.model.config)


def test_preprocess_is_the_hf_processor_and_the_count_rule_its_expansion(preprocessor, reference):
    """For images of 16 sizes (1 to 12 tiles beside the thumbnail, extreme aspect ratios), alone and
    together: ``preprocess``'s ids are the HF processor's, its tiles the processor's (as rows), its
    ``image_num_patches`` each image's tiles, and every image's run of ``<IMG_CONTEXT>`` is its count
    rule (tiles x image_seq_length) on those tensors."""
    from mmserve.passthrough.placeholders import placeholder_runs

    config = reference.model.config
    sizes = [(32, 32), (64, 48), (224, 224), (300, 200), (448, 224), (224, 448), (500, 120), (120, 500)]
    sizes += [(672, 448), (1000, 1000), (97, 333), (1344, 224), (40, 900), (2000, 100), (333, 334), (700, 300)]
    tiles_seen = set()
    for start in range(0, len(sizes), 4):
        images = [sample_image(start + i, size=size) for i, size in enumerate(sizes[start : start + 4])]
        wire = preprocessor("What is it?", [encode_image(image) for image in images])
        _, hf = hf_inputs(reference, images)
        np.testing.assert_array_equal(wire["input_ids"], hf["input_ids"][0].numpy())
        np.testing.assert_array_equal(
            wire["pixel_values"], hf["pixel_values"].numpy().reshape(wire["pixel_values"].shape)
        )
        spec, items = items_of(reference, wire)
        runs = [n for _, n in placeholder_runs(wire["input_ids"].tolist(), config.image_token_id)]
        assert runs == items.expected_tokens() == [n * 256 for n in wire["image_num_patches"].tolist()]
        tiles_seen |= set(wire["image_num_patches"].tolist())
    assert tiles_seen >= {1, 3, 7, 13}  # a lone thumbnail, and tiles up to max_patches (12) + 1


def test_bad_tiles_are_named(preprocessor, reference):
    """Tiles that disagree with image_num_patches, a tile of another size, a count of 0 or past the
    context, a pixel of 1e30, an image's run split in two or one tile short: each refused with the
    field, the item and what was expected."""
    import torch

    from mmserve.errors import ProcessedInputError

    config, tokenizer = reference.model.config, reference.tokenizer
    wire = preprocessor(
        "What is it?", [encode_image(sample_image(1, size=(300, 200))), encode_image(sample_image(2, size=(64, 64)))]
    )
    spec, items = items_of(reference, wire)
    assert wire["image_num_patches"].tolist() == [7, 1]

    def refused(change: dict, match: str) -> None:
        with pytest.raises(ProcessedInputError, match=match):
            items_of(reference, {**wire, **change})

    refused(
        {"image_num_patches": np.array([6, 1])},
        r"image, pixel_values: expected 7 tiles \(sum of image_num_patches\), found 8 rows",
    )
    refused({"pixel_values": wire["pixel_values"][:, :-3]}, r"expected 602112 values per tile \(3x448x448")
    refused(
        {"image_num_patches": np.array([8, 0])}, r"image item 1, image_num_patches: expected between 1 and 128 tiles"
    )
    refused(
        {"image_num_patches": np.array([2**40, 1])},
        r"image item 0, image_num_patches: expected between 1 and 128 tiles",
    )
    loud = wire["pixel_values"].copy()
    loud[3, 5] = 1e30
    refused({"pixel_values": loud}, r"image, pixel_values: expected normalized pixel values within \[-64, 64\]")
    ids = wire["input_ids"].tolist()
    at = ids.index(config.image_token_id) + 256
    split = ids[:at] + tokenizer.encode("</img><img>", add_special_tokens=False) + ids[at:]
    with pytest.raises(
        ProcessedInputError, match=r"expected 2 run\(s\) of <IMG_CONTEXT> \(one per item\), found 3 run"
    ):
        spec.locate(split, items, token_id=config.image_token_id, hf_config=config, tokenizer=tokenizer)
    short = ids[:at] + ids[at + 256 :]
    with pytest.raises(
        ProcessedInputError,
        match=r"image item 0, prompt_token_ids: expected 1792 <IMG_CONTEXT> tokens \(image_num_patches=7\), found a run of 1536",
    ):
        spec.locate(short, items, token_id=config.image_token_id, hf_config=config, tokenizer=tokenizer)
    assert isinstance(items.get(0)["pixel_values"], torch.Tensor) and tuple(items.get(0)["pixel_values"].shape) == (
        7,
        3,
        448,
        448,
    )


@pytest.fixture(scope="module")
def engine(tiny_models):
    from mmserve.engine import EngineRunner

    args = {
        **ENGINE_ARGS,
        "max_model_len": 4096,  # an image takes up to 13 tiles of 256 placeholders
        "limit_mm_per_prompt": {"image": 3},
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": CHUNK,
        "enable_prefix_caching": True,
    }
    with EngineRunner(str(tiny_models[FAMILY]), **args) as runner:
        yield runner


CASES = {
    "text": [],
    "thumbnail_only": [(64, 64)],
    "tiled": [(448, 224)],
    "two_images": [(200, 100), (96, 96)],
    "three_images": [(224, 224), (100, 300), (32, 32)],
}


@pytest.mark.engine
def test_parity_with_hf(engine, reference, preprocessor):
    """HF transformers on the raw images = vLLM on them (its own processor) = vLLM on ``preprocess``'s
    tensors of the image files, per case; then every pass-through prompt at once (prefix cache hits,
    prefill in steps beside decodes)."""
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt

    family = get_family(FAMILY)
    expected, prompts = {}, {}
    for name, sizes in CASES.items():
        images = [sample_image(70 + i, size=size) for i, size in enumerate(sizes)]
        text, hf = hf_inputs(reference, images)
        expected[name] = reference.generate(text, images=images, max_new_tokens=12)
        raw = {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}
        result = engine.generate_sync(raw, greedy(12))
        assert list(result.prompt_token_ids) == hf["input_ids"][0].tolist(), name
        assert list(result.outputs[0].token_ids) == expected[name], f"{name}: vLLM raw != HF"
        wire = preprocessor("What is it?", [encode_image(image) for image in images])
        prompts[name] = processed_prompt(family, wire["input_ids"], wire)
        got = engine.generate_sync(prompts[name], greedy(12)).outputs[0].token_ids
        assert list(got) == expected[name], f"{name}: vLLM on preprocess's tensors != HF"
    names = list(prompts)
    outputs = engine.submit(run_concurrently(engine, [prompts[n] for n in names], stagger_s=0.05)).result()
    assert dict(zip(names, outputs, strict=True)) == expected


@pytest.mark.engine
def test_refused_tiles_leave_the_engine_serving(engine, reference, preprocessor):
    """Tiles that disagree with their count, and a run one tile short, are refused before the engine
    core; the next request answers as before."""
    from mmserve.errors import ProcessedInputError
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt

    family = get_family(FAMILY)
    image = sample_image(81, size=(300, 200))
    wire = preprocessor("What is it?", [encode_image(image)])
    prompt = processed_prompt(family, wire["input_ids"], wire)
    expected = list(engine.generate_sync(prompt, greedy(12)).outputs[0].token_ids)
    with pytest.raises(ProcessedInputError, match="sum of image_num_patches"):
        engine.generate_sync(
            processed_prompt(family, wire["input_ids"], {**wire, "image_num_patches": np.array([6])}), greedy(12)
        )
    ids = wire["input_ids"].tolist()
    at = ids.index(reference.model.config.image_token_id)
    with pytest.raises(ProcessedInputError, match=r"expected 1792 <IMG_CONTEXT> tokens"):
        engine.generate_sync({**prompt, "prompt_token_ids": ids[:at] + ids[at + 256 :]}, greedy(12))
    assert list(engine.generate_sync(prompt, greedy(12)).outputs[0].token_ids) == expected


@pytest.mark.engine
def test_the_encoders_outputs_give_hfs_tokens(engine, reference, preprocessor, tiny_models):
    """Encoder offload: the tower, pixel shuffle and projector loaded alone (``mmserve.encoder``) give
    ``image_embeds`` in place of the tiles; vLLM on them = HF for two images of different tile counts
    in one prompt, alone and beside the tiles' prompt at once; embeddings one tile short are refused
    by the count rule and the engine serves on."""
    from mmserve.encoder import Encoder, Towers
    from mmserve.errors import ProcessedInputError
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt

    family = get_family(FAMILY)
    images = [sample_image(90, size=(448, 224)), sample_image(91, size=(64, 64))]
    text, _ = hf_inputs(reference, images)
    expected = reference.generate(text, images=images, max_new_tokens=12)
    wire = preprocessor("What is it?", [encode_image(image) for image in images])
    assert len(set(wire["image_num_patches"].tolist())) == 2
    encoded = Encoder(Towers(tiny_models[FAMILY]), cache_bytes=0).encoded(wire)
    assert "pixel_values" not in encoded and encoded["image_num_patches"].tolist() == wire["image_num_patches"].tolist()
    prompt = processed_prompt(family, encoded["input_ids"], encoded)
    assert list(engine.generate_sync(prompt, greedy(12)).outputs[0].token_ids) == expected
    tiles = processed_prompt(family, wire["input_ids"], wire)
    assert engine.submit(run_concurrently(engine, [prompt, tiles], stagger_s=0.0)).result() == [expected, expected]

    per_tile = reference.model.config.image_seq_length
    short = {**encoded, "image_embeds": encoded["image_embeds"][:-per_tile]}
    with pytest.raises(
        ProcessedInputError, match=rf"image, image_embeds: expected \d+ rows .*image_seq_length {per_tile}"
    ):
        engine.generate_sync(processed_prompt(family, short["input_ids"], short), greedy(12))
    assert list(engine.generate_sync(prompt, greedy(12)).outputs[0].token_ids) == expected

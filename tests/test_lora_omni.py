"""LoRA adapters on the default model's family, the Qwen2.5-Omni thinker: two tiny ``peft`` adapters
(ranks 8 and 16) written as an adapter of the whole Omni model names its modules (``thinker.model...``,
which vLLM maps as it maps the checkpoint); HF transformers + peft (the thinker with the same weights)
= vLLM on ``preprocess``'s tensors of the files with the adapter's ``LoRARequest``, for text, an image
and an audio clip, each adapter's answer its own; the base model and both adapters in flight at once
on one clip, prefilled in steps."""

from __future__ import annotations

from typing import Any

import pytest

from mmserve_dev.samples import decode_audio, encode_audio, encode_image, sample_audio, sample_image

from utils import greedy, lora_engine, run_concurrently, served_adapters

pytestmark = pytest.mark.engine

FAMILY = "qwen2_5_omni"
CHUNK = 32
CASES: dict[str, tuple[list[str], int, int]] = {
    "text": ([], 0, 0),
    "image": (["image"], 1, 0),
    "audio": (["audio"], 0, 1),
}
"""Case -> (its media parts, images, clips)."""


@pytest.fixture(scope="module")
def adapters(tiny_models):
    from mmserve_dev.tiny_adapters import build_all_adapters

    return build_all_adapters(families=(FAMILY,), checkpoints=tiny_models)[FAMILY]


@pytest.fixture(scope="module")
def served(tmp_path_factory, adapters):
    return served_adapters(tmp_path_factory.mktemp("mm_llm"), adapters)


@pytest.fixture(scope="module")
def media():
    return {
        "image": encode_image(sample_image(51, size=(140, 112))),
        "audio": encode_audio(sample_audio(52, seconds=2.0)),
    }


@pytest.fixture(scope="module")
def expected(tiny_models, adapters, media):
    """HF transformers' thinker (+ peft) greedy tokens per (case, adapter)."""
    import io

    from PIL import Image

    from mmserve_dev.hf_reference import HFReference, chat_prompt
    from mmserve_dev.tiny_adapters import with_adapter

    image, clip = Image.open(io.BytesIO(media["image"])).convert("RGB"), decode_audio(media["audio"])
    tokens: dict[tuple[str, str | None], list[int]] = {}
    for name in (None, *adapters):
        reference = HFReference(FAMILY, tiny_models[FAMILY])
        if name is not None:
            reference.model = with_adapter(FAMILY, reference.model, adapters[name])
        for case, (parts, images, clips) in CASES.items():
            text = chat_prompt(FAMILY, reference.processor, [*parts, "text:What is it?"])
            tokens[(case, name)] = reference.generate(
                text, images=[image] * images or None, audios=[clip] * clips or None, max_new_tokens=12
            )
    return tokens


@pytest.fixture(scope="module")
def engine(tiny_models, served):
    with lora_engine(tiny_models[FAMILY], served, CHUNK) as runner:
        yield runner


def prompts(tiny_models, media) -> dict[str, dict[str, Any]]:
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt
    from mmserve.serving.preprocess import Preprocessor

    preprocessor = Preprocessor(tiny_models[FAMILY])
    out = {}
    for case, (_, images, clips) in CASES.items():
        wire = preprocessor("What is it?", [media["image"]] * images, [media["audio"]] * clips)
        tensors = preprocessor.decode_wire(wire)
        out[case] = processed_prompt(get_family(FAMILY), tensors["input_ids"], tensors)
    return out


def test_an_adapter_of_the_whole_omni_model_answers_as_hf_and_peft(engine, served, expected, tiny_models, media):
    """Per case (text, image, audio) and adapter (and the base model): vLLM on ``preprocess``'s
    tensors with the adapter = HF's thinker + peft; the three answers of a case all differ; then the
    base model and both adapters twice each on the audio clip, in flight at once."""
    cases = prompts(tiny_models, media)
    for case, prompt in cases.items():
        for name in (None, *served.by_name):
            got = engine.generate_sync(prompt, greedy(12), lora_request=served.resolve(name)).outputs[0].token_ids
            assert list(got) == expected[(case, name)], f"{case}, {name}: vLLM != HF + peft"
        assert len({tuple(expected[(case, name)]) for name in (None, *served.by_name)}) == 3, case
    names = [None, "lora_r8", "lora_r16"] * 2
    lora = [served.resolve(name) for name in names]
    outputs = engine.submit(
        run_concurrently(engine, [cases["audio"]] * len(names), stagger_s=0.02, lora_requests=lora)
    ).result()
    assert outputs == [expected[("audio", name)] for name in names]

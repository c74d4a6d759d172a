"""Audio Flamingo 3 (transformers' format) through the pass-through: a family with audio outside Qwen,
whose clips are cut into 30-s windows. Its count rule against the HF processor's expansion over clip
lengths around the window's edges, ``preprocess`` = the HF processor (the windows per clip its own
cut), bad inputs named, and greedy tokens of HF transformers = vLLM on the raw clip = vLLM on
``preprocess``'s tensors, under chunked prefill, prefix caching and concurrency."""

from __future__ import annotations

import io

import numpy as np
import pytest

from mmserve_dev.samples import AUDIO_SAMPLE_RATE, encode_audio, sample_audio

from utils import ENGINE_ARGS, greedy, run_concurrently

FAMILY = "audioflamingo3"
CHUNK = 256


@pytest.fixture(scope="module")
def reference(tiny_models):
    from mmserve_dev.hf_reference import HFReference

    return HFReference(FAMILY, tiny_models[FAMILY])


@pytest.fixture(scope="module")
def preprocessor(tiny_models):
    from mmserve.serving.preprocess import Preprocessor

    return Preprocessor(tiny_models[FAMILY])


def wav_and_samples(seed: int, seconds: float) -> tuple[bytes, np.ndarray]:
    """A clip as a WAV file, and the samples a decoder gets back from it (what HF is given)."""
    import soundfile

    wav = encode_audio(sample_audio(seed, seconds=seconds))
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    assert rate == AUDIO_SAMPLE_RATE
    return wav, samples


def hf_inputs(reference, clip: np.ndarray):
    from mmserve_dev.hf_reference import chat_prompt

    text = chat_prompt(FAMILY, reference.processor, ["audio", "text:What is it?"])
    return text, reference.processor(text=[text], audio=[clip], sampling_rate=AUDIO_SAMPLE_RATE)


def items_of(reference, wire: dict):
    from mmserve.families import get_family
    from mmserve.inputs import processed_multi_modal_data
    from mmserve.passthrough.items import ProcessedItems

    family = get_family(FAMILY)
    spec = family.modality("audio")
    assert spec is not None
    return spec, ProcessedItems(processed_multi_modal_data(family, wire)["audio"], spec, reference.model.config)


@pytest.mark.parametrize("seconds", [0.5, 2.5, 29.99, 30.0, 30.01, 45.0, 61.0, 90.0])
def test_preprocess_is_the_hf_processor_and_the_count_rule_its_expansion(preprocessor, reference, seconds):
    """A WAV file through ``preprocess`` = the HF processor on its samples: ids, every window's
    features and mask; the windows per clip its cut (30.01 s: a window of one frame more, which the
    run does not count); and the clip's run of ``<sound>`` = the count rule on those tensors."""
    from mmserve.passthrough.placeholders import placeholder_runs

    wav, samples = wav_and_samples(3, seconds)
    limited = preprocessor.with_settings(limits=_limits(preprocessor, seconds))
    wire = limited("What is it?", audios=[wav])
    _, hf = hf_inputs(reference, samples)
    np.testing.assert_array_equal(wire["input_ids"], hf["input_ids"][0].numpy())
    np.testing.assert_array_equal(wire["input_features"], hf["input_features"].numpy())
    np.testing.assert_array_equal(wire["feature_attention_mask"], hf["input_features_mask"].numpy())
    assert wire["chunk_counts"].tolist() == [hf["input_features"].shape[0]] == [max(1, int(np.ceil(seconds / 30)))]
    _, items = items_of(reference, wire)
    runs = [n for _, n in placeholder_runs(wire["input_ids"].tolist(), reference.model.config.audio_token_id)]
    assert runs == items.expected_tokens()


def _limits(preprocessor, seconds: float):
    import dataclasses

    return dataclasses.replace(preprocessor.limits, max_total_audio_seconds=max(seconds, 60.0))


def test_bad_windows_are_named(preprocessor, reference):
    """Windows per clip that disagree with the features, a window cut short before a clip's last, a
    mask with a hole, a window with no valid frame, log-mel values of 1e25: each refused by name."""
    from mmserve.errors import ProcessedInputError

    wav, _ = wav_and_samples(5, 45.0)
    wire = preprocessor("What is it?", audios=[wav])
    assert wire["chunk_counts"].tolist() == [2]
    items_of(reference, wire)

    def refused(change: dict, match: str) -> None:
        with pytest.raises(ProcessedInputError, match=match):
            items_of(reference, {**wire, **change})

    refused(
        {"chunk_counts": np.array([3])},
        r"audio, chunk_counts: expected positive counts of windows summing to the 2 windows",
    )
    short = wire["feature_attention_mask"].copy()
    short[0, 2000:] = 0
    refused(
        {"feature_attention_mask": short},
        r"audio item 0, feature_attention_mask: expected 3000 valid frames in every window of a clip but its last",
    )
    holed = wire["feature_attention_mask"].copy()
    holed[1, 10] = 0
    refused({"feature_attention_mask": holed}, "ones after a zero")
    empty = wire["feature_attention_mask"].copy()
    empty[1, :] = 0
    refused({"feature_attention_mask": empty}, r"each window's valid frames a prefix of at least one \(window 1\)")
    loud = wire["input_features"].copy()
    loud[0, 0, 0] = 1e25
    refused({"input_features": loud}, r"audio, input_features: expected log-mel values within \[-64, 64\]")
    refused({"input_features": wire["input_features"][..., :1500]}, r"expected \(windows, 128, 3000\)")


@pytest.fixture(scope="module")
def engine(tiny_models):
    from mmserve.engine import EngineRunner

    args = {
        **ENGINE_ARGS,
        "limit_mm_per_prompt": {"audio": 1},  # vLLM's Audio Flamingo 3 takes one clip per prompt
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": CHUNK,
        "enable_prefix_caching": True,
    }
    with EngineRunner(str(tiny_models[FAMILY]), **args) as runner:
        yield runner


CASES = {"short": 3.0, "one_window": 29.5, "a_frame_over": 30.01, "two_windows": 45.0}


@pytest.mark.engine
def test_parity_with_hf(engine, reference, preprocessor):
    """HF transformers on the samples = vLLM on them (its own processor) = vLLM on ``preprocess``'s
    tensors of the WAV file, per clip length (the prompt prefilled in steps of CHUNK tokens); then
    every pass-through prompt at once (prefix cache hits, prefill beside decodes)."""
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt

    family = get_family(FAMILY)
    expected, prompts = {}, {}
    for index, (name, seconds) in enumerate(CASES.items()):
        wav, samples = wav_and_samples(90 + index, seconds)
        text, hf = hf_inputs(reference, samples)
        expected[name] = reference.generate(text, audios=[samples], max_new_tokens=12)
        raw = {"prompt": text, "multi_modal_data": {"audio": [(samples, AUDIO_SAMPLE_RATE)]}}
        result = engine.generate_sync(raw, greedy(12))
        assert list(result.prompt_token_ids) == hf["input_ids"][0].tolist(), name
        assert list(result.outputs[0].token_ids) == expected[name], f"{name}: vLLM raw != HF"
        wire = preprocessor("What is it?", audios=[wav])
        prompts[name] = processed_prompt(family, wire["input_ids"], wire)
        got = engine.generate_sync(prompts[name], greedy(12)).outputs[0].token_ids
        assert list(got) == expected[name], f"{name}: vLLM on preprocess's tensors != HF"
    names = list(prompts)
    outputs = engine.submit(run_concurrently(engine, [prompts[n] for n in names], stagger_s=0.05)).result()
    assert dict(zip(names, outputs, strict=True)) == expected


@pytest.mark.engine
def test_refused_windows_leave_the_engine_serving(engine, preprocessor):
    """A window cut short before the clip's last, and windows per clip that disagree with the
    features, are refused before the engine core; the next request answers as before."""
    from mmserve.errors import ProcessedInputError
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt

    family = get_family(FAMILY)
    wav, _ = wav_and_samples(97, 45.0)
    wire = preprocessor("What is it?", audios=[wav])
    prompt = processed_prompt(family, wire["input_ids"], wire)
    expected = list(engine.generate_sync(prompt, greedy(12)).outputs[0].token_ids)
    short = wire["feature_attention_mask"].copy()
    short[0, 2000:] = 0
    with pytest.raises(ProcessedInputError, match="every window of a clip but its last"):
        engine.generate_sync(
            processed_prompt(family, wire["input_ids"], {**wire, "feature_attention_mask": short}), greedy(12)
        )
    with pytest.raises(ProcessedInputError, match="chunk_counts"):
        engine.generate_sync(
            processed_prompt(family, wire["input_ids"], {**wire, "chunk_counts": np.array([1])}), greedy(12)
        )
    assert list(engine.generate_sync(prompt, greedy(12)).outputs[0].token_ids) == expected


@pytest.mark.engine
def test_the_encoders_outputs_give_hfs_tokens(engine, reference, preprocessor, tiny_models):
    """Encoder offload: the tower and projector loaded alone (``mmserve.encoder``) give ``audio_embeds``
    (each window's valid rows, a clip's one after the other) and each clip's valid frames in place of
    the windows; vLLM on them = HF for a clip of two windows and a short one, alone and beside the
    windows' prompts at once; embeddings one row short are refused by the count rule and the engine
    serves on. Its processor takes one clip per prompt: two are refused by name before it runs."""
    from mmserve.encoder import Encoder, Towers
    from mmserve.errors import ProcessedInputError
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt
    from mmserve.serving.preprocess import PreprocessError

    family = get_family(FAMILY)
    encoder = Encoder(Towers(tiny_models[FAMILY]), cache_bytes=0)
    prompts, windows, expected = [], [], []
    for seed, seconds in ((100, 45.0), (101, 3.0)):
        wav, samples = wav_and_samples(seed, seconds)
        text, _ = hf_inputs(reference, samples)
        expected.append(reference.generate(text, audios=[samples], max_new_tokens=12))
        wire = preprocessor("What is it?", audios=[wav])
        encoded = encoder.encoded(wire)
        assert not {"input_features", "feature_attention_mask", "chunk_counts"} & set(encoded)
        assert encoded["audio_feature_lengths"].tolist() == [int(wire["feature_attention_mask"].sum())]
        prompts.append(processed_prompt(family, encoded["input_ids"], encoded))
        windows.append(processed_prompt(family, wire["input_ids"], wire))
    alone = [list(engine.generate_sync(prompt, greedy(12)).outputs[0].token_ids) for prompt in prompts]
    assert alone == expected, "vLLM on the tower's outputs != HF"
    both = engine.submit(run_concurrently(engine, [*prompts, *windows], stagger_s=0.0)).result()
    assert both == [*expected, *expected]

    data = prompts[0]["multi_modal_data"]["audio"]
    short = {**data, "audio_embeds": data["audio_embeds"][:-1]}
    bad = {**prompts[0], "multi_modal_data": {"audio": short}}
    with pytest.raises(ProcessedInputError, match=r"audio, audio_embeds: expected \d+ rows .*output_length"):
        engine.generate_sync(bad, greedy(12))
    assert list(engine.generate_sync(prompts[0], greedy(12)).outputs[0].token_ids) == expected[0]
    with pytest.raises(PreprocessError, match="audio: 2 items; the audioflamingo3 model's processor takes at most 1"):
        preprocessor("What is it?", audios=[wav, wav])

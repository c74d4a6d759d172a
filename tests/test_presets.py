"""Presets for real checkpoints (``deploy/presets/<name>/model.json``): everything but the weights, on
the CPU, no engine.

Each preset runs against a tiny checkpoint of its family that carries the real checkpoint's processor
configuration: the tiny directory (config, weights, tokenizer, chat template) with the hub's
``preprocessor_config.json`` in place of its own processor files. On it:

* every key is an ``AsyncEngineArgs`` field and its value has that field's type (pydantic, strict),
  and vLLM builds its whole configuration (``create_engine_config``: the model's pass-through
  architecture through the plugin, parallel layout, scheduler, cache) from the preset;
* the preset fits the real checkpoint (``REAL``: context length, attention heads against the tensor
  parallel size) and ``preprocess`` (its config.pbtxt limits against ``limit_mm_per_prompt``,
  ``max_prompt_tokens`` against ``max_model_len``);
* ``preprocess`` loads the real processor settings from the checkpoint (min/max pixels, the audio
  window), its largest accepted image and clip fit the engine (``max_model_len``) and what vLLM's
  pass-through processor profiles (its dummy items), and the family's counting rule holds on them.

Found this way: with the real Omni processor (a 300-s audio window) preprocess accepted clips the Omni
family's pass-through rule refuses (over 30 s); preprocess now bounds clips by the family's encoder
(``ModalitySpec.max_item_seconds``) as well as by the feature extractor's window.
"""

from __future__ import annotations

import dataclasses
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from utils import ROOT

PRESETS_DIR = ROOT / "deploy" / "presets"
PRESETS = sorted(p.parent.name for p in PRESETS_DIR.glob("*/model.json"))
PARALLEL_KEYS = ("tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend")
# Keys a preset must not set: mmserve sets hf_overrides (the pass-through architecture); preprocess
# does not read mm_processor_kwargs, so vLLM would profile other image/audio sizes than preprocess sends.
FORBIDDEN_KEYS = ("hf_overrides", "mm_processor_kwargs", "trust_remote_code")

_VISION_PROCESSOR = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
}
_QWEN3_VISION = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
}
_WHISPER = {
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128,
    "hop_length": 160,
    "n_fft": 400,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "sampling_rate": 16000,
}


@dataclass(frozen=True)
class RealCheckpoint:
    """What a hub checkpoint carries besides its weights (its config.json and preprocessor_config.json)."""

    family: str  # mmserve family (and tiny checkpoint)
    architectures: tuple[str, ...]
    max_position_embeddings: int  # the language model's
    heads: dict[str, int]  # attention heads of each part that tensor parallelism splits
    kv_heads: int
    preprocessor_config: dict[str, Any]  # the hub's preprocessor_config.json
    video_preprocessor_config: dict[str, Any] | None = None  # the hub's video_preprocessor_config.json, if any


REAL: dict[str, RealCheckpoint] = {
    "Qwen2.5-Omni-7B": RealCheckpoint(
        "qwen2_5_omni",
        ("Qwen2_5OmniModel",),
        32768,
        {"text": 28, "vision": 16, "audio": 20},
        4,
        {
            **_VISION_PROCESSOR,
            **_WHISPER,
            "chunk_length": 300,
            "n_samples": 4800000,
            "nb_max_frames": 30000,
            "dither": 0.0,
            "processor_class": "Qwen2_5OmniProcessor",
        },
    ),
    "Qwen2.5-VL-7B-Instruct": RealCheckpoint(
        "qwen2_5_vl",
        ("Qwen2_5_VLForConditionalGeneration",),
        128000,
        {"text": 28, "vision": 16},
        4,
        {**_VISION_PROCESSOR, "processor_class": "Qwen2_5_VLProcessor"},
    ),
    "Qwen3-VL-8B-Instruct": RealCheckpoint(
        "qwen3_vl",
        ("Qwen3VLForConditionalGeneration",),
        262144,
        {"text": 32, "vision": 16},
        8,
        {
            **_QWEN3_VISION,
            "image_processor_type": "Qwen2VLImageProcessorFast",
            "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        },
        {
            **_QWEN3_VISION,
            "video_processor_type": "Qwen3VLVideoProcessor",
            "size": {"longest_edge": 25165824, "shortest_edge": 4096},
        },
    ),
    "Qwen3-VL-30B-A3B-Instruct": RealCheckpoint(
        "qwen3_vl_moe",
        ("Qwen3VLMoeForConditionalGeneration",),
        262144,
        {"text": 32, "vision": 16},
        4,
        {
            **_QWEN3_VISION,
            "image_processor_type": "Qwen2VLImageProcessorFast",
            "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        },
        {
            **_QWEN3_VISION,
            "video_processor_type": "Qwen3VLVideoProcessor",
            "size": {"longest_edge": 25165824, "shortest_edge": 4096},
        },
    ),
    # transformers 5.19's Qwen3_5Config defaults, which its docstring gives as Qwen/Qwen3.5-27B's: not
    # checked against the hub's files here (no hub); the processors are Qwen3-VL's
    "Qwen3.5-27B": RealCheckpoint(
        "qwen3_5",
        ("Qwen3_5ForConditionalGeneration",),
        32768,
        {"text": 16, "vision": 16},
        4,
        {
            **_QWEN3_VISION,
            "image_processor_type": "Qwen2VLImageProcessorFast",
            "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        },
        {
            **_QWEN3_VISION,
            "video_processor_type": "Qwen3VLVideoProcessor",
            "size": {"longest_edge": 25165824, "shortest_edge": 4096},
        },
    ),
    # Qwen3-Omni-30B-A3B-Instruct's thinker as recalled from its config.json (Qwen3-30B-A3B's language
    # model, 65536 positions; SigLIP2-style tower; the Whisper-style encoder of 20 heads) and processor
    # (Qwen2.5-Omni's with patch 16 and mean/std 0.5): not checked against the hub here (no hub)
    "Qwen3-Omni-30B-A3B-Instruct": RealCheckpoint(
        "qwen3_omni",
        ("Qwen3OmniMoeForConditionalGeneration",),
        65536,
        {"text": 32, "vision": 16, "audio": 20},
        4,
        {
            **_WHISPER,
            "chunk_length": 300,
            "n_samples": 4800000,
            "nb_max_frames": 30000,
            "dither": 0.0,
            "min_pixels": 3136,
            "max_pixels": 12845056,
            "patch_size": 16,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen3OmniMoeProcessor",
        },
    ),
    "InternVL3-8B-hf": RealCheckpoint(
        "internvl",
        ("InternVLForConditionalGeneration",),
        32768,
        {"text": 28, "vision": 16},
        4,
        {
            "crop_to_patches": True,
            "min_patches": 1,
            "max_patches": 12,
            "size": {"height": 448, "width": 448},
            "image_mean": [0.485, 0.456, 0.406],
            "image_std": [0.229, 0.224, 0.225],
            "image_processor_type": "GotOcr2ImageProcessorFast",
            "processor_class": "InternVLProcessor",
        },
    ),
    "audio-flamingo-3-hf": RealCheckpoint(
        "audioflamingo3",
        ("AudioFlamingo3ForConditionalGeneration",),
        32768,
        {"text": 28, "audio": 20},
        4,
        {
            **_WHISPER,
            "chunk_length": 30,
            "n_samples": 480000,
            "nb_max_frames": 3000,
            "processor_class": "AudioFlamingo3Processor",
        },
    ),
    "Qwen2-Audio-7B-Instruct": RealCheckpoint(
        "qwen2_audio",
        ("Qwen2AudioForConditionalGeneration",),
        8192,
        {"text": 32, "audio": 20},
        32,
        {
            **_WHISPER,
            "chunk_length": 30,
            "n_samples": 480000,
            "nb_max_frames": 3000,
            "processor_class": "Qwen2AudioProcessor",
        },
    ),
}


def load_preset(name: str) -> dict[str, Any]:
    return json.loads((PRESETS_DIR / name / "model.json").read_text())


def checkpoint_of(name: str) -> RealCheckpoint:
    """The real checkpoint a preset serves: the last part of its ``model`` path."""
    return REAL[Path(load_preset(name)["model"]).name]


@pytest.fixture(scope="module")
def real_settings(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """Hub checkpoint name -> the tiny checkpoint of its family with the hub's preprocessor_config.json
    (files linked, the tiny processor_config.json left out)."""
    root = tmp_path_factory.mktemp("real_settings")
    dirs = {}
    for hub_name, real in REAL.items():
        out = root / hub_name
        out.mkdir()
        for path in Path(tiny_models[real.family]).iterdir():
            if path.name != "processor_config.json":
                (out / path.name).symlink_to(path.resolve())
        (out / "preprocessor_config.json").write_text(json.dumps(real.preprocessor_config, indent=2))
        if real.video_preprocessor_config is not None:
            (out / "video_preprocessor_config.json").write_text(json.dumps(real.video_preprocessor_config, indent=2))
        dirs[hub_name] = out
    return dirs


def _preprocess_parameters() -> dict[str, str]:
    """preprocess/config.pbtxt's parameters, as Triton hands them to the model."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    from mmserve.serving.triton import parameters

    text = (ROOT / "model_repository" / "preprocess" / "config.pbtxt").read_text()
    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    return parameters(json_format.MessageToDict(config, preserving_proto_field_name=True))


def _engine_arg_type(name: str) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs

    field = {f.name: f for f in dataclasses.fields(AsyncEngineArgs)}[name]
    return (
        eval(field.type, vars(sys.modules[AsyncEngineArgs.__module__])) if isinstance(field.type, str) else field.type
    )


# -- the presets as files ----------------------------------------------------------------------------
def test_every_checkpoint_has_a_one_gpu_and_a_tensor_parallel_preset():
    by_checkpoint: dict[str, list[int]] = {}
    for name in PRESETS:
        by_checkpoint.setdefault(Path(load_preset(name)["model"]).name, []).append(
            load_preset(name).get("tensor_parallel_size", 1)
        )
    assert {k: sorted(v)[0] for k, v in by_checkpoint.items()} == dict.fromkeys(REAL, 1)
    assert all(len(v) >= 2 for v in by_checkpoint.values()), by_checkpoint
    for name in PRESETS:
        if name.endswith("_tp2"):  # the same arguments, plus the parallel layout (and a bigger batch)
            one, tp = load_preset(name.removesuffix("_tp2")), load_preset(name)
            assert tp["tensor_parallel_size"] == 2 and tp["distributed_executor_backend"] == "mp"
            assert {k: v for k, v in tp.items() if k not in (*PARALLEL_KEYS, "max_num_seqs")} == {
                k: v for k, v in one.items() if k != "max_num_seqs"
            }


@pytest.mark.parametrize("name", PRESETS)
def test_keys_are_engine_arguments_of_their_type(name):
    from pydantic import TypeAdapter, ValidationError
    from vllm.engine.arg_utils import AsyncEngineArgs

    preset = load_preset(name)
    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    assert set(preset) <= fields, f"not vLLM engine arguments: {sorted(set(preset) - fields)}"
    assert not set(preset) & set(FORBIDDEN_KEYS)
    for key, value in preset.items():
        try:
            TypeAdapter(_engine_arg_type(key)).validate_python(value, strict=True)
        except ValidationError as exc:
            pytest.fail(f"{name}: {key}={value!r}: {exc}")


def test_the_type_check_catches_wrong_types():
    from pydantic import TypeAdapter, ValidationError

    for key, bad in (
        ("tensor_parallel_size", "2"),
        ("max_model_len", 8192.0),
        ("enable_prefix_caching", 1),
        ("dtype", "bf16"),
        ("limit_mm_per_prompt", {"image": "4"}),
    ):
        with pytest.raises(ValidationError):
            TypeAdapter(_engine_arg_type(key)).validate_python(bad, strict=True)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_fits_the_real_checkpoint_and_preprocess(name):
    from mmserve.families import get_family
    from mmserve.inputs import mm_limits
    from mmserve.serving.preprocess import PreprocessLimits

    preset, real = load_preset(name), checkpoint_of(name)
    assert preset["max_model_len"] <= real.max_position_embeddings
    tp = preset.get("tensor_parallel_size", 1)
    for part, heads in real.heads.items():
        assert heads % tp == 0, f"{part}: {heads} attention heads do not split over {tp} ranks"
    assert real.kv_heads % tp == 0 or tp % real.kv_heads == 0
    limits = PreprocessLimits.from_parameters(_preprocess_parameters(), mm_limits(preset))
    assert preset["max_model_len"] <= limits.max_prompt_tokens
    modalities = {spec.modality for spec in get_family(real.family).modalities}
    assert set(mm_limits(preset)) == modalities, "one limit per modality the family takes"


# -- vLLM's configuration, on the tiny checkpoint with the real processor settings ----------------------
@pytest.mark.parametrize("name", PRESETS)
def test_vllm_builds_its_configuration_from_the_preset(name, real_settings, tmp_path, monkeypatch):
    """The preset's model.json read as mm_llm reads it (``model`` from MMSERVE_MODEL, as with
    ``scripts/serve.sh --preset NAME --model DIR``), then vLLM's whole engine configuration."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from mmserve.families import get_family
    from mmserve.inputs import engine_kwargs
    from mmserve.serving.llm import LLMConfig

    real = checkpoint_of(name)
    model = real_settings[Path(load_preset(name)["model"]).name]
    monkeypatch.setenv("MMSERVE_MODEL", str(model))
    config = LLMConfig.from_file(PRESETS_DIR / name / "model.json")
    assert config.model == str(model)
    preset = {k: v for k, v in config.engine_args.items() if k != "model"}
    vllm_config = AsyncEngineArgs(**engine_kwargs(config.model, **preset)).create_engine_config()

    assert vllm_config.model_config.architectures == [get_family(real.family).passthrough_architecture]
    assert vllm_config.model_config.max_model_len == preset["max_model_len"]
    assert str(vllm_config.model_config.dtype) == f"torch.{preset['dtype']}"
    parallel = vllm_config.parallel_config
    assert parallel.tensor_parallel_size == preset.get("tensor_parallel_size", 1)
    if parallel.tensor_parallel_size > 1:
        assert parallel.distributed_executor_backend == "mp"
    assert vllm_config.scheduler_config.max_num_seqs == preset["max_num_seqs"]
    assert vllm_config.cache_config.enable_prefix_caching is preset["enable_prefix_caching"]


# -- preprocess and vLLM's profiling on the real processor settings (per checkpoint) -------------------
class _Checkpoint:
    """preprocess (with config.pbtxt's limits and the preset's) and vLLM's pass-through processor on
    one tiny checkpoint with the real processor settings."""

    def __init__(self, hub_name: str, model: Path) -> None:
        from vllm.config import ModelConfig
        from vllm.multimodal import MULTIMODAL_REGISTRY

        from mmserve.families import get_family
        from mmserve.inputs import engine_kwargs, mm_limits
        from mmserve.passthrough import register
        from mmserve.serving.preprocess import PreprocessLimits, Preprocessor

        self.real = REAL[hub_name]
        self.family = get_family(self.real.family)
        self.preset = next(load_preset(n) for n in PRESETS if Path(load_preset(n)["model"]).name == hub_name)
        self.limits = PreprocessLimits.from_parameters(_preprocess_parameters(), mm_limits(self.preset))
        self.preprocessor = Preprocessor(model, limits=self.limits)
        register()
        config = ModelConfig(
            **engine_kwargs(
                model,
                max_model_len=self.preset["max_model_len"],
                dtype="float32",
                limit_mm_per_prompt=mm_limits(self.preset),
            )
        )
        self.processor = MULTIMODAL_REGISTRY.create_processor(config)
        self.hf_config = self.processor.info.get_hf_config()

    def longest_clip_s(self) -> float:
        """The longest clip preprocess accepts."""
        return min(self.preprocessor.max_audio_seconds, self.limits.max_total_audio_seconds)

    def passthrough_clip_s(self) -> float:
        """The longest clip the family's pass-through rule accepts (2 * max_source_positions frames;
        a processor that cuts clips into such windows: its max_audio_len)."""
        spec = self.family.modality("audio")
        if spec is not None and spec.max_item_seconds_replaces_window:
            return float(self.preprocessor.processor.max_audio_len)
        extractor = self.preprocessor.processor.feature_extractor
        return 2 * self.hf_config.audio_config.max_source_positions * extractor.hop_length / extractor.sampling_rate

    def tokens(self, modality: str, media: dict[str, Any]) -> tuple[int, int]:
        """(placeholder tokens of the one item, prompt length) of a preprocessed request, the item
        checked by the family's pass-through rules (as vLLM's pass-through processor checks it)."""
        import torch

        from mmserve.inputs import processed_multi_modal_data
        from mmserve.passthrough.items import ProcessedItems
        from mmserve.passthrough.placeholders import placeholder_runs

        outputs = self.preprocessor.decode_wire(self.preprocessor("Describe it.", **media))
        ids = outputs.pop("input_ids").tolist()
        data = processed_multi_modal_data(self.family, outputs)[modality]
        spec = self.family.modality(modality)
        assert spec is not None, modality
        items = ProcessedItems({k: torch.from_numpy(v) for k, v in data.items()}, spec, self.hf_config)
        runs = placeholder_runs(ids, self.preprocessor.placeholder_ids[modality][1])
        assert [n for _, n in runs] == items.expected_tokens()
        return runs[0][1], len(ids)


@pytest.fixture(scope="module")
def checkpoints(real_settings):
    cache: dict[str, _Checkpoint] = {}

    def get(hub_name: str) -> _Checkpoint:
        if hub_name not in cache:
            cache[hub_name] = _Checkpoint(hub_name, real_settings[hub_name])
        return cache[hub_name]

    return get


def _image(side: int) -> bytes:
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (side, side), (120, 60, 200)).save(png, format="PNG")
    return png.getvalue()


def _clip(seconds: float) -> bytes:
    from mmserve_dev.samples import encode_audio, sample_audio

    return encode_audio(sample_audio(1, seconds=seconds))


@pytest.mark.parametrize("hub_name", list(REAL))
def test_preprocess_runs_the_checkpoints_settings(hub_name, checkpoints):
    checkpoint = checkpoints(hub_name)
    settings = checkpoint.real.preprocessor_config
    image_processor = getattr(checkpoint.preprocessor.processor, "image_processor", None)
    size = dict(image_processor.size) if image_processor is not None else {}
    if "max_pixels" in settings:
        assert (size["shortest_edge"], size["longest_edge"]) == (settings["min_pixels"], settings["max_pixels"])
    if "size" in settings:  # Qwen3-VL's (pixels over all of a video's frames), InternVL's (a tile)
        assert size == settings["size"]
    if checkpoint.real.video_preprocessor_config is not None:
        video = checkpoint.preprocessor.processor.video_processor
        assert video.size == checkpoint.real.video_preprocessor_config["size"]
    if "max_patches" in settings:
        assert checkpoint.preprocessor.processor.image_processor.max_patches == settings["max_patches"]
    if "n_samples" in settings:
        extractor = checkpoint.preprocessor.processor.feature_extractor
        assert extractor.n_samples == settings["n_samples"]  # 300 s for Omni, 30 s for Qwen2-Audio
        spec = checkpoint.family.modality("audio")
        if spec is not None and spec.max_item_seconds_replaces_window:  # Audio Flamingo 3: 30-s windows, 600-s clips
            window = checkpoint.passthrough_clip_s()
            assert (
                checkpoint.preprocessor.audio_window_s == checkpoint.preprocessor.max_audio_seconds == window == 600.0
            )
        else:
            window = min(settings["n_samples"] / settings["sampling_rate"], checkpoint.passthrough_clip_s())
            assert checkpoint.preprocessor.audio_window_s == checkpoint.preprocessor.max_audio_seconds == window == 30.0


@pytest.mark.parametrize("hub_name", list(REAL))
def test_largest_items_fit_the_engine_and_vllms_profile(hub_name, checkpoints):
    """The largest image preprocess accepts (max_image_pixels, resized to the checkpoint's max_pixels)
    and the longest clip both preprocess and the pass-through accept: within max_model_len, counted
    as the family's rule counts them, and no larger than vLLM's profiling items (encoder cache and
    memory are sized by those)."""
    checkpoint = checkpoints(hub_name)
    largest = {}
    if checkpoint.family.modality("image") is not None:
        side = int(checkpoint.limits.max_image_pixels**0.5)
        largest["image"], length = checkpoint.tokens("image", {"images": [_image(side)]})
        assert length <= checkpoint.preset["max_model_len"]
    if checkpoint.family.modality("audio") is not None:
        seconds = min(checkpoint.longest_clip_s(), checkpoint.passthrough_clip_s())
        largest["audio"], length = checkpoint.tokens("audio", {"audios": [_clip(seconds)]})
        assert length <= checkpoint.preset["max_model_len"]

    dummy = checkpoint.processor.get_dummy_mm_inputs(dict.fromkeys(largest, 1))
    profiled = {modality: ranges[0].length for modality, ranges in dummy["mm_placeholders"].items()}
    assert sorted(profiled) == sorted(largest)
    for modality, tokens in largest.items():
        assert tokens <= profiled[modality], f"{modality}: preprocess sends {tokens} tokens, vLLM profiles {profiled}"
    settings = checkpoint.real.preprocessor_config
    max_pixels = settings.get("max_pixels") or settings.get("size", {}).get("longest_edge")
    if max_pixels:  # a 16-MP image is resized to max_pixels: exactly vLLM's largest image
        side = settings["patch_size"] * settings["merge_size"]
        assert largest["image"] == profiled["image"] == max_pixels // side**2


@pytest.mark.parametrize("hub_name", ["Qwen2.5-Omni-7B", "Qwen2-Audio-7B-Instruct"])
def test_preprocess_accepts_no_clip_the_passthrough_refuses(hub_name, checkpoints):
    checkpoint = checkpoints(hub_name)
    seconds = checkpoint.longest_clip_s()
    checkpoint.tokens("audio", {"audios": [_clip(seconds)]})


def test_omni_clips_stop_at_the_encoders_30_s(checkpoints):
    """The real Omni processor's window is 300 s; preprocess refuses what the encoder rule would,
    with its own message, and a configured max_audio_seconds over that bound fails the load."""
    checkpoint = checkpoints("Qwen2.5-Omni-7B")
    preprocessor = checkpoint.preprocessor
    assert preprocessor.max_audio_seconds == checkpoint.passthrough_clip_s() == 30.0
    with pytest.raises(ValueError, match="exceeds the model's audio window of 30.0 s"):
        preprocessor.with_settings(limits=dataclasses.replace(checkpoint.limits, max_audio_seconds=60.0))
    checkpoint.tokens("audio", {"audios": [_clip(30.0)]})
    with pytest.raises(Exception, match=r"exceeds the limit of 30\.0 s per clip"):
        checkpoint.tokens("audio", {"audios": [_clip(30.5)]})

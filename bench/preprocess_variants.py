"""What each choice in ``preprocess`` buys: time per request and bytes sent on, side by side.

Compared, interleaved request by request on the same fresh media (one process, no server):

* ``audio window``: the HF processor's default call (every clip padded to the 30-s window) vs.
  ``Preprocessor`` (clips padded just past the longest one, the padding cut: ``WhisperAudio``'s
  ``processor_kwargs`` and ``compact``), on a 3-s clip;
* ``image backend``: transformers' PIL image processor vs. its torchvision one (the default, which
  ``preprocess`` uses), on a 448x448 image;
* ``torch threads``: ``Preprocessor`` on image+audio requests with 1 torch thread vs. all cores.

Each row checks that the variants give the same tensors where ``preprocess`` promises it (audio:
the valid frames; threads: everything) and prints the ratio. Reproduce (about 1 minute)::

    .venv/bin/python bench/preprocess_variants.py [--requests 40] [--model models/qwen2_5_omni]
"""

from __future__ import annotations

import argparse
import functools
import io
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mmserve_dev.samples import AUDIO_SAMPLE_RATE

ROOT = Path(__file__).resolve().parents[1]


def png(seed: int, size: int = 448) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed + 1000).integers(0, 255, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def clip(seed: int, seconds: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed + 1000).standard_normal(int(seconds * AUDIO_SAMPLE_RATE)) * 0.1).astype(
        np.float32
    )


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


def nbytes(outputs: Any) -> int:
    return sum(np.asarray(value).nbytes for value in outputs.values())


def compare(
    name: str, variants: dict[str, Callable[[int], Any]], requests: int, same: Callable[[Any, Any], bool]
) -> None:
    """Run ``variants`` alternately on request seeds 0..requests-1 (2 warm-up rounds first)."""
    times: dict[str, list[float]] = {label: [] for label in variants}
    sizes: dict[str, int] = {}
    mismatches = 0
    labels = list(variants)
    for seed in range(-2, requests):  # negative: warm-up
        results = {}
        for label in labels if seed % 2 else labels[::-1]:
            elapsed, results[label] = timed(functools.partial(variants[label], seed))
            if seed >= 0:
                times[label].append(elapsed)
                sizes[label] = nbytes(results[label])
        mismatches += not same(results[labels[0]], results[labels[1]])
    base, new = (statistics.median(times[label]) * 1000 for label in labels)
    print(
        f"{name:15s} {labels[0]:>22s} {base:7.1f} ms {sizes[labels[0]] / 2**20:6.2f} MiB | "
        f"{labels[1]:>22s} {new:7.1f} ms {sizes[labels[1]] / 2**20:6.2f} MiB | "
        f"time {new / base:5.2f}x  bytes {sizes[labels[1]] / sizes[labels[0]]:5.2f}x  "
        f"{'same' if not mismatches else f'{mismatches} MISMATCHES'}"
    )
    if mismatches:
        sys.exit(1)


def main() -> None:
    import torch
    from transformers import AutoImageProcessor

    from mmserve.serving.preprocess import Preprocessor, available_cores

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "models" / "qwen2_5_omni"))
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()

    preprocessor = Preprocessor(args.model)
    processor = preprocessor.processor
    cores = available_cores()
    print(f"{args.model}: {args.requests} requests per variant, median time per request, {cores} cores\n")

    torch.set_num_threads(1)
    prompt = preprocessor.chat_prompt("Describe.", 0, 1)

    def window(seed: int) -> dict[str, Any]:
        out = processor(text=[prompt], audio=[clip(seed)], sampling_rate=AUDIO_SAMPLE_RATE, return_tensors="np")
        return {name: out[name] for name in ("input_ids", "input_features", "feature_attention_mask")}

    def trimmed(seed: int) -> dict[str, Any]:
        out = preprocessor("Describe.", pcm=[(clip(seed), 16000)])
        return {name: out[name] for name in ("input_ids", "input_features", "feature_attention_mask")}

    def valid_frames_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
        frames = b["input_features"].shape[-1]
        return (
            np.array_equal(a["input_ids"][0], b["input_ids"])
            and np.array_equal(a["input_features"][..., :frames], b["input_features"])
            and not a["feature_attention_mask"][:, frames:].any()
        )

    compare(
        "audio window", {"30-s window (HF)": window, "clip + margin (ours)": trimmed}, args.requests, valid_frames_equal
    )

    pil = AutoImageProcessor.from_pretrained(args.model, backend="pil")
    fast = processor.image_processor
    images: dict[int, Any] = {}

    def decoded(seed: int) -> Any:
        if seed not in images:
            images.clear()
            images[seed] = preprocessor.media.image(0, png(seed))
        return images[seed]

    compare(
        "image backend",
        {
            "PIL": lambda seed: dict(pil(images=[decoded(seed)], return_tensors="np")),
            "torchvision (ours)": lambda seed: dict(fast(images=[decoded(seed)], return_tensors="np")),
        },
        args.requests,
        lambda a, b: a["pixel_values"].shape == b["pixel_values"].shape,
    )

    def both(threads: int) -> Callable[[int], Any]:
        def run(seed: int) -> dict[str, Any]:
            torch.set_num_threads(threads)
            return preprocessor("Describe.", images=[png(seed)], pcm=[(clip(seed), 16000)])

        return run

    compare(
        "torch threads",
        {f"{cores} threads": both(cores), "1 thread": both(1)},
        args.requests,
        lambda a, b: all(np.array_equal(a[name], b[name]) for name in a),
    )
    print(
        "\nimage backend: the tensors differ by design (PIL's resize), shapes equal; the torchvision "
        "backend is transformers' default, the one vLLM's own processing uses."
    )


if __name__ == "__main__":
    main()

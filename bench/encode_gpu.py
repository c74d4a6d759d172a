"""The encoder towers on a GPU: embeddings in bfloat16 on CUDA against float32 on the CPU, and
encoder throughput on each. Needs torch, transformers and safetensors only (no vLLM, no Triton):
``mmserve.encoder.Towers`` (the checkpoint's vision and audio towers, without the language model)
fed the HF processor's outputs. Where there is no CUDA device it says so, gives the CPU figures and
exits 0.

    .venv/bin/python bench/encode_gpu.py                       # the tiny default checkpoint
    .venv/bin/python bench/encode_gpu.py --model /models/Qwen2.5-Omni-7B --images 32 --image-size 896 672

On a machine without the project installed: ``PYTHONPATH=src:tools python bench/encode_gpu.py``
(with the checkpoint directory at hand).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def inputs(model: Path, images: int, size: tuple[int, int], audio_seconds: float) -> dict[str, dict[str, Any]]:
    """The HF processor's tensors per modality of ``images`` seeded pictures and as many clips."""
    import numpy as np
    from transformers import AutoProcessor

    from mmserve_dev.samples import AUDIO_SAMPLE_RATE, sample_audio, sample_image

    processor = AutoProcessor.from_pretrained(str(model))
    pictures = [sample_image(seed, size=size) for seed in range(images)]
    out: dict[str, dict[str, Any]] = {}
    image = processor.image_processor(images=pictures, return_tensors="pt")
    out["image"] = {"pixel_values": image["pixel_values"], "image_grid_thw": image["image_grid_thw"]}
    extractor = getattr(processor, "feature_extractor", None)
    if extractor is not None:
        clips = [np.asarray(sample_audio(seed, seconds=audio_seconds)) for seed in range(images)]
        audio = extractor(
            clips,
            sampling_rate=AUDIO_SAMPLE_RATE,
            return_attention_mask=True,
            padding="max_length",
            return_tensors="pt",
        )
        out["audio"] = {"input_features": audio["input_features"], "feature_attention_mask": audio["attention_mask"]}
    return out


def timed(call: Callable[[], Any], rounds: int, sync: Callable[[], None]) -> tuple[float, Any]:
    """Median seconds of ``rounds`` calls after one warm-up, and the last result."""
    result = call()
    sync()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        result = call()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def compare(got: Any, want: Any) -> dict[str, float]:
    """How far ``got`` (on the GPU, bf16) is from ``want`` (CPU float32)."""
    import torch

    got, want = got.float().cpu(), want.float()
    diff = (got - want).abs()
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    return {
        "max_abs": float(diff.max()),
        "max_rel": float(diff.max() / want.abs().max()),
        "min_cosine": float(cosine.min()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "qwen2_5_omni", help="local checkpoint")
    parser.add_argument("--images", type=int, default=16, help="images (and audio clips) per batch")
    parser.add_argument("--image-size", type=int, nargs=2, default=(448, 448), metavar=("W", "H"))
    parser.add_argument("--audio-seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)

    import torch

    from mmserve.encoder import Towers

    batches = inputs(args.model, args.images, tuple(args.image_size), args.audio_seconds)
    devices = [("cpu", torch.float32)]
    if torch.cuda.is_available():
        devices.append(("cuda", torch.bfloat16))
    else:
        print("no CUDA device here: CPU float32 figures only (run this where there is a GPU for the rest)")
    print(f"checkpoint {args.model}; {args.images} images {args.image_size[0]}x{args.image_size[1]}", end="")
    print(f" and {args.images} clips of {args.audio_seconds:g} s per batch" if "audio" in batches else "")

    reference: dict[str, Any] = {}
    print("| device | dtype | modality | batch (ms) | items/s | max abs diff | max rel diff | min cosine |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for device, dtype in devices:
        towers = Towers(args.model, device=device, dtype=dtype)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        for modality, tensors in batches.items():
            if modality not in towers.modules:
                continue
            encode = getattr(towers, modality)
            seconds, embeddings = timed(lambda: encode(*tensors.values()), args.rounds, sync)  # noqa: B023
            if device == "cpu":
                reference[modality] = embeddings
                error = "| – | – | – |"
            else:
                figures = compare(embeddings, reference[modality])
                error = f"| {figures['max_abs']:.3g} | {figures['max_rel']:.3g} | {figures['min_cosine']:.5f} |"
            print(
                f"| {device} | {str(dtype).removeprefix('torch.')} | {modality} | {seconds * 1e3:.1f} "
                f"| {args.images / seconds:.1f} {error}"
            )
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tools")]
    sys.exit(main())

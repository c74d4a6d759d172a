#!/usr/bin/env python
"""Check the tiny checkpoints: deterministic builds, and HF == vLLM greedy tokens on raw inputs.

    .venv/bin/python scripts/check_tiny_models.py [--models DIR] [--family NAME ...] [--max-tokens 16]
                                                  [--skip-determinism] [--keep-eos]

1. Determinism: builds every family twice into temporary directories and compares the sha256 of
   every file.
2. Parity: for each family, HF transformers (``mmserve_dev.hf_reference``) and vLLM's offline ``LLM`` on
   the CPU decode greedily from the same raw inputs (chat-templated prompt text + PIL images + 16 kHz
   float32 waveforms); the generated token ids and the expanded prompt ids must be identical. Cases:
   images (VL, Omni: small, a second small one that must give different tokens, a large one, two in
   one prompt), audio (Audio, Omni: 1.5 s, 5.3 s, two in one prompt), image+audio in both orders
   (Omni) and text only (all).

Prints one MATCH/MISMATCH line per case with both token lists; exits 1 on any mismatch. vLLM runs with
stock settings only: the project's own vLLM plugin is disabled here (``VLLM_PLUGINS`` defaults to empty).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_PLUGINS", "")  # stock vLLM: this check is about the checkpoints
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EOS_CHECK_TOKENS = 300
LIMITS = {  # at most two items of a modality per prompt in these cases
    "qwen2_5_vl": {"image": 2, "video": 0},
    "qwen2_audio": {"audio": 2},
    "qwen2_5_omni": {"image": 2, "audio": 2, "video": 0},
}


def make_images():
    """Two small noise images (one 112x84 each) and a larger one (400x300: several attention windows)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(1234)
    first = Image.fromarray(rng.integers(0, 256, (84, 112, 3), dtype=np.uint8), "RGB")
    second = Image.fromarray(rng.integers(0, 256, (84, 112, 3), dtype=np.uint8), "RGB")
    large = Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8), "RGB")
    return first, second, large


def make_audio(seconds: float, freq: float):
    """A 16 kHz float32 sine with a little seeded noise."""
    import numpy as np

    rng = np.random.default_rng(4321)
    t = np.arange(int(16_000 * seconds)) / 16_000
    return (0.3 * np.sin(2 * np.pi * freq * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def cases_for(family_name: str):
    """(name, parts, images, audios) for the family."""
    img1, img2, large = make_images()
    short = make_audio(1.5, 440.0)
    long = make_audio(5.3, 660.0)  # > 2 s: several of the Omni audio encoder's windows
    describe = "text:Describe the picture."
    cases = []
    if family_name in ("qwen2_5_vl", "qwen2_5_omni"):
        cases.append(("image", ["image", describe], [img1], []))
        cases.append(("image2", ["image", describe], [img2], []))
        cases.append(("image_large", ["image", describe], [large], []))
        cases.append(("two_images", ["image", "image", "text:Compare them."], [img1, large], []))
    if family_name in ("qwen2_audio", "qwen2_5_omni"):
        cases.append(("audio", ["audio", "text:What is that sound?"], [], [short]))
        cases.append(("audio_long", ["audio", "text:What is that sound?"], [], [long]))
        cases.append(("two_audios", ["audio", "audio", "text:Compare them."], [], [short, long]))
    if family_name == "qwen2_5_omni":
        cases.append(("image+audio", ["image", "audio", "text:Describe both."], [img1], [short]))
        cases.append(("audio+image", ["audio", "text:Listen, then look:", "image"], [large], [long]))
    cases.append(("text", ["text:Hello, who are you?"], [], []))
    return cases


def check_determinism() -> bool:
    from mmserve_dev import tiny_models

    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        start = time.perf_counter()
        tiny_models.build_all(Path(a))
        first_build = time.perf_counter() - start
        start = time.perf_counter()
        tiny_models.build_all(Path(a))  # second run: must skip
        rerun = time.perf_counter() - start
        tiny_models.build_all(Path(b))
        ok = True
        for family_name in tiny_models.FAMILY_NAMES:
            da = tiny_models.tree_digest(Path(a) / family_name)
            db = tiny_models.tree_digest(Path(b) / family_name)
            same = da == db
            ok &= same
            print(f"determinism {family_name}: {'IDENTICAL' if same else 'DIFFERENT'} ({len(da)} files)")
            if not same:
                for name in sorted(set(da) | set(db)):
                    if da.get(name) != db.get(name):
                        print(f"    differs: {name}")
        print(f"build all: {first_build:.1f}s, rerun (up to date): {rerun:.2f}s")
    return ok


def check_parity(family_name: str, path: Path, max_tokens: int, ignore_eos: bool) -> bool:
    from vllm import LLM, SamplingParams

    from mmserve_dev.hf_reference import HFReference, chat_prompt

    ref = HFReference(family_name, path)
    cases = cases_for(family_name)
    hf_results, hf_prompt_ids = {}, {}
    for name, parts, images, audios in cases:
        prompt = chat_prompt(family_name, ref.processor, parts)
        hf_prompt_ids[name] = ref.processor_inputs(prompt, images, audios)["input_ids"][0].tolist()
        hf_results[name] = ref.generate(prompt, images, audios, max_new_tokens=max_tokens, ignore_eos=ignore_eos)

    start = time.perf_counter()
    llm = LLM(
        model=str(path),
        max_model_len=4096,
        limit_mm_per_prompt=LIMITS[family_name],
        dtype="float32",
        enforce_eager=True,
        max_num_seqs=4,
        seed=0,
    )
    print(f"[{family_name}] engine start: {time.perf_counter() - start:.1f}s")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    requests = []
    for _name, parts, images, audios in cases:
        request = {"prompt": chat_prompt(family_name, ref.processor, parts)}
        mm = {}
        if images:
            mm["image"] = images if len(images) > 1 else images[0]
        if audios:
            mm["audio"] = [(a, 16_000) for a in audios] if len(audios) > 1 else (audios[0], 16_000)
        if mm:
            request["multi_modal_data"] = mm
        requests.append(request)
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    print(f"[{family_name}] vLLM generate ({len(requests)} requests): {time.perf_counter() - start:.1f}s")

    ok = True
    for (name, _, _, _), output in zip(cases, outputs, strict=True):
        hf_ids = hf_results[name]
        vllm_ids = list(output.outputs[0].token_ids)
        match = hf_ids == vllm_ids
        prompt_match = hf_prompt_ids[name] == list(output.prompt_token_ids)
        ok &= match and prompt_match
        print(
            f"[{family_name}] {name:12s} {'MATCH' if match else 'MISMATCH'}"
            f" (prompt ids {'equal' if prompt_match else 'DIFFER'}, {len(hf_prompt_ids[name])} tokens)"
        )
        distinct = len(set(hf_ids))
        note = "" if distinct >= 4 else "  (warning: few distinct tokens)"
        print(f"    hf   {hf_ids}  distinct={distinct}{note}")
        if not match:
            print(f"    vllm {vllm_ids}")
    # EOS handling over a long text generation: stop at EOS vs ignore_eos (which continues past it).
    eos_ids = set(ref.model.generation_config.eos_token_id or [])
    prompt = chat_prompt(family_name, ref.processor, ["text:Hello."])
    for keep_eos in (True, False):
        hf_ids = ref.generate(prompt, max_new_tokens=EOS_CHECK_TOKENS, ignore_eos=not keep_eos)
        out = llm.generate(
            [{"prompt": prompt}],
            SamplingParams(temperature=0.0, max_tokens=EOS_CHECK_TOKENS, ignore_eos=not keep_eos),
            use_tqdm=False,
        )[0]
        vllm_ids = list(out.outputs[0].token_ids)
        match = hf_ids == vllm_ids
        ok &= match
        eos_at = [i for i, t in enumerate(hf_ids) if t in eos_ids]
        mode = "stop at EOS" if keep_eos else "ignore_eos "
        print(
            f"[{family_name}] long text, {mode} {'MATCH' if match else 'MISMATCH'}: "
            f"{len(hf_ids)} tokens, EOS at {eos_at[:4]}"
        )
        if not match:
            print(f"    hf   {hf_ids}\n    vllm {vllm_ids}")
    if "image" in hf_results and "image2" in hf_results:
        differ = hf_results["image"] != hf_results["image2"]
        ok &= differ
        print(f"[{family_name}] two images give {'different' if differ else 'THE SAME'} tokens")

    del llm
    gc.collect()
    return ok


def main() -> int:
    from mmserve_dev import tiny_models

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=tiny_models.DEFAULT_ROOT)
    parser.add_argument("--family", dest="family_name", action="append", choices=tiny_models.FAMILY_NAMES)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--skip-determinism", action="store_true")
    parser.add_argument("--keep-eos", action="store_true", help="stop at EOS (default: ignore_eos, always full length)")
    args = parser.parse_args()

    ok = True
    if not args.skip_determinism:
        ok &= check_determinism()
    families = tuple(args.family_name or tiny_models.FAMILY_NAMES)
    paths = tiny_models.build_all(args.models, families=families)
    for family_name in families:
        ok &= check_parity(family_name, paths[family_name], args.max_tokens, ignore_eos=not args.keep_eos)
    print("ALL OK" if ok else "FAILURES")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Command-line client for the multimodal model served by Triton (mm_ensemble; Ctrl-C stops the
generation on the server too).

  python client/mm_client.py "Describe the picture." --image cat.png --audio hello.wav
  python client/mm_client.py "Hi" --protocol http --url 127.0.0.1:8000 --no-stream
  python client/mm_client.py "Describe." --image cat.png --direct --model models/qwen2_5_omni

gRPC streams the text as it arrives (default); HTTP uses Triton's generate / generate_stream
endpoints. --direct preprocesses here with the model's own processor and calls mm_llm.
"""

from __future__ import annotations

import argparse
import sys

from mmserve.client import ClientError, MMClient


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", help="the user's text")
    parser.add_argument("--image", action="append", default=[], metavar="FILE", help="image file (repeatable)")
    parser.add_argument("--audio", action="append", default=[], metavar="FILE", help="audio file (repeatable)")
    parser.add_argument(
        "--video", action="append", default=[], metavar="FILE", help="video file, for models with video (repeatable)"
    )
    parser.add_argument(
        "--use-audio-in-video",
        action="store_true",
        help="hear each video's audio track too (Qwen2.5-Omni; the videos' files must have one)",
    )
    parser.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    parser.add_argument("--url", help="host:port (default 127.0.0.1:8001 for gRPC, :8000 for HTTP)")
    parser.add_argument("--no-stream", dest="stream", action="store_false", help="one response at the end")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--lora-name", help="the LoRA adapter that answers (a name of mm_llm's multi_lora.json)")
    parser.add_argument(
        "--no-chat-template",
        dest="chat_template",
        action="store_false",
        help="send the prompt as is (it must contain the media placeholders itself)",
    )
    parser.add_argument(
        "--entry", default="mm_ensemble", help="the model that takes raw requests (default %(default)s)"
    )
    parser.add_argument("--direct", action="store_true", help="preprocess locally and call mm_llm (gRPC)")
    parser.add_argument("--model", help="checkpoint directory for --direct")
    args = parser.parse_args(argv)

    url = args.url or ("127.0.0.1:8001" if args.protocol == "grpc" else "127.0.0.1:8000")
    try:
        client = MMClient(url, args.protocol, entry=args.entry, direct=args.direct, model=args.model)
        options = dict(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            lora_name=args.lora_name,
            apply_chat_template=args.chat_template,
        )
        if args.video:
            options["videos"] = args.video
        if args.use_audio_in_video:
            options["use_audio_in_video"] = True
        if args.stream:
            for delta in client.stream(args.prompt, args.image, args.audio, **options):
                print(delta, end="", flush=True)
            print()
        else:
            result = client.generate(args.prompt, args.image, args.audio, **options)
            print(result.text)
            print(
                f"[finish_reason={result.finish_reason} input_tokens={result.num_input_tokens} "
                f"output_tokens={result.num_output_tokens}]",
                file=sys.stderr,
            )
    except (ClientError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

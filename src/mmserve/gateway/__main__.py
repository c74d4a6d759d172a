"""The gateway's command line: ``python -m mmserve.gateway --triton-url HOST:PORT [--port 9000] ...``.

``--api-key`` (or ``$MMSERVE_OPENAI_API_KEY``, which other local users cannot read as they can a
command line) makes ``/v1`` answer only requests that bear the key, as ``vllm serve --api-key``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from mmserve import operator, settings
from mmserve.gateway.app import DEFAULT_MODEL, GatewayConfig
from mmserve.gateway.tools import TOOL_CALL_PARSERS
from mmserve.operator import OPERATOR_HEADER

GRACEFUL_SHUTDOWN_S = 10
"""After SIGTERM, how long streams in flight may still run (uvicorn's graceful shutdown); the drain
that comes with a stop ends them first."""


def _media_limits(text: str) -> dict[str, int]:
    """``--limit-mm-per-prompt``: vLLM's JSON (``{"image": 4, "video": 0}``; a count or
    ``{"count": n, ...}`` per modality), read as ``mmserve.inputs.mm_limits`` reads model.json's."""
    from mmserve.inputs import mm_limits

    try:
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object, found {text!r}")
        limits = mm_limits({"limit_mm_per_prompt": value})
    except (ValueError, TypeError, AttributeError) as exc:
        raise argparse.ArgumentTypeError(f"expected JSON such as '{{\"image\": 4}}' ({exc})") from None
    unknown = sorted(set(limits) - {"image", "audio", "video"})
    if unknown or any(count < 0 for count in limits.values()):
        raise argparse.ArgumentTypeError(f"expected counts >= 0 of image, audio and video, found {text!r}")
    return limits


def config_from_args(argv: Sequence[str] | None = None) -> tuple[GatewayConfig, argparse.Namespace]:
    """The gateway's configuration from its command line (and ``$MMSERVE_OPENAI_API_KEY``)."""
    defaults = GatewayConfig()
    parser = argparse.ArgumentParser(
        prog="python -m mmserve.gateway", description="OpenAI-compatible chat API in front of a Triton server (gRPC)."
    )
    parser.add_argument("--triton-url", default=defaults.triton_url, help="Triton's gRPC endpoint, host:port")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a container)")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument(
        "--model-name", default=DEFAULT_MODEL, help="the Triton model requests go to (default: %(default)s)"
    )
    parser.add_argument(
        "--llm-model-name",
        default=defaults.llm_model,
        help="the model running the engine behind it, where a cancelled request is cancelled "
        "too (default: %(default)s)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients pass as `model` and /v1/models lists (default: --model-name)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME",
        help="LoRA adapters of mm_llm's multi_lora.json that clients may name as `model` (vllm serve's "
        "--lora-modules; a NAME=PATH is taken as NAME: mm_llm loads the adapters)",
    )
    parser.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=(settings.RUNTIME_LORA_UPDATING.get() or "").lower() in ("1", "true"),
        help="serve vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, the operator's only: each "
        f"call carries the operator's key (header {OPERATOR_HEADER}; the gateway's own from "
        f"${settings.OPERATOR_KEY.name}). Default: off, unless $VLLM_ALLOW_RUNTIME_LORA_UPDATING is true (as vLLM)",
    )
    parser.add_argument(
        "--allow-remote-media",
        action="store_true",
        help="fetch http(s) image and audio URLs from public hosts (off: data: URLs only)",
    )
    parser.add_argument(
        "--allowed-media-domains",
        nargs="+",
        metavar="HOST",
        help="with --allow-remote-media: the only hosts media are fetched from, on every redirect too",
    )
    parser.add_argument(
        "--allow-private-media-hosts",
        action="store_true",
        help="with --allow-remote-media: also fetch from loopback, private and link-local addresses "
        "(off: a client could reach the gateway's own network)",
    )
    parser.add_argument(
        "--media-max-bytes",
        type=int,
        default=defaults.media_max_bytes,
        help="largest image or audio item, decoded or fetched",
    )
    parser.add_argument(
        "--media-timeout-s", type=float, default=defaults.media_timeout_s, help="time limit of one remote fetch"
    )
    parser.add_argument(
        "--media-fetches-in-flight",
        type=int,
        default=defaults.media_fetches_in_flight,
        help="with --allow-remote-media: the most media items of one request fetched at once (default: %(default)s)",
    )
    parser.add_argument(
        "--limit-mm-per-prompt",
        type=_media_limits,
        default=None,
        metavar="JSON",
        help="the most media items per request and modality, as vllm serve takes it (e.g. "
        '\'{"image": 4, "audio": 2, "video": 0}\'), counted before anything is fetched; modalities '
        f"left out keep the default {json.dumps(dict(defaults.limit_mm_per_prompt))} (the shipped "
        "mm_llm/model.json's: set it to your engine's limit_mm_per_prompt)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=defaults.max_request_bytes,
        help="largest request body (media travel in it as base64)",
    )
    parser.add_argument(
        "--response-timeout-s",
        type=float,
        default=defaults.response_timeout_s,
        help="the longest wait for Triton's next response on a request, then the request is "
        "cancelled and answered 504 (0: no limit)",
    )
    parser.add_argument(
        "--triton-streams",
        type=int,
        default=defaults.triton_streams,
        help="long-lived gRPC streams to Triton that requests take in turn (default: %(default)s)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=defaults.tool_call_parser,
        help='how tool_choice "auto" reads calls in the text: hermes (<tool_call> blocks, the Qwen '
        'families\' format) or none (refuse "auto", as vllm serve without --enable-auto-tool-choice)',
    )
    parser.add_argument(
        "--api-key",
        nargs="+",
        metavar="KEY",
        default=None,
        help="answer /v1 requests only with 'Authorization: Bearer KEY' (one of these keys; 401 "
        "otherwise), as vllm serve --api-key; /health stays open. Default: "
        f"${settings.OPENAI_API_KEY.name} (better: a command line is visible to other local users)",
    )
    parser.add_argument(
        "--tokenizer",
        default=settings.MODEL.get() or None,
        metavar="PATH",
        help="the checkpoint folder Triton serves: a request without media is rendered (chat template) and "
        "tokenized here and goes to --llm-model-name directly, skipping preprocess, once checked to give "
        f"preprocess's ids (mmserve.gateway.direct); 'none': every request through --model-name. Default: "
        f"${settings.MODEL.name}, else none",
    )
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    args = parser.parse_args(argv)
    if args.media_fetches_in_flight < 1:
        parser.error(f"--media-fetches-in-flight: expected a positive integer, found {args.media_fetches_in_flight}")
    keys = [key for key in (args.api_key or [settings.OPENAI_API_KEY.get()]) if key]
    operator_key = operator.key_from_environment()
    if args.allow_runtime_lora_updating and not operator_key:
        parser.error(
            f"--allow-runtime-lora-updating needs the operator's key (${settings.OPERATOR_KEY.name} or "
            f"${settings.OPERATOR_KEY_FILE.name}): mm_llm changes its adapters for the operator only"
        )

    config = GatewayConfig(
        triton_url=args.triton_url,
        model=args.model_name,
        llm_model=args.llm_model_name,
        served_model_name=args.served_model_name,
        allow_remote_media=args.allow_remote_media,
        allowed_media_domains=tuple(args.allowed_media_domains) if args.allowed_media_domains else None,
        allow_private_media=args.allow_private_media_hosts,
        media_max_bytes=args.media_max_bytes,
        media_timeout_s=args.media_timeout_s,
        max_request_bytes=args.max_request_bytes,
        response_timeout_s=args.response_timeout_s or None,
        triton_streams=args.triton_streams,
        tool_call_parser=args.tool_call_parser,
        limit_mm_per_prompt={**defaults.limit_mm_per_prompt, **(args.limit_mm_per_prompt or {})},
        media_fetches_in_flight=args.media_fetches_in_flight,
        api_keys=tuple(keys),
        lora_modules=tuple(dict.fromkeys(module.split("=", 1)[0] for module in args.lora_modules)),
        runtime_lora_updating=args.allow_runtime_lora_updating,
        operator_key=operator_key,
        tokenizer=None if args.tokenizer in (None, "", "none") else args.tokenizer,
    )
    return config, args


def main(argv: Sequence[str] | None = None) -> int:
    config, args = config_from_args(argv)

    import uvicorn

    from mmserve.gateway.app import create_app

    uvicorn.run(
        create_app(config),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

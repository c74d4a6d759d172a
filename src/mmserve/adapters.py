"""Change the LoRA adapters ``mm_llm`` serves while it serves: its operator's ``lora_adapters``
control request (``mmserve.serving.lora.parse_update``), sent with the operator's key
(``MMSERVE_OPERATOR_KEY`` or ``MMSERVE_OPERATOR_KEY_FILE``, as ``python -m mmserve.drain``)::

    python -m mmserve.adapters load support-v2=/adapters/support-v2   # added, loaded into the engine first
    python -m mmserve.adapters unload support                         # refused to new requests from now on
    python -m mmserve.adapters reload                                 # what multi_lora.json says now

It prints the adapters served afterwards (JSON, name -> folder). ``load`` and ``unload`` last as long as
the engine; ``reload`` after an edit of ``multi_lora.json`` is the change that outlives a restart.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mmserve import operator
from mmserve.client import LLM, ClientError, MMClient


def update_adapters(
    url: str,
    update: Mapping[str, Any],
    *,
    llm: str = LLM,
    operator_key: str | None = None,
    timeout_s: float = 300.0,
) -> dict[str, str]:
    """Send ``update`` (``{"load": {name: folder}}``, ``{"unload": [name]}`` or ``{"reload": True}``) to
    ``llm`` on the Triton at ``url`` (gRPC ``host:port``) with ``operator_key`` (default: the
    environment's): the adapters served now, name -> folder. ``ClientError`` with the server's reason
    when refused."""
    key = operator_key if operator_key is not None else operator.key_from_environment()
    with MMClient(url, timeout=timeout_s).start_tensors(update_tensors(update, key), model=llm) as generation:
        return json.loads("".join(result.text for result in generation))


def update_tensors(update: Mapping[str, Any], operator_key: str | None) -> dict[str, np.ndarray]:
    """``mm_llm``'s ``lora_adapters`` control request for ``update`` (the key left out when empty)."""
    tensors = {
        "input_ids": np.zeros(0, dtype=np.int64),
        "lora_adapters": np.array([json.dumps(update).encode()], dtype=np.object_),
    }
    if operator_key:
        tensors["operator_key"] = np.array([operator_key.encode()], dtype=np.object_)
    return tensors


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmserve.adapters", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="127.0.0.1:8001", help="Triton's gRPC endpoint (default %(default)s)")
    parser.add_argument("--llm-model-name", default=LLM, help="the model running the engine (default %(default)s)")
    actions = parser.add_subparsers(dest="action", required=True)
    load = actions.add_parser("load", help="serve these adapters (NAME=FOLDER), each loaded into the engine first")
    load.add_argument("adapters", nargs="+", metavar="NAME=FOLDER")
    unload = actions.add_parser("unload", help="stop serving these adapters (requests in flight finish)")
    unload.add_argument("names", nargs="+", metavar="NAME")
    actions.add_parser("reload", help="serve what multi_lora.json says now")
    args = parser.parse_args(argv)
    if args.action == "load":
        pairs = [entry.partition("=") for entry in args.adapters]
        if any(not name or not folder for name, _, folder in pairs):
            parser.error("load: expected NAME=FOLDER for each adapter")
        update: dict[str, Any] = {"load": {name: folder for name, _, folder in pairs}}
    else:
        update = {"unload": args.names} if args.action == "unload" else {"reload": True}
    try:
        served = update_adapters(args.url, update, llm=args.llm_model_name)
    except ClientError as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(served, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

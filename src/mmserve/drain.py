"""Before a server stops: have ``mm_llm`` end the generations in flight, so that the stop itself is
quick (``python -m mmserve.drain [--url 127.0.0.1:8001] [--grace-s 5]``).

Triton unloads a model only once no request holds it, and its exit timeout covers waiting for
requests, open HTTP connections and every model's unload together: a generation in flight at a
SIGTERM would take the whole budget and leave none for the unload (exit code 1). So a stop first
sends ``mm_llm`` a ``drain`` control request: it refuses new requests (``UNAVAILABLE``, "the server is
stopping"), lets those in flight run for ``grace_s``, ends the rest ``UNAVAILABLE``, and answers once
none is left; then the server is signalled. Only the operator may drain: the request carries the
operator's key (``mmserve.operator``; ``MMSERVE_OPERATOR_KEY`` or ``MMSERVE_OPERATOR_KEY_FILE``),
without which ``mm_llm`` refuses it. The launcher (``mmserve_dev.triton``) does this at every
stop; in Kubernetes the pod's ``preStop`` hook runs this module (deploy/kubernetes/deployment.yaml).
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mmserve import operator
from mmserve.client import LLM, grpc_inputs

GRACE_S = 5.0
"""Default time the generations in flight get to finish (docs/RELIABILITY.md, "Clean stops")."""
ANSWER_MARGIN_S = 5.0
"""Beyond the grace period, how long to wait for ``mm_llm``'s answer."""


def drain(
    url: str,
    grace_s: float = GRACE_S,
    *,
    llm: str = LLM,
    answer_margin_s: float = ANSWER_MARGIN_S,
    on_sent: Callable[[], object] | None = None,
    operator_key: str | None = None,
) -> bool:
    """Drain ``llm`` on the Triton at ``url`` (gRPC ``host:port``); True once it answered (no request
    in flight any more), False if it could not be asked, refused it (a wrong or missing
    ``operator_key``; default: ``operator.key_from_environment()``) or did not answer within
    ``grace_s`` + ``answer_margin_s``. ``on_sent``: called once the request is handed to the stream
    (a stop's timeline tells the client's time from the server's)."""
    import tritonclient.grpc as grpcclient

    if operator_key is None:
        operator_key = operator.key_from_environment()

    answered = threading.Event()
    errors: list[Any] = []

    def on_answer(result: Any, error: Any) -> None:
        if error is not None:
            errors.append(error)
        answered.set()

    tensors: dict[str, np.ndarray] = {
        "input_ids": np.zeros(0, dtype=np.int64),
        "drain": np.array([grace_s], dtype=np.float32),
    }
    if operator_key:
        tensors["operator_key"] = np.array([operator_key.encode()], dtype=np.object_)
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=on_answer)
        client.async_stream_infer(llm, grpc_inputs(tensors), enable_empty_final_response=True)
        if on_sent is not None:
            on_sent()
        return answered.wait(grace_s + answer_margin_s) and not errors
    except Exception:  # noqa: BLE001 - a server that can't be asked has nothing to drain
        return False
    finally:
        # The stream is closed before the server is signalled, and half-closed, not cancelled, once
        # answered (mmserve.triton_seam STREAM_HALF_CLOSE): an open stream, or one cancelled after
        # its request ended, can keep mm_llm loaded through the whole stop. A close that takes
        # longer than answer_margin_s (a loaded server) goes on in the background.
        closer = threading.Thread(
            target=_close, args=(client, not answered.is_set()), name="mmserve-drain-close", daemon=True
        )
        closer.start()
        closer.join(answer_margin_s)


def _close(client: Any, cancel: bool) -> None:
    try:
        client.stop_stream(cancel_requests=cancel)
        client.close()
    except Exception:  # noqa: BLE001 - the server may be gone already
        pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmserve.drain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="127.0.0.1:8001", help="Triton's gRPC endpoint (default %(default)s)")
    parser.add_argument(
        "--grace-s",
        type=float,
        default=GRACE_S,
        help="how long the generations in flight may still run (default %(default)s)",
    )
    parser.add_argument("--llm-model-name", default=LLM, help="the model running the engine (default %(default)s)")
    args = parser.parse_args(argv)
    ok = drain(args.url, args.grace_s, llm=args.llm_model_name)
    print("drained" if ok else f"could not drain {args.llm_model_name} at {args.url}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Keep models loaded that unload themselves after a fault: what heals ``mm_llm``
(``mmserve.triton_seam``: KEEPER_OUTSIDE_THE_SERVER).

``mm_llm`` answers a dead or wedged engine by failing its requests UNAVAILABLE and asking Triton to
unload it: while it is gone, ``/v2/health/ready`` and the readiness of ``mm_llm`` and of the
ensembles built on it say "not ready" -- on Triton 2.51 the only way a Python model can make them
tell the truth. Something must then load it back, and on 2.51 it can't be a Python model: measured,
a stub that loads a model after its own unload corrupts its heap, and one that polls
``pb_utils.is_model_ready`` beside its requests crashes tritonserver
(``boost::interprocess::lock_exception``). So the keeper is a client of Triton's HTTP repository
API, beside the server: when Triton's repository index shows the first of ``models``
UNAVAILABLE (it unloaded itself, or a load failed), it loads every one of ``models`` that is not
ready, in order (``mm_llm``, then ``mm_ensemble``, which Triton unloaded with it).

An unload that never ends is healed too (``mmserve.triton_seam``: HELD_STREAMS): Triton unloads a
model only once nothing holds it, and a gRPC stream holds its first request, and so that request's
model, until the stream ends -- a client that keeps a stream open (or, on 2.51, cancels one at the
wrong moment) keeps a failed ``mm_llm`` UNLOADING for good. After ``pinned_unload_s`` of
UNLOADING the keeper loads it anyway: Triton then loads a new instance beside the one it still
unloads (its dead engine's processes are gone already), and the new one serves.

The repository API is the operator's (``mmserve.operator``): the keeper sends the operator's key.
``mmserve_dev.triton`` runs one (``scripts/serve.sh``, the tests); elsewhere run it as a sidecar
(needs ``--model-control-mode=explicit``; the key from ``MMSERVE_OPERATOR_KEY`` or
``MMSERVE_OPERATOR_KEY_FILE``)::

    python -m mmserve.serving.keeper --url 127.0.0.1:8000 mm_llm mm_ensemble
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

from mmserve import operator

logger = logging.getLogger(__name__)

PINNED_UNLOAD_S = 10.0
"""How long a model may be UNLOADING before the keeper loads it anyway (``ModelKeeper``)."""


class ModelKeeper:
    """Args:
    http_url: ``host:port`` of Triton's HTTP endpoint.
    models: the model to watch, then the models to load with it, in load order.
    interval_s: how often readiness is checked.
    grace_s: how long the watched model must stay not ready before it is loaded back.
    load_timeout_s: how long a load may take (an engine start).
    pinned_unload_s: how long the watched model may stay UNLOADING before it is loaded anyway (its
        unload is held by a client: see the module's docstring).
    operator_key: the operator's key (the repository API is behind it); default: the environment's.
    """

    def __init__(
        self,
        http_url: str,
        models: Sequence[str],
        *,
        interval_s: float = 0.5,
        grace_s: float = 1.0,
        load_timeout_s: float = 900.0,
        pinned_unload_s: float = PINNED_UNLOAD_S,
        operator_key: str | None = None,
    ) -> None:
        self.url = http_url
        self.models = list(models)
        self.interval_s, self.grace_s, self.load_timeout_s = interval_s, grace_s, load_timeout_s
        self.pinned_unload_s = pinned_unload_s
        self._key = operator_key
        self.loads: list[tuple[str, float]] = []
        """(model, seconds) of every load back, for logs and tests."""
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self.run, name="mmserve-model-keeper", daemon=True)

    @property
    def _headers(self) -> dict[str, str]:
        """The operator's headers; the environment's key is read until there is one (a key file the
        server writes at its start may come after the keeper's)."""
        if self._key is None:
            self._key = operator.key_from_environment()
        return operator.http_headers(self._key)

    def start(self) -> ModelKeeper:
        if self.models:
            self._thread.start()
        return self

    def _client(self, timeout_s: float) -> Any:
        """A ``tritonclient.http`` client, made in the thread that uses it (gevent's rule)."""
        import tritonclient.http as httpclient

        return httpclient.InferenceServerClient(self.url, connection_timeout=5.0, network_timeout=timeout_s)

    @staticmethod
    def _ready(client: Any, model: str) -> bool:
        try:
            return bool(client.is_model_ready(model))
        except Exception:  # noqa: BLE001 - Triton can't be asked (starting, stopping): not ready
            return False

    def _state(self, client: Any, model: str) -> str | None:
        """``model``'s state in Triton's repository index (READY, LOADING, UNLOADING, UNAVAILABLE;
        the version's, the model's only one here); None when Triton can't be asked (it is starting
        or stopping) or says something else."""
        try:
            index = client.get_model_repository_index(headers=self._headers)
        except Exception:  # noqa: BLE001 - as in _ready
            return None
        states = {entry.get("state") for entry in index if entry.get("name") == model}
        return states.pop() if len(states) == 1 else None

    def _unloaded(self, client: Any, model: str) -> bool:
        """Whether ``model`` is UNAVAILABLE: unloaded (by itself, after a fault) or failed to load.
        Not while it loads, unloads or serves."""
        return self._state(client, model) == "UNAVAILABLE"

    def run(self) -> None:
        """Watch until ``stop`` (in the calling thread). The repository index, not readiness, tells
        a model that unloaded from one still loading: a fault just after the start is healed too."""
        watched = self.models[0]
        client = self._client(timeout_s=5.0)
        unloading_since: float | None = None
        try:
            while not self._stopping.wait(self.interval_s):
                state = self._state(client, watched)
                if state == "UNLOADING":
                    now = time.monotonic()
                    unloading_since = unloading_since or now
                    if now - unloading_since >= self.pinned_unload_s:
                        logger.warning(
                            "%s has been unloading for %.0f s: a client holds it (a gRPC stream left open); "
                            "loading a new instance beside it",
                            watched,
                            now - unloading_since,
                        )
                        unloading_since = None
                        self._load_back(client)
                    continue
                unloading_since = None
                if state != "UNAVAILABLE":
                    continue
                if self._stopping.wait(self.grace_s) or not self._unloaded(client, watched):
                    continue
                self._load_back(client)
        finally:
            client.close()

    def _load_back(self, client: Any) -> None:
        from tritonclient.utils import InferenceServerException

        loader = self._client(timeout_s=self.load_timeout_s)
        try:
            for model in self.models:
                if self._stopping.is_set() or self._ready(client, model):
                    continue
                logger.warning("%s is not loaded (it unloaded itself after a fault): loading it", model)
                started = time.monotonic()
                try:
                    loader.load_model(model, headers=self._headers)
                except (InferenceServerException, OSError) as exc:
                    logger.error("loading %s failed (%s); trying again in 10 s", model, exc)
                    self._stopping.wait(10)
                    return
                self.loads.append((model, time.monotonic() - started))
                logger.warning("loaded %s back in %.1f s", model, self.loads[-1][1])
        finally:
            loader.close()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Load back Triton models that unloaded themselves after a fault.")
    parser.add_argument("--url", default="127.0.0.1:8000", help="Triton's HTTP host:port")
    parser.add_argument("models", nargs="+", help="the model to watch, then those to load with it, in order")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    keeper = ModelKeeper(args.url, args.models)

    def on_signal(signum: int, frame: object) -> None:
        keeper.stop(timeout=0)  # a container's PID 1 ignores SIGTERM unless it handles it

    signal.signal(signal.SIGTERM, on_signal)
    try:
        keeper.run()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

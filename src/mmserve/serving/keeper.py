"""Keep models loaded that unload themselves after a fault: what heals ``mm_llm``.

``mm_llm`` answers a dead or wedged engine by failing its requests UNAVAILABLE and asking Triton to
unload it (``pb_utils.unload_model``): while it is gone, ``/v2/health/ready`` and the readiness of
``mm_llm`` and of the ensembles built on it say "not ready" -- on Triton 2.51 the only way a Python
model can make them tell the truth. Something else must load it back: a model can't load itself
once it is unloading (seen: the stub's heap corrupted, ``ModelLoader::SaveToSharedMemory``). So
``mm_pipeline`` runs a ``ModelKeeper``: when the first of ``models`` goes from ready to not ready
while the keeper's own model is still ready (so the server is not stopping), it loads every one of
``models`` that is not ready, in order (``mm_llm``, then ``mm_ensemble``, which Triton unloaded with
it). Needs ``--model-control-mode=explicit``. An operator who unloads ``mm_llm`` by hand sees it
loaded back: unload ``mm_pipeline`` first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)


class ModelKeeper:
    """Args:
        pb_utils: ``triton_python_backend_utils``.
        own_model: the model that runs the keeper (not ready: the server is stopping).
        models: the model to watch, then the models to load with it, in load order.
        interval_s: how often readiness is checked.
        grace_s: how long a model must stay not ready before it is loaded back.
    """

    def __init__(self, pb_utils: Any, own_model: str, models: Sequence[str], *, interval_s: float = 0.5,
                 grace_s: float = 1.0) -> None:
        self.pb = pb_utils
        self.own_model = own_model
        self.models = list(models)
        self.interval_s, self.grace_s = interval_s, grace_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mmserve-model-keeper", daemon=True)
        if self.models:
            self._thread.start()

    def _ready(self, model: str) -> bool:
        try:
            return bool(self.pb.is_model_ready(model))
        except Exception:  # noqa: BLE001 - e.g. the server stopping: not ready
            return False

    def _run(self) -> None:
        watched = self.models[0]
        seen_ready = False
        while not self._stopping.wait(self.interval_s):
            if self._ready(watched):
                seen_ready = True
                continue
            if not seen_ready:  # still loading at start
                continue
            if self._stopping.wait(self.grace_s) or not self._ready(self.own_model) or self._ready(watched):
                continue
            self._load_back()

    def _load_back(self) -> None:
        started = time.monotonic()
        for model in self.models:
            if self._stopping.is_set() or self._ready(model):
                continue
            logger.warning("%s is not loaded (it unloaded itself after a fault): loading it", model)
            try:
                self.pb.load_model(model)
            except Exception:  # noqa: BLE001 - tried again on the next check, after a pause
                logger.exception("loading %s failed; trying again in 10 s", model)
                self._stopping.wait(10)
                return
        logger.warning("loaded back %s in %.1f s", ", ".join(self.models), time.monotonic() - started)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop, and wait for the thread: a call into Triton still in flight when the stub tears
        down crashes tritonserver 2.51 (``boost::interprocess::lock_exception``)."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

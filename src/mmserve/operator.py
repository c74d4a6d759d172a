"""The operator's key: what only the operator may do sits behind it (docs/SECURITY.md).

Behind the key: Triton's model-repository API (load, unload, the index: a load with file overrides
runs code), its shared-memory API (a client that registers the server's own ``/dev/shm`` regions
reads and writes its IPC memory), its logging and trace settings, and ``mm_llm``'s ``drain``.
Inference, health, metadata, model configuration and statistics stay open to every client.

Triton checks the key itself (``--http-restricted-api``, ``--grpc-restricted-protocol``, both in
2.51): an HTTP request must carry the header ``OPERATOR_HEADER``, a gRPC call the metadata
``triton-grpc-protocol-<OPERATOR_HEADER>`` (Triton's prefix for the restricted protocols), each
equal to the key; without it Triton answers 403 (HTTP) or UNAVAILABLE "This protocol is restricted"
(gRPC) before anything runs. ``mm_llm`` compares a drain's ``operator_key`` input with the key in
its own environment.

One key, one value everywhere: tritonserver's command line (``triton_args``) and its environment
(which its stubs inherit), the keeper, the drain and whoever else operates the server
(``key_from_environment``: ``MMSERVE_OPERATOR_KEY``, else the file ``MMSERVE_OPERATOR_KEY_FILE``).
The CPU launcher makes a new one per start when none is set; in Kubernetes and Docker it comes from a
secret. Note that a key on tritonserver's command line is readable by local users of the host
(``/proc/<pid>/cmdline``): the key guards the network, not the machine.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from mmserve import settings

OPERATOR_HEADER = "mmserve-operator-key"
"""The HTTP header that carries the key (gRPC: ``GRPC_METADATA``)."""
GRPC_METADATA = f"triton-grpc-protocol-{OPERATOR_HEADER}"
"""The gRPC metadata key Triton checks for ``OPERATOR_HEADER`` (it prefixes restricted protocols' keys)."""
RESTRICTED_APIS = ("model-repository", "shared-memory", "logging", "trace")
"""Triton's APIs only the operator may call (the same names for HTTP and gRPC)."""
KEY_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.~")
"""What a key may hold: it travels in an HTTP header, gRPC metadata and Triton's command line."""
MIN_KEY_CHARS = 16
MAX_KEY_CHARS = 256


class OperatorKeyError(ValueError):
    """A configured key that can't be used (too short, characters a header can't carry)."""


def new_key() -> str:
    """A fresh random key (256 bits)."""
    return secrets.token_urlsafe(32)


def check_key(key: str) -> str:
    """``key`` if it can serve as the operator's key, else ``OperatorKeyError`` saying why."""
    if not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS:
        raise OperatorKeyError(
            f"the operator's key: expected {MIN_KEY_CHARS} to {MAX_KEY_CHARS} characters, found {len(key)}"
        )
    if bad := sorted(set(key) - KEY_ALPHABET):
        raise OperatorKeyError(
            f"the operator's key: expected letters, digits and '-_.~' only, found {''.join(bad)[:8]!r}"
        )
    return key


def key_from_environment(environ: Mapping[str, str] | None = None) -> str | None:
    """The configured key: ``MMSERVE_OPERATOR_KEY``, else the content of the file
    ``MMSERVE_OPERATOR_KEY_FILE`` (surrounding whitespace dropped); None when neither is set (or
    the file is not there)."""
    environ = os.environ if environ is None else environ
    key = environ.get(settings.OPERATOR_KEY.name, "").strip()
    if not key and (path := environ.get(settings.OPERATOR_KEY_FILE.name, "").strip()):
        try:
            key = Path(path).read_text().strip()
        except FileNotFoundError:
            return None
    return check_key(key) if key else None


def write_key_file(path: str | os.PathLike[str], key: str) -> None:
    """Write ``key`` to ``path``, readable by its owner only (created 0600, never world-readable)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    os.chmod(path, 0o600)


def triton_args(key: str) -> list[str]:
    """tritonserver's flags that put ``RESTRICTED_APIS`` behind ``key`` on HTTP and gRPC."""
    apis = ",".join(RESTRICTED_APIS)
    return [
        f"--http-restricted-api={apis}:{OPERATOR_HEADER}={key}",
        f"--grpc-restricted-protocol={apis}:{OPERATOR_HEADER}={key}",
    ]


def http_headers(key: str | None) -> dict[str, str]:
    """The headers of an operator's HTTP request (none without a key)."""
    return {OPERATOR_HEADER: key} if key else {}


def grpc_headers(key: str | None) -> dict[str, str]:
    """The metadata of an operator's gRPC call, as tritonclient's ``headers=`` (none without a key)."""
    return {GRPC_METADATA: key} if key else {}


def is_operator(expected: str | None, given: bytes | str | None) -> bool:
    """Whether ``given`` is the key ``expected`` (constant time); never without a configured key."""
    if not expected or given is None:
        return False
    if isinstance(given, str):
        given = given.encode("utf-8", "replace")
    return hmac.compare_digest(expected.encode(), given)


def key_for_this_start(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The operator's key of a server about to start, and where it came from: the environment's, or
    a new one -- written to ``MMSERVE_OPERATOR_KEY_FILE`` when that names a file not there yet
    (the keeper and the drain beside the server read it there), else known to this start only."""
    key = key_from_environment(environ)
    if key is not None:
        return key, "configured"
    environ = os.environ if environ is None else environ
    key = new_key()
    if path := environ.get(settings.OPERATOR_KEY_FILE.name, "").strip():
        write_key_file(path, key)
        return key, f"made for this start, in {path}"
    return key, "made for this start"


def main(argv: list[str] | None = None) -> int:
    """``python -m mmserve.operator tritonserver ARGS...``: run tritonserver with the operator's APIs
    behind the key (``triton_args``) and the key in its environment (for ``mm_llm``'s drain): the
    image's command. The key: ``key_for_this_start``."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(main.__doc__, file=sys.stderr)
        return 2
    key, origin = key_for_this_start()
    print(f"mmserve: the operator's key: {origin}; {', '.join(RESTRICTED_APIS)} and the drain need it", file=sys.stderr)
    os.environ[settings.OPERATOR_KEY.name] = key
    os.execvp(argv[0], [*argv, *triton_args(key)])
    return 1  # not reached


if __name__ == "__main__":
    raise SystemExit(main())

"""The Triton seam: every note about a Triton release in the served code is a workaround listed in
``mmserve.triton_seam``, each listed workaround is where it says, and the server the tests run is
the release the list was measured on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mmserve import settings, triton_seam

ROOT = Path(__file__).resolve().parents[1]
RELEASE_NOTE = re.compile(r"\b(?:Triton|tritonserver|on) 2\.5\d\b")
"""A comment or docstring about how a Triton release behaves ("Triton 2.51 crashes ...")."""


def test_every_workaround_is_where_it_says():
    keys = [w.key for w in triton_seam.WORKAROUNDS]
    assert len(keys) == len(set(keys)), "workaround keys must be unique"
    missing = {
        (w.key, path)
        for w in triton_seam.WORKAROUNDS
        for path in w.where
        if not (ROOT / path).is_file() or w.key not in (ROOT / path).read_text()
    }
    assert not missing, f"these files do not name their workaround (or are gone): {sorted(missing)}"


def test_every_note_about_a_triton_release_is_a_listed_workaround():
    listed = {path for w in triton_seam.WORKAROUNDS for path in w.where}
    sources = [
        *ROOT.glob("src/**/*.py"),
        *ROOT.glob("model_repository/**/*.py"),
        *ROOT.glob("model_repository/**/*.pbtxt"),
    ]
    unlisted = sorted(
        f"{path.relative_to(ROOT)}:{number}"
        for path in sources
        if str(path.relative_to(ROOT)) not in listed and path.name != "triton_seam.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if RELEASE_NOTE.search(line)
    )
    assert not unlisted, f"a workaround for a Triton release outside mmserve.triton_seam: {unlisted}"


@pytest.mark.server
def test_the_server_under_test_is_the_release_the_workarounds_were_measured_on(server):
    if settings.TRITON_GRPC_URL.get():
        pytest.skip("an external server: its release is the operator's")
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        assert client.get_server_metadata().version == triton_seam.TRITON_TESTED
    finally:
        client.close()


def test_the_workarounds_a_release_needs():
    """A workaround fixed in a release is active before it and not from it on; those with no known
    fix are active everywhere."""
    by_key = {w.key: w for w in triton_seam.WORKAROUNDS}
    fixed = [w for w in triton_seam.WORKAROUNDS if w.fixed_in]
    assert by_key["HTTP_FRONT_GUARD"].fixed_in == "2.59.0" and by_key["HTTP_FRONT_GUARD"] in fixed
    tested = {w.key for w in triton_seam.active(triton_seam.TRITON_TESTED)}
    image = {w.key for w in triton_seam.active(triton_seam.TRITON_IMAGE)}
    assert tested == {w.key for w in triton_seam.WORKAROUNDS}  # 2.51 needs every one
    assert image == tested - {w.key for w in fixed}
    assert triton_seam.release("2.51.0") < triton_seam.release("2.59.0") < triton_seam.release("2.62.0dev")


@pytest.mark.server
def test_the_launcher_read_the_release_and_applies_what_it_needs(server):
    """The launcher read the served release at its start (``TritonServer.version``) and applies the
    workarounds it carries for that release: the HTTP port is the guard's (tritonserver's own HTTP
    endpoint on another port, on loopback)."""
    if server.server is None:
        pytest.skip("an external server: its release is the operator's")
    triton = server.server
    assert triton.version == triton_seam.TRITON_TESTED
    assert {w.key for w in triton.workarounds()} >= {"HELD_STREAMS", "HTTP_FRONT_GUARD"}
    assert triton.http_guard and triton._guard is not None and triton._guard.port == triton.http_port
    assert f"--http-port={triton.http_port}" not in triton.command()
    assert "--http-address=127.0.0.1" in triton.command()

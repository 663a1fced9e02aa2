"""Fixtures of the integration tests that the shared tests/conftest.py does not hold.

`container_images` (session) builds both images through metronome_testing.images, the code path of `make images`
(cached by content: an unchanged input set reuses the existing tags). A cold build takes minutes, so when a collected
test needs the images they are built once before any test runs, outside per-test timeouts, with progress shown; the
fixture hands out that build (sources edited meanwhile do not trigger a second one).
"""
from __future__ import annotations

import pytest

_BUILT: dict = {}
_FAILED: list[Exception] = []


def _build(echo: bool) -> dict:
    from metronome_testing.images.build import IMAGES, build_images

    if not _BUILT:
        _BUILT.update({image.name: image for image in build_images(list(IMAGES), echo=echo)})
    return _BUILT


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    if not any("container_images" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    capture = session.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        try:
            _build(echo=True)
        except Exception as error:  # noqa: BLE001 - the tests that need the images fail with it; the others run
            _FAILED.append(error)


@pytest.fixture(scope="session")
def container_images():
    """name -> images.build.BuiltImage for "server" and "operator"."""
    if _FAILED:
        pytest.fail(f"building the images failed: {_FAILED[0]}", pytrace=False)
    return _build(echo=False)

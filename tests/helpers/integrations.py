"""What the tests of flashkd.integrations (and test_api's import errors) share: a module unpatched around
each test, a patch refusing a version it was not tested with, and the last line of an error in a
process where a package cannot be imported."""

import importlib.metadata
import subprocess
import sys

import pytest


def unpatched(integration):
    """An autouse fixture for a test module (`_unpatched = unpatched(fk_trl)`): the integration's patch
    undone before and after each test."""

    @pytest.fixture(autouse=True)
    def _unpatched():
        integration.unpatch()
        yield
        integration.unpatch()

    return _unpatched


def check_refuses_version(integration, monkeypatch, package, version, match):
    """With `package` said to be at `version`, the integration's patch() raises RuntimeError matching
    `match`, and nothing is patched."""
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version if name == package else real(name))
    with pytest.raises(RuntimeError, match=match):
        integration.patch()
    assert not integration.is_patched()


def error_without(package, code):
    """The last line of the error that Python `code` exits with (status 1) where `package` cannot be
    imported (as on a machine without it)."""
    code = f"import sys; sys.modules[{package!r}] = None\n" + code
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    return done.stderr.strip().splitlines()[-1]

from __future__ import annotations

import uuid

import pytest

from tests.helpers import kill_marked, processes_with_marker, wait_until


@pytest.fixture
def marker():
    """A unique tag inherited by every process the test starts; teardown fails the test if any survive."""
    tag = uuid.uuid4().hex
    yield tag
    try:
        wait_until(lambda: not processes_with_marker(tag), timeout=10, what="every test process to exit")
    except AssertionError:
        leaked = processes_with_marker(tag)
        kill_marked(tag)
        pytest.fail(f"processes leaked by the test: {leaked}")

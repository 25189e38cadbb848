"""The ``hsnap`` command line from a new user's chair: Ctrl-C, values a
diff prints, verify naming every failure, ``info`` that reads well, a pointer to
``hsnap gc`` for leftovers, and ``hsnap export`` round-tripping every golden
vector's sections through numpy (.npy) and safetensors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hsnap_format import AttentionGeometry, Engine, Geometry, MambaGeometry, open_snapshot, write_snapshot
from hsnap_format import reference as ref
from hsnap_format.tools.cli import main as hsnap
from hsnap_testing.terminal import sigint_as_at_a_terminal
from hsnap_format.tools.export_npy import SAFETENSORS_DTYPES, load_npy_as
from hsnap_format.spec import DTYPES

ROOT = Path(__file__).resolve().parents[1]
VEC = ROOT / "spec" / "vectors"
VECTORS = ["attention-only.hsnap", "hybrid.hsnap", "mla-fp8.hsnap", "two-rank"]


def _geometry() -> Geometry:
    return Geometry(
        attention=AttentionGeometry(kind="mha", layers=(0,), heads=1, k_head_dim=4, v_head_dim=4, dtype="bfloat16",
                                    storage_dtype="bfloat16"),
        mamba=MambaGeometry(layers=(1,), conv_shapes=((8, 3),), conv_dtype="bfloat16", temporal_shape=(2, 2, 2),
                            temporal_dtype="float32"),
        num_layers=2,
    )


def _write(path, *, edit=None, commit="0123456789ab") -> str:
    geom = _geometry()
    ident = ref.identity(snapshot_id="cli")
    ident = type(ident)(**{**ident.__dict__, "tp_size": 1, "engine": Engine("sglang", "0.5.23", commit)})
    rec = ref.record(state_position=6, outputs=2, seed=3)
    state = dict(ref.state_arrays(geom, rec.state_position))
    if edit:
        edit(state)
    write_snapshot(path, identity=ident, geometry=geom, record=rec, state=state)
    return str(path)


def _flip(path, section: str, at: int = 3) -> None:
    with open_snapshot(path) as snap:
        offset = snap.section(section).offset + at
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


# ---------------------------------------------------------------------------- bugs


# command -> how the child makes that command slow (so that Ctrl-C lands in the middle)
SLOW = {
    "diff": "import hsnap_format.tools.diff as m; m.compare_pair = slow",
    "verify": "from hsnap_format.reader import Snapshot; Snapshot.verify_section = slow",
}


@pytest.mark.skipif(sys.platform != "linux", reason="signals as on Linux")
@pytest.mark.parametrize("command", sorted(SLOW))
def test_ctrl_c_is_exit_130_and_one_line(command):
    """SIGINT in the middle of a long command: no traceback (it was 26 lines), exit 130."""
    child = textwrap.dedent("""
        import sys, time
        def slow(*a, **k):
            print("working", flush=True)
            time.sleep(30)
        {patch}
        from hsnap_format.tools.cli import main
        sys.exit(main(sys.argv[1:]))
    """).format(patch=SLOW[command])
    args = [str(VEC / "hybrid.hsnap")] * (2 if command == "diff" else 1)
    p = subprocess.Popen([sys.executable, "-c", child, command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=sigint_as_at_a_terminal)
    try:
        assert p.stdout.readline().strip() == "working"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 130
    assert err == "hsnap: interrupted\n"


def test_diff_prints_values_that_differ_differently(tmp_path, capsys):
    """-0.6261478 vs -0.62614775 printed as -0.626148 twice: now the shortest digits that
    tell float32 values apart, their ulp distance and their bits."""
    def one_ulp(state):
        t = np.array(state["mamba.1.temporal"])
        t[1, 0, 1] = np.nextafter(t[1, 0, 1], np.float32(np.inf))
        state["mamba.1.temporal"] = t

    a, b = _write(tmp_path / "a.hsnap"), _write(tmp_path / "b.hsnap", edit=one_ulp)
    with open_snapshot(a) as sa, open_snapshot(b) as sb:
        va, vb = sa.read("mamba.1.temporal")[1, 0, 1], sb.read("mamba.1.temporal")[1, 0, 1]
    assert hsnap(["diff", "--wide", a, b]) == 1  # the first difference in its section's row
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("mamba.1.temporal"))
    assert f"A {str(va)} B {str(vb)} (1 ulp, bits 0x" in line and str(va) != str(vb)
    assert "first difference" not in line and "[1, 0, 1]" in line
    assert hsnap(["diff", a, b]) == 1  # 80 columns: on the line under the row
    lines = capsys.readouterr().out.splitlines()
    under = lines[next(i for i, x in enumerate(lines) if x.startswith("mamba.1.temporal")) + 1]
    assert under.startswith("    [1, 0, 1]: ") and f"A {str(va)} B {str(vb)} (1 ulp, bits 0x" in under


def test_verify_names_every_failing_section(tmp_path, capsys):
    bad = tmp_path / "bad.hsnap"
    shutil.copy(VEC / "hybrid.hsnap", bad)
    for name in ("attn.1.k", "mamba.2.temporal"):
        _flip(bad, name)
    assert hsnap(["verify", str(bad)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and "attn.1.k" in err[0] and "mamba.2.temporal" in err[1] and "2 problems" in err[2]
    assert hsnap(["verify", "--first", str(bad)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "attn.1.k" in err[0]
    assert hsnap(["verify", "--json", str(bad)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert [e["field"] for e in out["errors"]] == ["sections['attn.1.k'].digest", "sections['mamba.2.temporal'].digest"]
    assert out["ok"] is False and out["field"] == out["errors"][0]["field"]  # the first, at the top level as before


def test_info_reads_well(tmp_path, capsys):
    path = _write(tmp_path / "x.hsnap", commit="")
    assert hsnap(["info", path]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("== ")  # no blank first line
    assert "engine sglang 0.5.23\n" in out or "engine sglang 0.5.23 " not in out.replace("0.5.23\n", "")
    assert "()" not in out and "1 heads" not in out and "1 head per rank" in out
    assert "KiB" in out and " B  " in out  # sizes with units next to the byte counts
    with pytest.raises(SystemExit) as e:
        hsnap(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("hsnap 1.")
    with pytest.raises(SystemExit):
        hsnap(["info", "-h"])
    assert "--json      the whole summary as JSON" in capsys.readouterr().out


def test_a_leftover_points_to_gc(tmp_path, capsys):
    leftover = tmp_path / ".x.hsnap.hsnap-tmp-123-abcd"
    leftover.write_bytes(bytes(4096))
    assert hsnap(["info", str(leftover)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "BadMagicError" in err and f"hsnap gc {tmp_path}" in err


# ---------------------------------------------------------------------------- export


def _sections(snap):
    ranks = snap.ranks if hasattr(snap, "ranks") and isinstance(snap.ranks, dict) else {snap.identity.tp_rank: snap}
    return [(r, s, info) for r, s in sorted(ranks.items()) for info in s.sections]


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


@pytest.mark.parametrize("vector", VECTORS)
def test_export_round_trips_every_section_through_numpy_and_safetensors(vector, tmp_path, capsys):
    src = str(VEC / vector)
    assert hsnap(["export", src, "--all", "-o", str(tmp_path / "npy")]) == 0
    assert hsnap(["export", src, "--all", "-o", str(tmp_path / "all.safetensors")]) == 0
    assert hsnap(["export", src, "--all", "--raw", "-o", str(tmp_path / "raw")]) == 0
    index = json.loads((tmp_path / "npy" / "index.json").read_text())
    files = {(e["rank"], e["name"]): e["file"] for e in index["sections"]}
    from safetensors import safe_open

    with open_snapshot(src) as snap, safe_open(str(tmp_path / "all.safetensors"), framework="numpy") as st:
        sections = _sections(snap)
        multi = len({r for r, _, _ in sections}) > 1
        assert len(files) == len(sections) == len(list(st.keys()))
        header = _safetensors_header(tmp_path / "all.safetensors")
        for rank, s, info in sections:
            want = s.read(info)  # verified
            got = load_npy_as(str(tmp_path / "npy" / files[(rank, info.name)]), info.dtype)
            assert got.shape == want.shape and _bits(got) == _bits(want), info.name
            raw = np.load(tmp_path / "raw" / files[(rank, info.name)], allow_pickle=False)
            assert _bits(raw) == _bits(want)
            key = f"rank{rank}/{info.name}" if multi else info.name
            entry = header[key]
            assert entry["dtype"] == (SAFETENSORS_DTYPES[info.dtype] or "U8")
            if DTYPES[info.dtype].kind in "fiu":  # numpy-native: the library itself reads it back
                assert _bits(st.get_tensor(key)) == _bits(want)
            else:  # bf16/fp8: the bytes at the offsets the header gives
                assert _tensor_bytes(tmp_path / "all.safetensors", entry) == _bits(want)
    assert "exported" in capsys.readouterr().out


def _safetensors_header(path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def _tensor_bytes(path, entry) -> bytes:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        a, b = entry["data_offsets"]
        f.seek(8 + n + a)
        return f.read(b - a)


def test_export_one_section_and_its_refusals(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = str(VEC / "two-rank")
    assert hsnap(["export", src, "rank1/attn.1.k"]) == 0  # default name: NAME.npy
    with open_snapshot(src) as snap:
        want = snap.ranks[1].read("attn.1.k")
    assert _bits(load_npy_as("attn.1.k.npy", "bfloat16")) == _bits(want)
    assert np.load("attn.1.k.npy").dtype == np.float32  # bf16 widened exactly
    capsys.readouterr()
    assert hsnap(["export", src, "rank1/attn.1.k"]) == 1  # never over an existing file
    assert "SnapshotExistsError" in capsys.readouterr().err
    assert hsnap(["export", src, "rank1/attn.1.k", "--force"]) == 0
    assert hsnap(["export", src, "attn.9.k"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "UnknownSectionError" in err and "'attn.9.k'" in err
    bad = tmp_path / "bad.hsnap"
    shutil.copy(VEC / "hybrid.hsnap", bad)
    _flip(bad, "attn.1.k")
    assert hsnap(["export", str(bad), "attn.1.k", "-o", "k.npy"]) == 1
    assert "DigestMismatchError" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["attn.1.k.npy", "bad.hsnap"]  # nothing half-written left behind


def test_subcommands_of_other_packages_come_from_the_entry_point_group(capsys):
    """`hsnap --help` lists the plug-in's clients and the demo from the hsnap.commands group, each with its help line,
    and `hsnap pause --help` dispatches to the registered function."""
    from hsnap_format.tools import cli

    registered = cli.registered_commands()
    assert {"demo", "pause", "resume", "drain", "checkpoint", "migrate"} <= set(registered)
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "export one live request of a server" in out and "live-migrate a request between servers" in out
    with pytest.raises(SystemExit) as e:
        cli.main(["pause", "--help"])
    assert e.value.code == 0
    assert "usage: hsnap pause" in capsys.readouterr().out

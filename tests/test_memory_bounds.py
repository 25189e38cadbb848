"""Memory bounds on hostile files: a preamble, header, trailer or manifest that
claims huge lengths, counts or shapes is refused with a typed error before
anything of that size is allocated.

Each crafted file is honest about its checks (tests/craft.py recomputes header
digest, preamble/trailer checks and root digest), so the claim reaches the
structural checks. The files are opened in a fresh process (this file run as a
script) that measures its peak RSS (VmHWM, i.e. ru_maxrss of its own address space) against a baseline taken after
importing hsnap_format and opening a valid file once; the peak may grow by at
most 64 MiB over all cases — the largest legitimate cost is parsing a header or
manifest of the maximum size (1 MiB of JSON), which is included as a case.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

BOUND_MIB = 64
VECTOR = os.path.join(ROOT, "spec", "vectors", "hybrid.hsnap")
TWO_RANK = os.path.join(ROOT, "spec", "vectors", "two-rank")


def _base(tmp) -> bytes:
    if os.path.exists(VECTOR):
        with open(VECTOR, "rb") as f:
            return f.read()
    import crash_child as cc

    p = os.path.join(tmp, "base.hsnap")
    cc.write_single(p)
    with open(p, "rb") as f:
        return f.read()


def _cases(tmp) -> dict[str, bytes]:
    import craft
    from hsnap_format.spec import MAX_HEADER_BYTES

    data = _base(tmp)
    hdr = craft.split(data).header_obj
    sec = hdr["sections"]
    first_state = 0
    last = len(sec) - 1

    def with_header(fn):
        return craft.mutate_header(data, fn)

    def set_section(i, **kv):
        def fn(h):
            h["sections"][i].update(kv)
        return fn

    def set_path(path, value):
        def fn(h):
            obj = h
            for k in path[:-1]:
                obj = obj[k]
            obj[path[-1]] = value
        return fn

    big = 2**40 - 1
    cases = {
        "preamble header_length 4 GiB": craft.rebuild(data, header_length=1 << 32),
        "preamble header_length 2^64-1": craft.rebuild(data, header_length=2**64 - 1),
        "preamble data_offset 2^62": craft.rebuild(data, data_offset=1 << 62),
        "preamble+trailer file_length 2^62": craft.rebuild(data, file_length=1 << 62, trailer_file_length=1 << 62),
        "trailer section_count 2^16": craft.rebuild(data, section_count=1 << 16),
        "trailer section_count 2^64-1": craft.rebuild(data, section_count=2**64 - 1),
        "section shape 8 x (2^40-1), length 2^53-1": with_header(set_section(first_state, shape=[big] * 8, length=2**53 - 1)),
        "section shape [2^40-1] with honest length": with_header(set_section(first_state, shape=[big], length=big * 2)),
        "section table of 2^16+1 entries": with_header(set_path(["sections"], [0] * (2**16 + 1))),
        "request.prompt_tokens 2^32": with_header(set_path(["request", "prompt_tokens"], 2**32)),
        "request.output_tokens 2^32, top_logprobs_k 4096": with_header(
            lambda h: h["request"].update(output_tokens=2**32, top_logprobs_k=4096, remaining_budget=None)
            or h["request"]["stop"].update(max_new_tokens=None)),
        "rng_state section 2^40-1 bytes": with_header(set_section(last, shape=[big], length=big)),
        "geometry 65536 mamba layers x 8 conv shapes of 2^320 elements": with_header(
            lambda h: h["geometry"].update(attention=None)
            or h["geometry"]["mamba"].update(layers=list(range(2**16)), conv_shapes=[[big] * 8] * 8)),
        "geometry temporal_shape 8 x (2^40-1)": with_header(
            lambda h: h["geometry"]["mamba"].update(temporal_shape=[big] * 8)),
        "request 1025 stop strings of 900 chars": with_header(
            lambda h: h["request"]["stop"].update(stop_strings=["x" * 900] * 1025)),
        f"header of {MAX_HEADER_BYTES >> 20} MiB of empty objects (largest legal parse)": craft.rebuild(
            data, header=b"[" + b",".join([b"{}"] * ((MAX_HEADER_BYTES - 2) // 3)) + b"]"),
    }
    return cases


def _manifest_cases() -> dict[str, bytes]:
    import xxhash

    from hsnap_format.spec import MAX_MANIFEST_BYTES

    def sign(body: bytes) -> bytes:
        return body + b"xxh3-128 " + xxhash.xxh3_128_hexdigest(body).encode() + b"\n"

    def obj(**over):
        base = {"format": "hsnap-manifest", "version": [1, 0], "snapshot_id": "x", "state_position": 5, "tp_size": 2,
                "ranks": [{"rank": r, "file": f"rank-{r}.hsnap", "length": 24644, "root_digest": "0" * 32} for r in range(2)]}
        base.update(over)
        return json.dumps(base, separators=(",", ":"), sort_keys=True).encode() + b"\n"

    n = (MAX_MANIFEST_BYTES - 200) // 3
    return {
        "manifest tp_size 2^53-1": sign(obj(tp_size=2**53 - 1)),
        "manifest rank length 2^53-1": sign(obj(ranks=[{"rank": r, "file": f"rank-{r}.hsnap", "length": 2**53 - 1, "root_digest": "0" * 32} for r in range(2)])),
        "manifest of 1 MiB of empty objects": sign(b"[" + b",".join([b"{}"] * n) + b"]\n"),
        "manifest 2 MiB": sign(obj(snapshot_id="x" * (2 << 20))),
    }


# ------------------------------------------------------------------ the measuring child


def _child(case_dir: str) -> None:
    import hsnap_format as hf

    def peak_kib() -> int:
        # VmHWM: this process's own peak RSS. ru_maxrss would do, but Linux carries the parent's
        # peak into it across fork+exec, so a child of a large pytest starts "at" pytest's peak.
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1])
        except OSError:
            pass
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    files = sorted(os.listdir(case_dir))
    for warm in (VECTOR, os.path.join(TWO_RANK)):
        if os.path.exists(warm):
            with hf.open(warm) as s:
                (s.verify() if isinstance(s, hf.Snapshot) else [r.verify() for r in s.ranks.values()])
    base = peak_kib()
    out = {"baseline_kib": base, "cases": {}}
    for name in files:
        p = os.path.join(case_dir, name)
        before = peak_kib()
        try:
            snap = hf.open(p)
        except hf.HsnapError as e:
            res = {"refused": type(e).__name__, "message": str(e)[-160:]}
        except BaseException as e:  # noqa: BLE001 - reported, the test fails
            res = {"untyped": type(e).__name__, "message": str(e)[-300:]}
        else:
            snap.close()
            res = {"opened": True}
        res["peak_growth_kib"] = peak_kib() - before
        out["cases"][name] = res
    out["peak_delta_kib"] = peak_kib() - base
    print(json.dumps(out))


def test_hostile_claims_are_refused_within_bounded_memory(tmp_path):
    files = {}
    for name, data in {**_cases(str(tmp_path)), **_manifest_cases()}.items():
        safe = "".join(c if c.isalnum() else "_" for c in name)[:80]
        if name.startswith("manifest"):
            d = tmp_path / "cases" / safe
            d.mkdir(parents=True)
            for r in (0, 1):
                src = os.path.join(TWO_RANK, f"rank-{r}.hsnap")
                if os.path.exists(src):
                    with open(src, "rb") as f:
                        (d / f"rank-{r}.hsnap").write_bytes(f.read())
            (d / "manifest.json").write_bytes(data)
        else:
            (tmp_path / "cases").mkdir(exist_ok=True)
            (tmp_path / "cases" / safe).write_bytes(data)
        files[safe] = name
    proc = subprocess.run([sys.executable, __file__, "child", str(tmp_path / "cases")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    lines = []
    for safe, res in out["cases"].items():
        assert "untyped" not in res and "opened" not in res, (files[safe], res)
        lines.append(f"  {files[safe][:70]:<70} {res['refused']:<24} +{res['peak_growth_kib'] / 1024:.1f} MiB")
    print(f"\n{len(out['cases'])} hostile files refused; peak RSS +{out['peak_delta_kib'] / 1024:.1f} MiB over baseline "
          f"{out['baseline_kib'] / 1024:.0f} MiB (bound {BOUND_MIB} MiB)\n" + "\n".join(lines))
    assert out["peak_delta_kib"] < BOUND_MIB * 1024


if __name__ == "__main__":
    if sys.argv[1] == "child":
        sys.path.insert(0, ROOT)
        _child(sys.argv[2])

#!/usr/bin/env python3
"""Build the golden vectors of ``spec/hsnap-v1.md`` from their JSON descriptions.

    python spec/vectors/generate.py            # rewrite the vectors and the derived fields of each JSON
    python spec/vectors/generate.py --check    # rebuild into a temp dir; exit 1 on any difference

Each ``<name>.json`` is the source of truth for what its vector holds:

===================  ===========================================================
input (hand-edited)  ``identity``, ``geometry``, ``features.optional``,
                     ``request`` (the header's request object), and for every
                     section its ``name`` and ``values`` (row-major, logical
                     numbers: a bf16 or fp8 value is written as the number it
                     decodes to)
derived (written     every other key: the section table (kind, layer, dtype,
back by this tool)   shape, offset, length, digest), ``hex`` (the section's
                     exact bytes) and ``expected`` (preamble fields, digests,
                     the first 64 and last 64 bytes of the file)
===================  ===========================================================

The bytes depend only on the description: ``created_at`` and ``snapshot_id``
are part of it, temporary names never reach the file, and the writer is
deterministic. ``two-rank.json``, ``hybrid-tp2.json``, ``mamba2-tp2.json`` and
``kda-tp2.json`` describe directories: a manifest and one rank description per rank.
``hybrid-tp2`` (GDN), ``mamba2-tp2`` (Mamba2, n_groups 1 < tp: B and C replicated) and
``kda-tp2`` (Kimi-Linear KDA: conv stored transposed, ``conv_slice_axis`` 1) are
format-1.1 vectors (``geometry.sharding``, feature ``tp-sharding``, preamble minor 1).

``chain.json`` and ``chain-tp2.json`` (format 1.2, feature ``delta``, spec 5.9) describe
snapshot chains: ``links``, a plain snapshot then two deltas, each a rank description
(``chain``: files ``chain-base.hsnap``, ``chain-delta-1.hsnap``, ``chain-delta-2.hsnap``)
or a directory description (``chain-tp2``: sets ``chain-tp2-base/`` ...). Built in
order: each delta's ``base`` (and so its section shapes) is derived from the link
before it — its name, root digest, snapshot id, position and depth.

``pages.json`` (format 1.3, feature ``pages``, spec 5.10, 5.11) describes snapshots whose
full pages live once in a page store (``store``, ``page_size``): each snapshot's input is
its ``state`` — every state section *whole*, as a plain snapshot would hold it — and its
record values; the generator puts the pages (one object per page, shared ones once) and
writes each file with only its other rows. Derived: each file's description and, in
``pages``, one description per page object (its ``namespace`` and ``page`` keys instead
of identity, geometry and request).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # usable from a plain checkout

import numpy as np  # noqa: E402

from hsnap_format import records  # noqa: E402
from hsnap_format.chain import base_ref  # noqa: E402
from hsnap_format.layout import state_sections  # noqa: E402
from hsnap_format.manifest import SetWriter, SnapshotSet  # noqa: E402
from hsnap_format.reader import Snapshot  # noqa: E402
from hsnap_format.spec import DTYPES, MANIFEST_NAME, PREAMBLE, TRAILER  # noqa: E402
from hsnap_format.writer import write_snapshot  # noqa: E402

VECTORS = ("attention-only", "hybrid", "mla-fp8", "two-rank", "hybrid-tp2", "chain", "chain-tp2", "pages", "mamba2-tp2", "kda-tp2", "parallel")
HEADER_KEYS = ("format", "features", "digest", "identity", "geometry", "request", "base", "pages", "sections")  # base: 1.2; pages: 1.3
PAGE_HEADER_KEYS = ("format", "features", "digest", "namespace", "page", "sections")  # a page object (1.3, spec 5.11)
AUTO_FEATURES = {"sampler-rng-state", "top-logprobs", "tp-sharding"}  # added by the writer itself


class VectorError(Exception):
    pass


# ----------------------------------------------------------------------------- build


def _array(values, dtype: str, shape, name: str) -> np.ndarray:
    dt = DTYPES[dtype]
    if dt.kind in "iub":
        arr = np.array(values, dtype=np.int64)
        out = arr.astype(dt)
        exact = np.array_equal(out.astype(np.int64), arr)
    else:
        arr = np.array(values, dtype=np.float64)
        out = arr.astype(dt)
        exact = np.array_equal(out.astype(np.float64), arr)
    if not exact:
        raise VectorError(f"{name}: values not exactly representable as {dtype}")
    if out.size != int(np.prod(shape)):
        raise VectorError(f"{name}: {out.size} values for shape {list(shape)}")
    return out.reshape(shape)


def rank_inputs(desc: dict, base: records.BaseRef | None = None) -> dict:
    """The writer's arguments, from a rank description (``base``: a delta's, spec 5.9)."""
    identity = records.Identity.from_header(desc["identity"])
    # the one required feature the geometry itself implies (the writer adds it again): a layer in both groups
    geometry = records.Geometry.from_header(desc["geometry"], parallel_layers="parallel-layers" in desc["features"]["required"])
    req = records.request_header_fields(desc["request"])
    fields, counts = req["fields"], req["counts"]
    swa_start = desc["request"].get("swa_start", 0)
    values = {s["name"]: s["values"] for s in desc["sections"]}
    n_out, k = counts["output_tokens"], counts["top_logprobs_k"]

    def get(name, dtype, shape):
        return None if name not in values else _array(values[name], dtype, shape, name)

    record = records.RequestRecord(
        prompt_ids=get("request.prompt_ids", "int32", (counts["prompt_tokens"],)),
        output_ids=get("request.output_ids", "int32", (n_out,)),
        output_logprobs=get("request.output_logprobs", "float32", (n_out,)),
        top_logprob_ids=get("request.top_logprob_ids", "int32", (n_out, k)),
        top_logprob_values=get("request.top_logprob_values", "float32", (n_out, k)),
        rng_state=None if "request.rng_state" not in values else bytes(values["request.rng_state"]),
        **fields,
    )
    base_position = 0 if base is None else base.state_position
    state = {
        spec.name: _array(values[spec.name], spec.dtype, spec.shape, spec.name)
        for spec in state_sections(geometry, fields["state_position"], swa_start, base_position)
    }
    optional = [f for f in desc.get("features", {}).get("optional", []) if f not in AUTO_FEATURES]
    return dict(identity=identity, geometry=geometry, record=record, state=state, swa_start=swa_start, features_optional=optional,
                base=base)


def write_rank(desc: dict, path: Path, base: records.BaseRef | None = None) -> None:
    write_snapshot(path, **rank_inputs(desc, base))


def _values(arr: np.ndarray) -> list:
    flat = arr.reshape(-1)
    if flat.dtype.kind in "iub":
        return [int(x) for x in flat]
    return [float(x) for x in flat.astype(np.float64)]


def describe_rank(path: Path, desc: dict, *, opener=Snapshot, keys=HEADER_KEYS) -> dict:
    """The description of a written rank file (or page object): the inputs of ``desc`` plus
    every derived field."""
    data = path.read_bytes()
    with opener(path) as snap:
        out = {k: desc[k] for k in ("description", "file") if k in desc}
        out.update({k: snap.header[k] for k in keys if k != "sections" and k in snap.header})
        if "state" in desc:  # a paged file's input: its whole sections (spec 5.10)
            out["state"] = desc["state"]
        out["sections"] = []
        for s in snap.sections:
            row = {k: v for k, v in zip(("name", "kind", "layer", "dtype", "shape", "offset", "length", "digest"),
                                        (s.name, s.kind, s.layer, s.dtype, list(s.shape), s.offset, s.length, s.digest))}
            row["values"] = _values(np.array(snap[s]))
            row["hex"] = bytes(snap.raw(s)).hex()
            out["sections"].append(row)
        pre = PREAMBLE.unpack(data[: PREAMBLE.size])
        out["expected"] = {
            "version": [pre[1], pre[2]],
            "header_length": snap.preamble.header_length,
            "data_offset": snap.preamble.data_offset,
            "file_length": snap.file_length,
            "payload_bytes": sum(s.length for s in snap.sections if s.is_state),
            "section_count": len(snap.sections),
            "header_digest": snap.preamble.header_digest.hex(),
            "root_digest": snap.root_digest,
            "preamble_check": f"{pre[8]:016x}",
            "trailer_check": f"{TRAILER.unpack(data[-TRAILER.size:])[5]:016x}",
            "first_64_bytes_hex": data[:64].hex(),
            "last_64_bytes_hex": data[-64:].hex(),
        }
    return out


def build(name: str, desc: dict, outdir: Path, base=None) -> dict:
    """Write vector ``name`` under ``outdir``; return its full description. ``base``: the
    link below (a chain's delta, spec 5.9): its path, a file or a set directory."""
    if "snapshots" in desc:  # files that store their full pages once (1.3)
        return build_paged(desc, outdir)
    if "links" in desc:  # a chain (1.2): each link built on the one before it
        out = {k: desc[k] for k in ("description",)}
        out["links"], below = [], None
        for link in desc["links"]:
            out["links"].append(build(name, link, outdir, below))
            below = outdir / artifact(name, link)
        return out
    if "directory" in desc:  # a TP set: two-rank (1.0), hybrid-tp2 / mamba2-tp2 / kda-tp2 (1.1, geometry.sharding)
        target = outdir / desc["directory"]
        sw = SetWriter(target, staging=None)
        try:
            for r, rank_desc in enumerate(desc["ranks"]):
                write_rank(rank_desc, Path(sw.rank_path(r)), _base_of(base, r))
            sw.commit(tp_size=len(desc["ranks"]), fsync=False)
        except BaseException:
            sw.abort()
            raise
        os.chmod(target, 0o755)
        with SnapshotSet(target) as ss:
            m = ss.manifest
        manifest_bytes = (target / MANIFEST_NAME).read_bytes()
        out = {k: desc[k] for k in ("description", "directory")}
        out["manifest"] = json.loads(manifest_bytes.split(b"\n")[0])
        out["manifest_text"] = manifest_bytes.decode("utf-8")
        out["ranks"] = []
        for r, rank_desc in enumerate(desc["ranks"]):
            p = target / m.ranks[r].file
            os.chmod(p, 0o644)
            out["ranks"].append(describe_rank(p, rank_desc))
        os.chmod(target / MANIFEST_NAME, 0o644)
        return out
    path = outdir / desc["file"]
    write_rank(desc, path, _base_of(base, None))
    os.chmod(path, 0o644)
    return describe_rank(path, desc)


def build_paged(desc: dict, outdir: Path) -> dict:
    """``pages.json``: every snapshot written with its full pages put once in the page store."""
    from hsnap_format.pages import PageStore, open_page, write_paged_snapshot

    store_dir = outdir / desc["store"]
    out = {k: desc[k] for k in ("description", "store", "page_size")}
    out["snapshots"] = []
    with PageStore(store_dir, page_size=desc["page_size"]) as store:
        for snap_desc in desc["snapshots"]:
            inputs = rank_inputs({**snap_desc, "sections": snap_desc["sections"] + [{"name": k, "values": v} for k, v in snap_desc["state"].items()]})
            path = outdir / snap_desc["file"]
            write_paged_snapshot(path, identity=inputs["identity"], geometry=inputs["geometry"], record=inputs["record"],
                                 state={k: _whole(v, inputs, k) for k, v in snap_desc["state"].items()}, pages=store,
                                 swa_start=inputs["swa_start"], features_optional=inputs["features_optional"])
            os.chmod(path, 0o644)
            out["snapshots"].append(describe_rank(path, snap_desc))
    (store_dir / "refs").rmdir()  # the session's markers are gone: nothing of them in the vector
    out["pages"] = []
    for p in sorted(store_dir.iterdir()):
        os.chmod(p, 0o644)
        out["pages"].append(describe_rank(p, {"file": f"{desc['store']}/{p.name}"}, opener=lambda q: open_page(str(q)), keys=PAGE_HEADER_KEYS))
    os.chmod(store_dir, 0o755)
    return out


def _whole(values, inputs: dict, name: str) -> np.ndarray:
    """A state section whole (spec 5.10: what a plain snapshot at its position holds)."""
    from hsnap_format.layout import state_sections

    spec = next(s for s in state_sections(inputs["geometry"], inputs["record"].state_position, inputs["swa_start"]) if s.name == name)
    return _array(values, spec.dtype, spec.shape, name)


def _base_of(base: Path | None, rank: int | None) -> records.BaseRef | None:
    """The ``base`` a delta of ``base`` writes: of its rank ``rank`` when it is a set."""
    if base is None:
        return None
    if rank is None:
        with Snapshot(base) as snap:
            return base_ref(snap, base.name)
    with SnapshotSet(base, ranks=[rank]) as ss:
        return base_ref(ss.ranks[rank], base.name)


# ----------------------------------------------------------------------------- JSON text


def _inline(obj) -> bool:
    return not isinstance(obj, (dict, list)) or (
        isinstance(obj, list) and all(not isinstance(x, dict) and (not isinstance(x, list) or all(not isinstance(y, (dict, list)) for y in x)) for x in obj)
    )


def render(obj, indent: int = 0) -> str:
    """JSON with scalar lists on one line (the values arrays), everything else one key a line."""
    pad = "  " * indent
    if _inline(obj) or (isinstance(obj, dict) and not obj):
        return json.dumps(obj, ensure_ascii=False)
    if isinstance(obj, dict):
        items = [f"{pad}  {json.dumps(k)}: {render(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    items = [f"{pad}  {render(v, indent + 1)}" for v in obj]
    return "[\n" + ",\n".join(items) + "\n" + pad + "]"


def load(name: str) -> dict:
    return json.loads((HERE / f"{name}.json").read_text(encoding="utf-8"))


def artifact(name: str, desc: dict) -> str:
    return desc["directory"] if "directory" in desc else desc["file"]


def artifacts(name: str, desc: dict) -> list[str]:
    """The files and directories of a vector (a chain has one per link; paged files, each
    file and their page store)."""
    if "snapshots" in desc:
        return [d["file"] for d in desc["snapshots"]] + [desc["store"]]
    return [artifact(name, d) for d in desc["links"]] if "links" in desc else [artifact(name, desc)]


# ----------------------------------------------------------------------------- main


def _compare(a: Path, b: Path) -> list[str]:
    """Byte-for-byte comparison of two files or directory trees."""
    if a.is_dir() or b.is_dir():
        if not (a.is_dir() and b.is_dir()):
            return [f"{b}: not the same kind of entry"]
        names = sorted(set(os.listdir(a)) | set(os.listdir(b)))
        return [d for n in names for d in _compare(a / n, b / n)]
    if not b.exists():
        return [f"{b}: missing"]
    if not a.exists():
        return [f"{b}: unexpected"]
    if not filecmp.cmp(a, b, shallow=False):
        return [f"{b}: bytes differ from the regenerated vector"]
    return []


def check(names=VECTORS) -> list[str]:
    """Rebuild every vector in a temp dir; return the differences from the committed ones."""
    problems = []
    with tempfile.TemporaryDirectory(prefix="hsnap-vectors-") as tmp:
        for name in names:
            desc = load(name)
            full = build(name, desc, Path(tmp))
            for art in artifacts(name, desc):
                problems += _compare(Path(tmp) / art, HERE / art)
            text = (HERE / f"{name}.json").read_text(encoding="utf-8")
            if render(full) + "\n" != text:
                problems.append(f"{HERE / (name + '.json')}: derived fields differ from the regenerated description")
    return problems


def regenerate(names=VECTORS) -> None:
    with tempfile.TemporaryDirectory(prefix="hsnap-vectors-", dir=HERE) as tmp:
        for name in names:
            desc = load(name)
            full = build(name, desc, Path(tmp))
            for art in artifacts(name, desc):
                dest = HERE / art
                if dest.is_dir():
                    shutil.rmtree(dest)
                elif dest.exists():
                    dest.unlink()
                os.replace(Path(tmp) / art, dest)
                print(f"wrote {dest.relative_to(HERE.parent.parent)}")
            (HERE / f"{name}.json").write_text(render(full) + "\n", encoding="utf-8")
            print(f"wrote {name}.json")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="regenerate into a temp dir and compare, byte for byte")
    ap.add_argument("names", nargs="*", default=list(VECTORS), help=f"vectors (default: all of {', '.join(VECTORS)})")
    args = ap.parse_args(argv)
    unknown = set(args.names) - set(VECTORS)
    if unknown:
        ap.error(f"unknown vectors {sorted(unknown)}")
    if args.check:
        problems = check(args.names)
        for p in problems:
            print(f"MISMATCH {p}", file=sys.stderr)
        if not problems:
            print(f"OK {len(args.names)} vectors regenerate byte for byte")
        return 1 if problems else 0
    regenerate(args.names)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``hsnap export``: sections out to ``.npy`` files or one ``.safetensors`` file.

Bytes are read with pread and hashed while they stream out: an export of a
section that fails its digest is refused and leaves no file behind. Outputs are
written under a temporary name and renamed into place, never over an existing
file. numpy has no bfloat16 or float8 ``.npy`` type: those sections are written
as float32 (exact: every bf16/fp8 value is a float32), or with ``raw=True`` as
their bit patterns (uint16/uint8). safetensors carries bf16 and the OCP fp8
types natively; fnuz fp8 goes out as its bytes (U8), named in the metadata.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import struct
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from . import _fs
from .errors import DigestMismatchError, HsnapError, HsnapIOError, Phrase, SnapshotExistsError
from .manifest import SnapshotSet
from .reader import SectionInfo, Snapshot
from .spec import DTYPES

CHUNK_ELEMENTS = 1 << 20

# hsnap dtype -> safetensors dtype (None: written as its bytes, U8)
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": None, "float8_e5m2fnuz": None,
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
}


class UnknownSectionError(HsnapError, KeyError):
    """The section (or rank) named on the command line is not in the snapshot."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


def npy_dtype(dtype: str, raw: bool = False) -> np.dtype:
    """The .npy element type of a section: itself when numpy knows it, else float32 (or its bits)."""
    dt = DTYPES[dtype]
    if dt.kind in "fiub":
        return dt
    return np.dtype(f"<u{dt.itemsize}") if raw else np.dtype("<f4")


def _convert(chunk: np.ndarray, target: np.dtype) -> np.ndarray:
    if chunk.dtype == target:
        return chunk
    if target.kind == "u" and chunk.dtype.kind not in "iub":  # raw bits of bf16/fp8
        return chunk.view(target)
    return chunk.astype(target)


@dataclass(frozen=True)
class Exported:
    rank: int
    name: str
    dtype: str  # the section's dtype
    stored_as: str  # what the file holds
    shape: tuple[int, ...]
    digest: str
    path: str


def ranks_of(snap: Snapshot | SnapshotSet) -> dict[int, Snapshot]:
    return dict(snap.ranks) if isinstance(snap, SnapshotSet) else {snap.identity.tp_rank: snap}


def find_section(snap: Snapshot | SnapshotSet, spec: str, rank: int | None = None) -> tuple[int, Snapshot, SectionInfo]:
    """``attn.3.k`` (the lowest rank, or ``rank``) or ``rank1/attn.3.k``."""
    ranks = ranks_of(snap)
    name = spec
    if "/" in spec and spec.startswith("rank"):
        head, name = spec.split("/", 1)
        try:
            rank = int(head[4:])
        except ValueError:
            raise UnknownSectionError(snap.path, "section", "rankN/name", spec) from None
    r = min(ranks) if rank is None else rank
    if r not in ranks:
        raise UnknownSectionError(snap.path, "rank", sorted(ranks), r)
    s = ranks[r]
    if name not in s:
        close = [x.name for x in s.sections if name in x.name][:5]
        raise UnknownSectionError(s.path, "section", Phrase(", ".join(close) + " ..." if close else "a section name (hsnap info lists them)"), name)
    return r, s, s.section(name)


def _verified_chunks(snap: Snapshot, info: SectionInfo, cancelled=None) -> Iterable[np.ndarray]:
    for _, chunk in snap.iter_chunks(info, CHUNK_ELEMENTS, verify=True, cancelled=cancelled):
        yield chunk


class _Output:
    """A file written under a temporary name next to its final name, renamed into place
    without replacing anything; dropped on any failure."""

    def __init__(self, path: str, force: bool = False) -> None:
        self.path, self.force = path, force
        if os.path.lexists(path) and not force:
            raise SnapshotExistsError(path, "output", "no file of that name (hsnap export never overwrites; --force does)", Phrase("one exists"))
        head, tail = os.path.split(os.path.abspath(path))
        self.tmp = os.path.join(head, f".{tail}.export-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            self.f = open(self.tmp, "xb")
        except OSError as e:
            raise HsnapIOError(path, "create", e) from None

    def write(self, data) -> None:
        try:
            self.f.write(data)
        except OSError as e:
            self.drop()
            raise HsnapIOError(self.path, "write", e) from None

    def commit(self) -> None:
        try:
            self.f.close()
            if self.force:
                os.replace(self.tmp, self.path)
            else:
                _fs.rename_noreplace(self.tmp, self.path)
        except OSError as e:
            self.drop()
            raise HsnapIOError(self.path, "rename", e) from None
        except BaseException:
            self.drop()
            raise

    def drop(self) -> None:
        try:
            self.f.close()
        except OSError:
            pass
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


def export_npy(snap: Snapshot, info: SectionInfo, path: str, *, raw: bool = False, force: bool = False,
               cancelled: Callable[[], bool] | None = None) -> Exported:
    """One section to a ``.npy`` file (streamed: bounded memory for any section size)."""
    target = npy_dtype(info.dtype, raw)
    out = _Output(path, force)
    try:
        header = {"descr": np.lib.format.dtype_to_descr(target), "fortran_order": False, "shape": tuple(info.shape)}
        buf = io.BytesIO()
        np.lib.format.write_array_header_1_0(buf, header)
        out.write(buf.getvalue())
        for chunk in _verified_chunks(snap, info, cancelled):
            out.write(_convert(chunk, target).tobytes())
        if cancelled is not None and cancelled():
            raise KeyboardInterrupt
        out.commit()
    except BaseException:
        out.drop()
        raise
    return Exported(0, info.name, info.dtype, target.name, info.shape, info.digest, path)


def _st_entry(info: SectionInfo) -> tuple[str, np.dtype]:
    st = SAFETENSORS_DTYPES[info.dtype]
    return (st, DTYPES[info.dtype]) if st is not None else ("U8", np.dtype("u1"))


def export_safetensors(snap: Snapshot | SnapshotSet, path: str, *, force: bool = False,
                       cancelled: Callable[[], bool] | None = None) -> list[Exported]:
    """Every section of every rank into one safetensors file; tensors are named
    ``name`` (one rank) or ``rankN/name``; the metadata names the snapshot."""
    ranks = ranks_of(snap)
    multi = len(ranks) > 1
    entries, offset, meta = {}, 0, {}
    plan = []
    for r, s in sorted(ranks.items()):
        for info in s.sections:
            key = f"rank{r}/{info.name}" if multi else info.name
            st, _ = _st_entry(info)
            n = info.length
            shape = list(info.shape) if SAFETENSORS_DTYPES[info.dtype] is not None else [info.length]
            entries[key] = {"dtype": st, "shape": shape, "data_offsets": [offset, offset + n]}
            if SAFETENSORS_DTYPES[info.dtype] is None:
                meta[f"hsnap.dtype.{key}"] = f"{info.dtype} {list(info.shape)} (bytes)"
            offset += n
            plan.append((r, s, info, key))
    first = ranks[min(ranks)]
    meta.update({"hsnap.model_id": first.identity.model_id, "hsnap.snapshot_id": first.identity.snapshot_id,
                 "hsnap.state_position": str(first.state_position), "format": "np"})
    header = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    out = _Output(path, force)
    done = []
    try:
        out.write(struct.pack("<Q", len(header)) + header)
        for r, s, info, key in plan:
            for chunk in _verified_chunks(s, info, cancelled):
                out.write(chunk.tobytes())
            if cancelled is not None and cancelled():
                raise KeyboardInterrupt
            done.append(Exported(r, info.name, info.dtype, entries[key]["dtype"], info.shape, info.digest, f"{path}:{key}"))
        out.commit()
    except BaseException:
        out.drop()
        raise
    return done


def export_all_npy(snap: Snapshot | SnapshotSet, directory: str, *, raw: bool = False, force: bool = False,
                   cancelled: Callable[[], bool] | None = None) -> list[Exported]:
    """One ``.npy`` per section (``rank-N/`` subdirectories for a snapshot directory) and an
    ``index.json`` naming each file's section, dtypes, shape and digest."""
    ranks = ranks_of(snap)
    multi = len(ranks) > 1
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise HsnapIOError(directory, "mkdir", e) from None
    done = []
    for r, s in sorted(ranks.items()):
        sub = os.path.join(directory, f"rank-{r}") if multi else directory
        if multi:
            try:
                os.makedirs(sub, exist_ok=True)
            except OSError as e:
                raise HsnapIOError(sub, "mkdir", e) from None
        for info in s.sections:
            e = export_npy(s, info, os.path.join(sub, info.name + ".npy"), raw=raw, force=force, cancelled=cancelled)
            done.append(Exported(r, e.name, e.dtype, e.stored_as, e.shape, e.digest, os.path.relpath(e.path, directory)))
    index = {"snapshot": os.path.basename(os.path.normpath(snap.path)),
             "sections": [{"rank": e.rank, "name": e.name, "file": e.path, "dtype": e.dtype, "stored_as": e.stored_as,
                           "shape": list(e.shape), "digest": e.digest} for e in done]}
    out = _Output(os.path.join(directory, "index.json"), force)
    out.write((json.dumps(index, indent=2) + "\n").encode())
    out.commit()
    return done


def load_npy_as(path: str, dtype: str) -> np.ndarray:
    """Read an exported ``.npy`` back as the section's dtype (float32 -> bf16/fp8 is exact)."""
    arr = np.load(path, allow_pickle=False)
    dt = DTYPES[dtype]
    if arr.dtype == dt:
        return arr
    if arr.dtype.kind == "u" and arr.dtype.itemsize == dt.itemsize and dt.kind not in "iub":
        return arr.view(dt)
    return arr.astype(dt)


__all__ = ["UnknownSectionError", "Exported", "find_section", "export_npy", "export_all_npy", "export_safetensors",
           "load_npy_as", "npy_dtype", "SAFETENSORS_DTYPES", "DigestMismatchError"]

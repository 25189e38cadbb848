"""``hsnap export``: sections out to ``.npy`` files or one ``.safetensors`` file.

Bytes are read with pread and hashed while they stream out: an export of a
section that fails its digest is refused and leaves no file behind. Outputs are
written under a temporary name and renamed into place, never over an existing
file. numpy has no bfloat16 or float8 ``.npy`` type: those sections are written
as float32 (exact: every bf16/fp8 value is a float32), or with ``raw=True`` as
their bit patterns (uint16/uint8). safetensors carries bf16 and the OCP fp8
types natively; fnuz fp8 goes out as its bytes (U8), named in the metadata.

Every output is refused (:class:`ExportTargetError`) when it is the input snapshot or
lies inside it (by device and inode, symlinks resolved; ``force`` or not), or when
its name says another kind (``out.pt``). A directory export is all or nothing and
never follows a symlink inside the output directory (:func:`export_all_npy`).
"""

from __future__ import annotations

import io
import json
import os
import secrets
import stat
import struct
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from .. import localfs
from ..errors import DigestMismatchError, HsnapError, HsnapIOError, Phrase, SnapshotExistsError
from ..manifest import SnapshotSet
from ..reader import SectionInfo, Snapshot
from ..stores import store_for
from ..spec import DTYPES

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


class ExportTargetError(HsnapError):
    """The output cannot take the export: it is the input snapshot or inside it, a symlink
    inside the output directory, or a name of another kind (``out.pt``)."""


def _ext(path: str) -> str:
    return os.path.splitext(os.path.basename(os.path.normpath(path)))[1]


def _is_directory_intent(path: str) -> bool:
    """A directory name: ends in ``/``, is an existing directory, or has no extension."""
    return path.endswith(("/", os.sep)) or os.path.isdir(path) or not _ext(path)


# export kind -> (accepts this output name, what it accepts): one rule for the CLI and the viewer
_OUTPUT_NAMES = {
    "npy": (lambda p: p.endswith(".npy"), "a .npy file name (one section; --all writes a directory or a .safetensors file)"),
    "safetensors": (lambda p: p.endswith(".safetensors"), "a .safetensors file name"),
    "directory": (_is_directory_intent, "a directory (a name without an extension, or ending in /) or a .safetensors file"),
}


def _check_output_name(path: str, kind: str) -> None:
    accepts, what = _OUTPUT_NAMES[kind]
    if not accepts(path):
        raise ExportTargetError(path, "output", Phrase(what), path)


class _InputGuard:
    """The input snapshot's own inodes (the directory or file, and each rank file): an
    output that is one of them, or lies inside the input, is refused, --force or not."""

    def __init__(self, *snaps: Snapshot | SnapshotSet | None) -> None:
        given = [s for s in snaps if s is not None]
        self.path = given[-1].path  # the snapshot as opened (a directory rather than its rank file)
        self.ids: set[tuple[int, int]] = set()
        paths = [p for snap in given for p in [snap.path] + [s.path for s in ranks_of(snap).values()]]
        for p in paths:
            if store_for(p).local:  # an object-store input has no local inode
                try:
                    st = os.stat(p)
                except OSError:
                    continue
                self.ids.add((st.st_dev, st.st_ino))

    def check(self, out: str) -> None:
        """``out`` and every directory above it, symlinks resolved, by device and inode."""
        p = os.path.realpath(out)
        while True:
            try:
                st = os.stat(p)
            except OSError:
                pass
            else:
                if (st.st_dev, st.st_ino) in self.ids:
                    raise ExportTargetError(out, "output", Phrase(f"a path outside the input snapshot {self.path}"),
                                            Phrase("the input itself" if p == os.path.realpath(out) else f"a path inside it ({p})"))
            parent = os.path.dirname(p)
            if parent == p:
                return
            p = parent


class _Output:
    """A file written under a temporary name next to its final name, renamed into place
    without replacing anything (``force``: replacing the name itself, a symlink included,
    never what it points to); dropped on any failure."""

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
                localfs.rename_noreplace(self.tmp, self.path)
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


def _write_npy(snap: Snapshot, info: SectionInfo, out: _Output, raw: bool, cancelled) -> np.dtype:
    """The .npy bytes of one section, streamed (bounded memory for any section size)."""
    target = npy_dtype(info.dtype, raw)
    header = {"descr": np.lib.format.dtype_to_descr(target), "fortran_order": False, "shape": tuple(info.shape)}
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    out.write(buf.getvalue())
    for chunk in _verified_chunks(snap, info, cancelled):
        out.write(_convert(chunk, target).tobytes())
    if cancelled is not None and cancelled():
        raise KeyboardInterrupt
    return target


def export_npy(snap: Snapshot, info: SectionInfo, path: str, *, raw: bool = False, force: bool = False,
               cancelled: Callable[[], bool] | None = None, source: Snapshot | SnapshotSet | None = None) -> Exported:
    """One section to a ``.npy`` file (streamed: bounded memory for any section size).
    ``source``: the snapshot directory ``snap`` is a rank of, which ``path`` must stay out of too."""
    path = os.fspath(path)
    _check_output_name(path, "npy")
    _InputGuard(snap, source).check(path)
    out = _Output(path, force)
    try:
        target = _write_npy(snap, info, out, raw, cancelled)
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
    path = os.fspath(path)
    _check_output_name(path, "safetensors")
    _InputGuard(snap).check(path)
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
            plan.append((r, s, info, key, st))
    first = ranks[min(ranks)]
    meta.update({"hsnap.model_id": first.identity.model_id, "hsnap.snapshot_id": first.identity.snapshot_id,
                 "hsnap.state_position": str(first.state_position), "format": "np"})
    header = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    out = _Output(path, force)
    done = []
    try:
        out.write(struct.pack("<Q", len(header)) + header)
        for r, s, info, key, stored_as in plan:
            for chunk in _verified_chunks(s, info, cancelled):
                out.write(chunk.tobytes())
            if cancelled is not None and cancelled():
                raise KeyboardInterrupt
            done.append(Exported(r, info.name, info.dtype, stored_as, info.shape, info.digest, f"{path}:{key}"))
        out.commit()
    except BaseException:
        out.drop()
        raise
    return done


_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class _Staging:
    """A fresh directory that an export is written into: nothing in it was there before
    (so nothing in it is a symlink), and on failure exactly what was written is removed."""

    def __init__(self, parent: str, tail: str) -> None:
        self.path = os.path.join(parent, f".{tail}.export-{os.getpid()}-{secrets.token_hex(4)}")
        self.files: list[str] = []  # relative paths, in the order written (index.json last)
        self.dirs: list[str] = []
        self.outputs: list[_Output] = []
        try:
            os.mkdir(self.path, 0o777)  # the umask decides, as for the directory it becomes
        except OSError as e:
            raise HsnapIOError(self.path, "mkdir", e) from None

    def subdir(self, name: str) -> None:
        try:
            os.mkdir(os.path.join(self.path, name), 0o777)
        except OSError as e:
            raise HsnapIOError(os.path.join(self.path, name), "mkdir", e) from None
        self.dirs.append(name)

    def output(self, rel: str) -> _Output:
        out = _Output(os.path.join(self.path, rel))
        self.files.append(rel)
        self.outputs.append(out)
        return out

    def drop(self) -> None:
        """Remove what this export wrote, one by one (never a tree it did not make)."""
        for out in self.outputs:  # a temporary not yet renamed
            out.drop()
        for rel in self.files:
            try:
                os.unlink(os.path.join(self.path, rel))
            except OSError:
                pass
        for name in reversed(self.dirs):
            try:
                os.rmdir(os.path.join(self.path, name))
            except OSError:
                pass
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def _entry(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


class _Merge:
    """Moving a staged export into an existing directory: every name is checked before
    anything moves (an existing file: refused, or with ``force`` replaced; a symlink
    where a ``rank-N`` directory goes: always refused, never followed); directories
    are opened with O_NOFOLLOW and names moved relative to them."""

    def __init__(self, directory: str, force: bool, guard: _InputGuard) -> None:
        self.directory, self.force, self.guard = directory, force, guard
        try:
            self.fd = os.open(directory, _DIR_OPEN)
        except OSError as e:
            raise HsnapIOError(directory, "open", e) from None
        self.subdirs: dict[str, int] = {}

    def close(self) -> None:
        for fd in [self.fd, *self.subdirs.values()]:
            os.close(fd)
        self.subdirs.clear()

    def _subdir(self, name: str, create: bool) -> int | None:
        if name in self.subdirs:
            return self.subdirs[name]
        where = os.path.join(self.directory, name)
        st = _entry(self.fd, name)
        if st is None and not create:
            return None
        if st is None:
            try:
                os.mkdir(name, 0o777, dir_fd=self.fd)
            except OSError as e:
                raise HsnapIOError(where, "mkdir", e) from None
        elif not stat.S_ISDIR(st.st_mode):
            found = "a symlink (hsnap export never writes through one)" if stat.S_ISLNK(st.st_mode) else "a file"
            raise ExportTargetError(where, "output", Phrase("a directory or no entry"), Phrase(found))
        try:
            fd = os.open(name, _DIR_OPEN | os.O_NOFOLLOW, dir_fd=self.fd)
        except OSError as e:
            raise HsnapIOError(where, "open", e) from None
        self.guard.check(f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else where)
        self.subdirs[name] = fd
        return fd

    def check(self, rel: str) -> None:
        """May ``rel`` be placed? (Before anything is written.)"""
        sub, name = os.path.split(rel)
        fd = self._subdir(sub, create=False) if sub else self.fd
        st = None if fd is None else _entry(fd, name)
        where = os.path.join(self.directory, rel)
        if st is not None and not self.force:
            raise SnapshotExistsError(where, "output", "no file of that name (hsnap export never overwrites; --force does)", Phrase("one exists"))
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise ExportTargetError(where, "output", Phrase("a file or no entry"), Phrase("a directory"))
        if st is not None and (st.st_dev, st.st_ino) in self.guard.ids:  # an input named like an output
            raise ExportTargetError(where, "output", Phrase(f"a path outside the input snapshot {self.guard.path}"), Phrase("the input itself"))

    def move(self, staging: _Staging, rel: str) -> None:
        sub, name = os.path.split(rel)
        dst = self._subdir(sub, create=True) if sub else self.fd
        src = os.path.join(staging.path, rel)
        try:
            if self.force:  # replaces the name itself (a symlink too), never what it points to
                os.replace(src, name, dst_dir_fd=dst)
            else:  # link(2) fails on any existing name, a dangling symlink included
                os.link(src, name, dst_dir_fd=dst, follow_symlinks=False)
                os.unlink(src)
        except FileExistsError:
            raise SnapshotExistsError(os.path.join(self.directory, rel), "output", "no file of that name (hsnap export never overwrites; --force does)",
                                      Phrase("one appeared")) from None
        except OSError as e:
            raise HsnapIOError(os.path.join(self.directory, rel), "rename", e) from None


def export_all_npy(snap: Snapshot | SnapshotSet, directory: str, *, raw: bool = False, force: bool = False,
                   cancelled: Callable[[], bool] | None = None) -> list[Exported]:
    """One ``.npy`` per section (``rank-N/`` subdirectories for a snapshot directory) and an
    ``index.json`` naming each file's section, dtypes, shape and digest.

    All or nothing: everything is written into a fresh staging directory and placed only
    once every section verified and ``index.json`` is written. A new ``directory`` is the
    staging directory renamed; into an existing one the files are moved (``index.json``
    last) after every name was checked. A failure leaves nothing new and touches nothing
    that was there."""
    directory = os.fspath(directory)
    _check_output_name(directory, "directory")
    guard = _InputGuard(snap)
    guard.check(directory)
    ranks = ranks_of(snap)
    multi = len(ranks) > 1
    plan = [(r, s, info, os.path.join(f"rank-{r}", info.name + ".npy") if multi else info.name + ".npy")
            for r, s in sorted(ranks.items()) for info in s.sections]
    merge = None
    if os.path.lexists(directory):
        if not os.path.isdir(directory):
            raise ExportTargetError(directory, "output", Phrase("a directory or a new name"), Phrase("a file"))
        merge = _Merge(directory, force, guard)
    try:
        if merge is not None:
            for rel in [rel for *_, rel in plan] + ["index.json"]:
                merge.check(rel)
        norm = os.path.normpath(os.path.abspath(directory))
        staging = _Staging(directory if merge is not None else os.path.dirname(norm), os.path.basename(norm))
        try:
            done = []
            for r in sorted(ranks) if multi else ():
                staging.subdir(f"rank-{r}")
            for r, s, info, rel in plan:
                out = staging.output(rel)
                target = _write_npy(s, info, out, raw, cancelled)
                out.commit()
                done.append(Exported(r, info.name, info.dtype, target.name, info.shape, info.digest, rel))
            index = {"snapshot": os.path.basename(os.path.normpath(snap.path)),
                     "sections": [{"rank": e.rank, "name": e.name, "file": e.path, "dtype": e.dtype, "stored_as": e.stored_as,
                                   "shape": list(e.shape), "digest": e.digest} for e in done]}
            out = staging.output("index.json")
            out.write((json.dumps(index, indent=2) + "\n").encode())
            out.commit()
            if merge is None:
                localfs.rename_noreplace(staging.path, directory)  # one step: the whole directory appears
            else:
                for rel in staging.files:  # index.json last
                    merge.move(staging, rel)
        except BaseException:
            staging.drop()
            raise
        if merge is not None:
            staging.drop()  # now empty
        return done
    finally:
        if merge is not None:
            merge.close()


def load_npy_as(path: str, dtype: str) -> np.ndarray:
    """Read an exported ``.npy`` back as the section's dtype (float32 -> bf16/fp8 is exact)."""
    arr = np.load(path, allow_pickle=False)
    dt = DTYPES[dtype]
    if arr.dtype == dt:
        return arr
    if arr.dtype.kind == "u" and arr.dtype.itemsize == dt.itemsize and dt.kind not in "iub":
        return arr.view(dt)
    return arr.astype(dt)


__all__ = ["UnknownSectionError", "ExportTargetError", "Exported", "find_section", "export_npy", "export_all_npy", "export_safetensors",
           "load_npy_as", "npy_dtype", "SAFETENSORS_DTYPES", "DigestMismatchError"]

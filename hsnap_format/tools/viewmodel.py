"""Plain data for the CLI, ``--json`` and the viewer (no TUI here): snapshot
summaries, numbers printed so that two different values never read the same,
index/slice expressions, per-row norms of state sections, and a partial view of
a rank file whose header is intact but whose data is not all there."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..chain import Chain, chain_below
from ..claims import read_claim
from ..errors import BadMagicError, HsnapError, TruncatedError
from ..errors import escape_text as escape  # one rule for the CLI, the viewer and error messages
from ..layout import PAGED_KINDS, ROW_KINDS, first_position, inline_runs, page_range
from ..manifest import SnapshotSet
from ..reader import PENDING_FOUND, Snapshot, SectionInfo
from ..spec import DTYPES, MAGIC, PENDING_MAGIC, PREAMBLE, STAGING_DIR_MARK, TMP_FILE_MARK, TRAILER
from ..stores import open_snapshot, store_for
from ..stores.entries import Listing, list_directory
from .stats import Cancelled, is_float

# ---------------------------------------------------------------------------- summaries


def rank_summary(snap: Snapshot) -> dict:
    return {
        "path": snap.path,
        "version": f"{snap.version[0]}.{snap.version[1]}",
        "identity": snap.header["identity"],
        "geometry": snap.header["geometry"],
        "request": snap.header["request"],
        "features": snap.header["features"],
        "base": snap.header.get("base"),  # a delta's link (spec 5.9); None for a plain snapshot
        "pages": snap.header.get("pages"),  # its page store and references (spec 5.10); None when it holds all its rows
        "digest_algorithm": snap.header["digest"],
        "sections": [
            {"name": s.name, "kind": s.kind, "layer": s.layer, "dtype": s.dtype, "shape": list(s.shape),
             "offset": s.offset, "length": s.length, "digest": s.digest}
            for s in snap.sections
        ],
        "file_length": snap.file_length,
        "payload_bytes": snap.payload_bytes,
        "root_digest": snap.root_digest,
    }


def snapshot_summary(snap) -> dict:
    if isinstance(snap, SnapshotSet):
        m = snap.manifest
        return {
            "manifest": {"snapshot_id": m.snapshot_id, "state_position": m.state_position, "tp_size": m.tp_size,
                         "ranks": [{"rank": r.rank, "file": r.file, "length": r.length, "root_digest": r.root_digest} for r in m.ranks]},
            "ranks": [rank_summary(s) for s in snap.ranks.values()],
        }
    return {"manifest": None, "ranks": [rank_summary(snap)]}


def fmt_bytes(n: int) -> str:
    """1023 -> '1023 B', 81408 -> '79.5 KiB' (binary units, one decimal)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else many or word + 's'}"


# ---------------------------------------------------------------------------- values


def fmt_value(v, dtype: str | None = None) -> str:
    """A value as it is stored: float16/32/64 with the fewest digits that read back
    to the same value of that type (so two different values never print alike);
    bf16/fp8 with 6 significant digits (more than their precision); ints exactly."""
    if v is None:
        return "-"
    dt = DTYPES.get(dtype) if dtype else None
    if isinstance(v, (bool, np.bool_)):
        return str(bool(v))
    if isinstance(v, (int, np.integer)) and not (dt is not None and is_float(dt)):
        return str(int(v))
    x = float(v)
    if math.isnan(x) or math.isinf(x):
        return str(x)
    if dt is None or not is_float(dt):
        return repr(x)
    return str(np.asarray(x).astype(dt)[()])  # numpy: shortest round trip; ml_dtypes: %g


def value_bits(v, dtype: str) -> str | None:
    """The stored bit pattern of a value of a float or int dtype, in hex (``0xbf204a3c``)."""
    dt = DTYPES.get(dtype)
    if dt is None or v is None:
        return None
    raw = np.asarray(v).astype(dt).reshape(1).view(np.dtype(f"<u{dt.itemsize}"))[0]
    return f"0x{int(raw):0{2 * dt.itemsize}x}"


def ulp_distance(a, b, dtype: str) -> int | None:
    """How many representable values of ``dtype`` lie from a to b (1: neighbours);
    None for NaN, non-float dtypes or mixed signs of infinity."""
    dt = DTYPES.get(dtype)
    if dt is None or not is_float(dt) or a is None or b is None:
        return None
    if math.isnan(float(a)) or math.isnan(float(b)):
        return None
    bits = 8 * dt.itemsize
    sign = 1 << (bits - 1)

    def ordered(x) -> int:  # sign-magnitude bits -> a line where neighbours differ by 1
        u = int(np.asarray(x).astype(dt).reshape(1).view(np.dtype(f"<u{dt.itemsize}"))[0])
        return -(u & (sign - 1)) if u & sign else u

    return abs(ordered(a) - ordered(b))


def fmt_value_pair(a, b, dtype_a: str | None, dtype_b: str | None) -> str:
    """``A -0.6261478 B -0.62614775 (1 ulp, bits 0xbf204a3c/0xbf204a3b)``: enough to tell them apart."""
    text = f"A {fmt_value(a, dtype_a)} B {fmt_value(b, dtype_b)}"
    if dtype_a and dtype_a == dtype_b and a is not None and b is not None:
        extra = []
        ulp = ulp_distance(a, b, dtype_a)
        if ulp is not None:
            extra.append(plural(ulp, "ulp", "ulp"))
        ba, bb = value_bits(a, dtype_a), value_bits(b, dtype_a)
        if ba is not None and ba != bb:
            extra.append(f"bits {ba}/{bb}")
        if extra:
            text += f" ({', '.join(extra)})"
    return text


# ---------------------------------------------------------------------------- hints


def leftover_hint(error: BaseException) -> str | None:
    """A pointer to ``hsnap gc`` when what failed to open looks like the leftover of an
    interrupted write (a temporary name, a staging directory, or a file of zeros)."""
    if not isinstance(error, HsnapError) or not error.path:
        return None
    base = os.path.basename(os.path.normpath(error.path))
    looks_temp = TMP_FILE_MARK in base or STAGING_DIR_MARK in base
    zeros = isinstance(error, BadMagicError) and isinstance(error.found, (bytes, bytearray)) and not any(error.found)
    if (looks_temp or zeros) and "hsnap gc" not in str(error):
        where = os.path.dirname(os.path.normpath(error.path)) or "."
        return f"this looks like the leftover of an interrupted write: `hsnap gc {where}` lists what is safe to remove"
    return None


# ---------------------------------------------------------------------------- selections


class SelectionError(ValueError):
    """An index or slice expression typed by the user does not fit the section."""


_SELECTION = re.compile(r"\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._/-]*)?\s*(?:\[(?P<body>[^\]]*)\])?\s*\Z")
_INT = re.compile(r"\s*[-+]?\d+\s*\Z")


@dataclass(frozen=True)
class Selection:
    """Per axis an int (a fixed index) or a ``range`` (a slice, normalized)."""

    name: str | None
    axes: tuple[int | range, ...]

    @property
    def is_point(self) -> bool:
        return all(isinstance(a, int) for a in self.axes)

    def __str__(self) -> str:
        def one(a):
            if isinstance(a, int):
                return str(a)
            step = "" if a.step == 1 else f":{a.step}"
            return f"{a.start}:{a.stop}{step}"

        return f"{self.name or ''}[{', '.join(one(a) for a in self.axes)}]"


def parse_selection(text: str) -> tuple[str | None, list[str] | None]:
    """``attn.3.k[100:120, 0, :8]`` -> ("attn.3.k", ["100:120", "0", ":8"]); parsed, never eval'd."""
    m = _SELECTION.match(text)
    if m is None or (m.group("name") is None and m.group("body") is None):
        raise SelectionError(f"{text!r}: expected name[i, j:k, ...] or [i, j:k, ...]")
    body = m.group("body")
    return m.group("name"), None if body is None else [p for p in body.split(",")]


def resolve_selection(name: str | None, parts: list[str] | None, shape: tuple[int, ...]) -> Selection:
    """Apply parsed parts to ``shape``: missing trailing axes are whole (``:``), negative
    indices count from the end; anything outside the shape is a :class:`SelectionError`."""
    parts = [] if parts is None else [p for p in parts if p.strip() or len(parts) > 1]
    if len(parts) > len(shape):
        raise SelectionError(f"{len(parts)} indices for {len(shape)} axes (shape {list(shape)})")
    axes: list[int | range] = []
    for i, n in enumerate(shape):
        p = parts[i].strip() if i < len(parts) else ":"
        if _INT.match(p):
            k = int(p)
            k = k + n if k < 0 else k
            if not 0 <= k < n:
                raise SelectionError(f"axis {i}: index {p} outside 0..{n - 1}")
            axes.append(k)
            continue
        bits = p.split(":")
        if len(bits) not in (2, 3) or not all(b.strip() == "" or _INT.match(b) for b in bits):
            raise SelectionError(f"axis {i}: {p!r} is neither an index nor a slice a:b[:step]")
        start, stop, *rest = (None if b.strip() == "" else int(b) for b in bits)
        step = rest[0] if rest else None
        if step is not None and step <= 0:
            raise SelectionError(f"axis {i}: step {step} (only positive steps)")
        r = range(n)[slice(start, stop, step)]
        if len(r) == 0:
            raise SelectionError(f"axis {i}: {p!r} selects nothing of 0..{n - 1}")
        axes.append(r)
    return Selection(name, tuple(axes))


# ---------------------------------------------------------------------------- norms


# state kind -> (family label, what its first axis is); norms are over every other axis
NORM_FAMILIES = {
    "attn_k": ("attention K", "token"),
    "attn_v": ("attention V", "token"),
    "swa_k": ("SWA K", "token"),
    "swa_v": ("SWA V", "token"),
    "mla_kv": ("MLA latent", "token"),
    "conv": ("conv state", "channel"),
    "temporal": ("temporal state", "head"),
}

NORM_READ_BYTES = 8 << 20  # whole rows, about this much per pread


def row_norms(snap: Snapshot, info: SectionInfo, cancelled: Callable[[], bool] | None = None) -> np.ndarray:
    """L2 norm of every slice along the section's first axis (per token for K/V, per head
    for temporal state), in float64, read with pread (never a map). NaN/Inf propagate."""
    shape = info.shape
    rows = shape[0] if shape else 1
    per_row = math.prod(shape[1:]) if len(shape) > 1 else 1
    out = np.zeros(rows, dtype=np.float64)
    if per_row == 0 or rows == 0:
        return out
    step = max(1, NORM_READ_BYTES // max(1, per_row * DTYPES[info.dtype].itemsize))
    for r in range(0, rows, step):
        if cancelled is not None and cancelled():
            raise Cancelled()
        n = min(step, rows - r)
        chunk = snap.read(info, verify=False, start=r * per_row, count=n * per_row)
        x = chunk.astype(np.float64).reshape(n, per_row)
        with np.errstate(over="ignore", invalid="ignore"):
            out[r : r + n] = np.sqrt(np.einsum("ij,ij->i", x, x))
    return out


@dataclass(frozen=True)
class NormRow:
    layer: int
    name: str
    key: str
    norms: np.ndarray

    @property
    def all_zero(self) -> bool:
        return self.norms.size > 0 and not np.any(self.norms)


def norm_groups(sections) -> dict[str, list[SectionInfo]]:
    """State sections grouped by family (``attention K · per token``, ``conv state 0 · per
    channel``...) in the order of NORM_FAMILIES, layers in file order: one heatmap per
    group, one row per layer."""
    order = list(NORM_FAMILIES)
    keyed: dict[tuple[int, str], list[SectionInfo]] = {}
    for s in sections:
        fam = NORM_FAMILIES.get(s.kind)
        if fam is None:
            continue
        label, axis = fam
        if s.kind == "conv":
            label = f"{label} {s.name.rsplit('.', 1)[-1]}"
        keyed.setdefault((order.index(s.kind), f"{label} · per {axis}"), []).append(s)
    return {label: secs for (_, label), secs in sorted(keyed.items())}


# ---------------------------------------------------------------------------- partial view


class PartialSnapshot(Snapshot):
    """A rank file whose preamble and header are intact but whose data is not all there:
    truncated (a copy cut short) or an unfinished write (header written, magic not).

    It reads like a :class:`Snapshot` (pread only): a section that lies beyond the end of
    the file gives :class:`TruncatedError`, so the viewer can show which sections are
    intact (their digests still decide) and which are missing. Never used to restore."""

    def _load(self, pread) -> None:
        """Snapshot's open-time checks, tolerant of the end of the file: the preamble is
        checked against its own ``file_length``, and a missing trailer is allowed."""
        block = pread(PREAMBLE.size, 0)
        self.unfinished = block[: len(PENDING_MAGIC)] == PENDING_MAGIC
        if self.unfinished:  # commit writes everything but the magic first
            block = MAGIC + block[len(MAGIC):]
        if len(block) < PREAMBLE.size:
            raise TruncatedError(self.path, "preamble", PREAMBLE.size, len(block))
        self._load_header(pread, block, PREAMBLE.unpack(block)[7])  # every preamble check but the size
        pre = self.preamble
        tra = pread(TRAILER.size, pre.file_length - TRAILER.size) if self.size >= pre.file_length else b""
        self.root_digest = None
        if len(tra) == TRAILER.size:
            try:
                self._check_trailer(tra)
            except HsnapError:
                self.root_digest = None
        self._load_request()

    @property
    def state(self) -> str:
        return "unfinished write" if self.unfinished else "truncated" if self.size < self.file_length else "complete"

    def present(self, info: SectionInfo) -> bool:
        """Whether every byte of the section is in the file (its digest then decides)."""
        return info.offset + info.length <= self.size

    def describe(self) -> str:
        intact = sum(self.present(s) for s in self.sections)
        if self.unfinished:
            what = "an unfinished write (the writer stopped before its commit; `hsnap gc` lists it)"
        else:
            what = f"truncated: {self.size:,} of {self.file_length:,} bytes"
        return f"{what}; {intact} of {len(self.sections)} sections present, their digests decide"


def open_partial(path) -> PartialSnapshot:
    """A partial view of a rank file that :func:`open_snapshot` refused as truncated or
    unfinished; raises :class:`HsnapError` when not even the header is intact."""
    return PartialSnapshot(path)


def salvageable(error: BaseException) -> bool:
    """Whether a refusal is one a partial view may help with (data missing, header maybe intact)."""
    if isinstance(error, TruncatedError) and error.field in ("file_length",):
        return True
    return isinstance(error, BadMagicError) and error.found == PENDING_FOUND


# ---------------------------------------------------------------------------- chains and pages


def row_runs(snap: Snapshot, info: SectionInfo) -> list[tuple[int, int]]:
    """The request positions ``[a, b)`` whose rows an attention section of ``snap`` holds,
    in order (spec 5.4, 5.9, 5.10): a delta's start at its base's position, a sliding-window
    section's at ``swa_start``, and a paged file's full-attention rows skip its full pages.
    Empty for a section that is not a row of positions (recurrent state, the record)."""
    if info.kind not in ROW_KINDS:
        return []
    if snap.pages is not None and info.kind in PAGED_KINDS:
        return [r for r in inline_runs(snap.base_position, snap.state_position, snap.pages.page_size) if r[1] > r[0]]
    start = first_position(info.kind, snap.swa_start, snap.base_position)
    return [(start, snap.state_position)] if snap.state_position > start else []


def fmt_runs(runs: list[tuple[int, int]]) -> str:
    """``[(5, 8)]`` -> ``5..7``; several runs joined by commas."""
    return ", ".join(f"{a}..{b - 1}" for a, b in runs)


def fmt_rows(runs: list[tuple[int, int]], position: int) -> str:
    """``rows 280..296 of 297``: which of the request's positions a section holds."""
    return f"rows {fmt_runs(runs)} of {position}" if runs else f"no rows of {position}"


def paged_positions(snap: Snapshot) -> tuple[int, int] | None:
    """``[a, b)``: the positions whose full-attention rows ``snap`` takes from its page store
    (spec 5.10), or None when it holds them all."""
    if snap.pages is None or not snap.pages.count:
        return None
    first, count = page_range(snap.base_position, snap.state_position, snap.pages.page_size)
    return first * snap.pages.page_size, (first + count) * snap.pages.page_size


def open_rank_chains(snap: Snapshot | SnapshotSet, location: str) -> dict[int, Chain | HsnapError]:
    """Rank -> its chain (spec 7.5), opened and checked link by link through the store that
    holds ``location``, or the typed error that refused it: for every rank file that is a
    delta or takes pages from a page store. Plain ranks are left out. The caller closes the
    chains (each owns the links below its head; the head stays ``snap``'s)."""
    store = store_for(location)
    ranks = dict(snap.ranks) if isinstance(snap, SnapshotSet) else {snap.identity.tp_rank: snap}
    out: dict[int, Chain | HsnapError] = {}
    for r, s in ranks.items():
        if s.base is None and s.pages is None:
            continue
        try:
            out[r] = chain_below(s, location=snap.path, rank=r if isinstance(snap, SnapshotSet) else None, store=store)
        except HsnapError as e:
            out[r] = e
    return out


@dataclass(frozen=True)
class ChainProof:
    """:meth:`Chain.proof_failures` (the one proof ``hsnap verify``, a restore and a compaction
    make), sorted by what failed: ``links[i]`` the failures of link i (its bytes, padding,
    record, page keys), ``pages`` those of page references and page objects."""

    paths: tuple[str, ...]
    links: tuple[tuple[HsnapError, ...], ...]
    pages: tuple[HsnapError, ...]
    page_count: int

    @property
    def ok(self) -> bool:
        return not self.pages and not any(self.links)


def prove_chain(chain: Chain) -> ChainProof:
    """Make the chain's whole proof (every byte) and say which link or page each failure is about."""
    failures = chain.proof_failures()
    index = {os.path.normpath(link.path): i for i, link in enumerate(chain.links)}
    links: list[list[HsnapError]] = [[] for _ in chain.links]
    pages: list[HsnapError] = []
    for e in failures:
        i = index.get(os.path.normpath(e.path)) if e.path else None
        if i is None or (e.field or "").startswith("pages"):
            pages.append(e)
        else:
            links[i].append(e)
    count = sum(0 if link.pages is None else link.pages.count for link in chain.links)
    return ChainProof(tuple(link.path for link in chain.links), tuple(map(tuple, links)), tuple(pages), count)


# ---------------------------------------------------------------------------- directories of snapshots

# One entry of a directory of snapshots, as `hsnap info DIR --json` and the viewer's listing have it: every key in
# every entry, null where it does not apply (README: Command line)
ENTRY_KEYS = ("path", "kind", "tp_size", "rid", "state_position", "bytes", "delta", "paged", "checkpoints", "migration", "claimed",
              "error")


def error_summary(e: HsnapError) -> dict:
    """A typed error as ``--json`` reports it."""
    return {"error": type(e).__name__, "path": e.path, "field": e.field, "message": str(e)}


def entry_summary(path: str, listing: Listing) -> dict:
    """One entry of a directory of snapshots: its request, position and size (of a checkpoint chain, its newest
    committed link, how many links it has and which were passed over, and why); every key in every entry, null
    where it does not apply (``checkpoints`` outside a chain, the snapshot's fields of one that did not open)."""
    out: dict = dict.fromkeys(ENTRY_KEYS)
    out["path"] = path
    chain = next((c for c in listing.chains.values() if (c.path or c.highest) == path), None)
    if chain is not None:
        out["checkpoints"] = {"name": chain.name, "links": listing.links.get(chain.name, 0), "newest_committed": chain.path,
                              "passed_over": [[p, why] for p, why in chain.passed_over]}
    mig = listing.migration
    if mig is not None and mig.entry == path:
        out["migration"] = {"rounds": len(mig.rounds), "final": mig.final is not None, "outcome": mig.outcome}
    out["claimed"] = read_claim(store_for(path), path)  # resumed already (spec 8.3): by whom, when
    try:
        with open_snapshot(path) as snap:
            ranks = list(snap.ranks.values()) if isinstance(snap, SnapshotSet) else [snap]
            out.update(kind="TP set" if isinstance(snap, SnapshotSet) else "snapshot", tp_size=len(ranks),
                       rid=ranks[0].header["request"]["rid"], state_position=ranks[0].state_position,
                       bytes=sum(r.file_length for r in ranks), delta=ranks[0].base is not None, paged=ranks[0].pages is not None)
    except HsnapError as e:
        out["error"] = error_summary(e)
    return out


def entry_what(e: dict) -> str:
    """What an :func:`entry_summary` is, in a few words: a snapshot, a TP set of N ranks, a chain of N links."""
    if e["checkpoints"]:
        return f"chain of {plural(e['checkpoints']['links'], 'link')}"
    if e["migration"]:
        m = e["migration"]
        return f"migration, {plural(m['rounds'], 'round')}{' + final' if m['final'] else ''}: {m['outcome']}"
    return f"TP set of {e['tp_size']} ranks" if e["kind"] == "TP set" else "snapshot"


def claim_said(claim: dict) -> str:
    """An entry's claim in words: who resumed it and when."""
    if claim.get("unreadable"):
        return "claimed (its marker is not readable as a claim)"
    return f"resumed by {escape(claim['server'] or '?')} (host {escape(claim['host'] or '?')}) at {escape(claim['at'] or '?')}"


def entry_counts(entries: list[dict]) -> list[str]:
    """How many of each kind a directory's entries are (``hsnap info DIR`` and the viewer say it the same way)."""
    chains = sum(e["checkpoints"] is not None for e in entries)
    migrations = sum(e["migration"] is not None for e in entries)
    parts = [plural(len(entries) - chains - migrations, "snapshot"), plural(chains, "checkpoint chain")]
    return parts + ([plural(migrations, "live migration")] if migrations else [])


def directory_entries(path: str, storage_options=None) -> tuple[Listing, list[dict]]:
    """What a drain, a checkpointer or a migration left in ``path`` — :func:`.stores.entries.list_directory`, the
    listing a resume reads (each chain's newest link verified whole: every byte of it is read) — and one
    :func:`entry_summary` per entry, in its order. ``hsnap info DIR`` prints them; the viewer lists them."""
    listing = list_directory(path, storage_options=storage_options)
    return listing, [entry_summary(p, listing) for p in listing.entries()]


__all__ = [
    "row_runs", "fmt_runs", "fmt_rows", "paged_positions", "open_rank_chains", "ChainProof", "prove_chain",
    "escape", "rank_summary", "snapshot_summary", "fmt_bytes", "plural", "fmt_value", "value_bits", "ulp_distance",
    "fmt_value_pair", "leftover_hint", "SelectionError", "Selection", "parse_selection", "resolve_selection",
    "NORM_FAMILIES", "row_norms", "NormRow", "norm_groups", "PartialSnapshot", "open_partial", "salvageable",
    "ENTRY_KEYS", "error_summary", "entry_summary", "entry_what", "entry_counts", "claim_said", "directory_entries",
]

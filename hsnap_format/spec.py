"""Constants of the hsnap v1 format. The normative text is ``spec/hsnap-v1.md``;
this module restates it as tables so the reader and writer cannot drift apart.

File layout (all integers little-endian)::

    offset 0          preamble, 64 bytes (PREAMBLE below)
    offset 64         header: canonical JSON (RFC 8785), header_length bytes
    ...               zero padding up to data_offset (a multiple of ALIGNMENT)
    data_offset       section 0, then zero padding to the next multiple of ALIGNMENT,
                      section 1, ... (offsets recorded in the header's section table)
    end of last sec.  trailer, 64 bytes (TRAILER below); file_length = trailer end

The preamble and the trailer each end with an xxh3-64 check of their first 56
bytes, the header is covered by ``header_digest`` (in the preamble), every section
by its own digest (in the header), and the trailer's ``root_digest`` covers the
header digest and every section digest: any flipped bit anywhere is detected.
"""

from __future__ import annotations

import re
import struct

import ml_dtypes
import numpy as np

# Like PNG's: a high-bit byte catches 7-bit transfers, CR LF / LF catch newline
# translation, ^Z stops DOS `type`.
MAGIC = b"\x89HSN\r\n\x1a\n"
TRAILER_MAGIC = b"HSNAPEND"
MAJOR = 1
MINOR = 4  # the newest minor this library reads and writes (spec section 9)
BYTE_ORDER_MARK = 0x0A0B0C0D  # reads back as another number on a big-endian misread

# magic, major, minor, byte-order mark, header_length, data_offset,
# header_digest (16 bytes), file_length, preamble_check (xxh3-64 of bytes 0..55)
PREAMBLE = struct.Struct("<8sHHIQQ16sQQ")
# magic, file_length, section_count, root_digest (16), reserved (16 zero bytes),
# trailer_check (xxh3-64 of bytes 0..55)
TRAILER = struct.Struct("<8sQQ16s16sQ")
assert PREAMBLE.size == 64 and TRAILER.size == 64

HEADER_OFFSET = PREAMBLE.size
ALIGNMENT = 4096  # page size, O_DIRECT and GPUDirect Storage friendly
# A header holds geometry and the section table only (bulk arrays are sections),
# so even a 1000-layer model stays far below this. Refuse bigger before reading.
MAX_HEADER_BYTES = 1 << 20  # a 1000-layer hybrid header is about 350 KB
MAX_SECTIONS = 1 << 16
MAX_NDIM = 8
MAX_NAME_LENGTH = 128
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
MAX_JSON_DEPTH = 16

# Header value limits (spec section 5; rule R-5-1): a "string" field, and the stop rules
# of request.stop. Lengths are Unicode code points (spec section 4).
MAX_STRING_LENGTH = 4096
MAX_STOP_STRINGS = 1024
MAX_STOP_STRING_LENGTH = 4096
MAX_STOP_TOKEN_IDS = 1 << 16

DIGEST_ALGORITHMS = ("xxh3-128",)  # named in the header so it can change
DEFAULT_DIGEST = "xxh3-128"
DIGEST_HEX_LENGTH = 32

# Features: a reader refuses a file that requires one it does not know, and
# ignores unknown optional ones. Feature -> the minor that defined it: a writer
# stamps a file with the least minor that covers what it uses (spec section 9), so
# a file without 1.1 content stays byte-identical to what a 1.0 writer wrote.
FEATURE_MINOR = {
    "sampler-rng-state": 0,  # request.rng_state
    "top-logprobs": 0,  # request.top_logprob_ids / _values
    "tp-sharding": 1,  # geometry.sharding (spec 5.7)
    "delta": 2,  # a link of a snapshot chain: the header's base, attention rows after it (spec 5.9); required
    "pages": 3,  # full pages of attention rows in a page store, referenced by key (spec 5.10); required
    "parallel-layers": 4,  # a layer id in both attention and mamba: both mixers side by side (spec 5.2); required
}
KNOWN_FEATURES = frozenset(FEATURE_MINOR)
DELTA_FEATURE = "delta"
# A layer whose attention and Mamba mixer run side by side (FalconH1): its id is in an
# attention group and in mamba.layers, its sections are both groups' (spec 5.2, 5.4).
PARALLEL_LAYERS_FEATURE = "parallel-layers"
# A chain (spec 5.9, 7.5): at most this many links below a head (base.depth <= it), so a
# reader's walk down a chain is bounded before it opens anything; writers refuse deeper.
MAX_CHAIN_DEPTH = 1024
MAX_BASE_NAME_BYTES = 255  # base.name: one file or directory name (NAME_MAX)

# Pages stored once (spec 5.10, 7.6, 8.2; format 1.3, feature ``pages``): full pages of
# attention rows live as page objects in a page store beside the snapshots that reference
# them, named by namespace, SGLang's page hash chain and their own root digest.
PAGES_FEATURE = "pages"
PAGE_FORMAT = "hsnap-page"  # the header "format" of a page object (spec 5.11)
PAGE_SUFFIX = ".hpage"
# <namespace id: 64 hex>-<chain key: 64 hex>-<root digest: 32 hex>.hpage
PAGE_NAME_RE = re.compile(r"([0-9a-f]{64})-([0-9a-f]{64})-([0-9a-f]{32})\.hpage\Z")
NAMESPACE_DOMAIN = b"hsnap-page-namespace-v1\n"  # prefixes the JCS bytes hashed into a namespace id
PAGE_MARKERS_DIR = "refs"  # inside a page store: pending-reference and sweep markers (spec 8.2)
PENDING_REFS_SUFFIX = ".pending-refs"
SWEEP_SUFFIX = ".sweep"
MAX_MARKER_BYTES = 64 << 20
# A page object's header lists its S token ids (up to 11 bytes of JSON each, "2147483647,"):
# 2^16 of them take at most 720,896 bytes, leaving 320 KiB of the 1 MiB header for the
# namespace and section table; a larger S could make a page no reader opens (spec 5.10).
MAX_PAGE_SIZE = 1 << 16
# One reference ["<64 hex>","<32 hex>"], is 104 bytes of header JSON: more than this many
# cannot fit in a 1 MiB header, so a writer refuses them before computing any key.
MAX_PAGE_REFS = MAX_HEADER_BYTES // 104

# Logical element types: name -> numpy dtype. bf16 and fp8 come from ml_dtypes,
# so sections of those types are usable arrays, not raw integers.
DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype("<f8"),
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "float8_e4m3fnuz": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "float8_e5m2fnuz": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "int16": np.dtype("<i2"),
    "int8": np.dtype("i1"),
    "uint64": np.dtype("<u8"),
    "uint32": np.dtype("<u4"),
    "uint16": np.dtype("<u2"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}
DTYPE_NAMES: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype) -> str:
    """The hsnap name of a numpy (or ml_dtypes) dtype; KeyError if hsnap has none."""
    return DTYPE_NAMES[np.dtype(dtype)]


class SectionKind:
    """What a section holds: its axes and whether it is model state (payload) or request record."""

    __slots__ = ("name", "axes", "state", "dtypes")

    def __init__(self, name: str, axes: tuple[str, ...] | None, state: bool, dtypes: tuple[str, ...] | None = None):
        self.name, self.axes, self.state, self.dtypes = name, axes, state, dtypes

    def __repr__(self) -> str:
        return f"SectionKind({self.name!r})"


_KINDS = [
    # attention rows, token order = position order of the request
    SectionKind("attn_k", ("token", "head", "dim"), True),
    SectionKind("attn_v", ("token", "head", "dim"), True),
    SectionKind("swa_k", ("token", "head", "dim"), True),
    SectionKind("swa_v", ("token", "head", "dim"), True),
    SectionKind("mla_kv", ("token", "head", "dim"), True),
    # one Mamba/GDN slot of one layer; conv may have several components
    SectionKind("conv", None, True),
    SectionKind("temporal", None, True),
    # the request record
    SectionKind("prompt_ids", ("token",), False, ("int32",)),
    SectionKind("output_ids", ("token",), False, ("int32",)),
    SectionKind("output_logprobs", ("token",), False, ("float32",)),
    SectionKind("top_logprob_ids", ("token", "rank"), False, ("int32",)),
    SectionKind("top_logprob_values", ("token", "rank"), False, ("float32",)),
    SectionKind("rng_state", ("byte",), False, ("uint8",)),
]
SECTION_KINDS: dict[str, SectionKind] = {k.name: k for k in _KINDS}
STATE_KINDS = frozenset(k.name for k in _KINDS if k.state)

# Multi-rank snapshot directory
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "hsnap-manifest"
MAX_MANIFEST_BYTES = 1 << 20
RANK_FILE_RE = re.compile(r"rank-(\d{1,5})\.hsnap\Z")


def rank_file_name(rank: int) -> str:
    return f"rank-{rank}.hsnap"


# Temporary names: recognisable (``hsnap gc``) and never a snapshot's final name
# (the writers refuse final names of these forms).
TMP_FILE_MARK = ".hsnap-tmp-"
STAGING_DIR_MARK = ".hsnap-staging-"

# What ``hsnap gc`` proves before it removes anything (a name alone proves nothing:
# anyone can give any name to a committed snapshot). Spec section 8.1.
# * A temporary file starts with PENDING_MAGIC from its creation until commit writes
#   the real preamble over it; a committed file can never start with it (a reader
#   refuses it as "an unfinished write").
# * A staging directory holds PENDING_MARKER (content PENDING_MARKER_TEXT) from its
#   creation until its manifest is in place; commit removes the marker only after
#   manifest.json exists, so at every instant a staging directory holds one or both.
PENDING_MAGIC = b"\x89HSNTMP\n"
PENDING_MARKER = ".hsnap-pending"
PENDING_MARKER_TEXT = b"hsnap staging directory: not committed\n"


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment

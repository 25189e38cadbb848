"""The spec (spec/hsnap-v1.md) and the reference reader say the same thing.

Each disagreement an implementer found by reading only the spec gets a test that runs the
same input through ``hsnap_format`` (the library and ``hsnap verify``) and through
``tests/independent_reader.py`` (written from the spec alone) and asserts that they agree:
accept or refuse, and the error class (and field) where the spec names one. The last tests
keep section 13.1's checklist complete: every MUST in the text has a rule id, every id a
checklist row, and every id cited in the code exists.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import craft  # noqa: E402
import independent_reader as ir  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_format import spec  # noqa: E402
from hsnap_format.tools import cli

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "spec" / "hsnap-v1.md"
VECTORS = ROOT / "spec" / "vectors"


# ----------------------------------------------------------------------------- helpers


def _reference(path) -> tuple[str | None, str | None]:
    """hsnap_format's verdict: (error class, field), or (None, None) when it opens, verifies
    and reads the record of every rank."""
    try:
        with hf.open(path) as snap:
            for rank in getattr(snap, "ranks", {0: snap}).values():
                rank.verify()
                rank.record()
    except hf.HsnapError as e:
        return type(e).__name__, e.field
    return None, None


def _independent(path) -> tuple[str | None, str | None]:
    try:
        (ir.read_directory if os.path.isdir(path) else ir.read_snapshot)(path)
    except ir.HsnapSpecError as e:
        return e.kind, e.field
    return None, None


def _hsnap_verify(path, *flags) -> tuple[int, dict]:
    """``hsnap verify --json [flags] PATH``: (exit status, its JSON)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = cli.main(["verify", "--json", *flags, os.fspath(path)])
    return rc, json.loads(out.getvalue())


def _agree(path) -> str | None:
    """Library, CLI and independent reader reach the same verdict; returns the error class."""
    ref, ind = _reference(path), _independent(path)
    rc, report = _hsnap_verify(path)
    assert ref[0] == ind[0], f"hsnap_format {ref}, independent reader (spec alone) {ind}"
    assert (rc == 0) == (ref[0] is None), f"hsnap verify exit {rc} ({report.get('message')}), library {ref}"
    if ref[0] is not None:
        assert report["error"] == ref[0]
    return ref[0]


def _vector(name: str) -> bytes:
    return (VECTORS / name).read_bytes()


def _write(tmp_path, name: str, data: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _edit(data: bytes, fn) -> bytes:
    """``data`` with ``fn`` applied to its decoded header and every check re-signed."""
    return craft.mutate_header(data, fn)


# ------------------------------------------------------- cause 1: defaults of absent keys


@pytest.mark.parametrize(
    "where,key",
    [(("request", "stop"), "stop_strings"), (("request", "stop"), "stop_token_ids"), (("geometry", "attention"), "swa_layers")],
)
def test_absent_stop_strings_stop_token_ids_swa_layers_mean_empty(tmp_path, where, key):
    """Spec 5.3/5.6 (R-5-3): an absent key with a default means the default, here ``[]``. The
    reference reader refused them ("found ()": its defaults were Python tuples, not the JSON
    value the spec names); the spec-only reader accepts them."""

    def drop(h):
        obj = h
        for k in where:
            obj = obj[k]
        del obj[key]

    path = _write(tmp_path, "absent.hsnap", _edit(_vector("hybrid.hsnap"), drop))
    assert _agree(path) is None
    with hf.open(path) as snap:
        obj = snap.header
        for k in where:
            obj = obj[k]
        assert obj[key] == []  # the header handed out holds the default (what the file means)
        assert getattr(snap.record(), key, getattr(snap.geometry.attention, key, None)) == ()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["info", os.fspath(path)]) == 0  # consumers of the header see the default


def test_every_absent_default_reaches_hsnap_info(tmp_path):
    """The same class elsewhere: every key that has a default, absent at once, is read as its
    default — ``hsnap info`` used to die with a KeyError on an absent ``identity.device``."""

    def drop_all(h):
        for k in ("weights_hash", "device", "snapshot_id", "created_at", "hsnap_version", "numerics"):
            del h["identity"][k]
        for k in ("start_layer", "num_layers"):
            del h["geometry"][k]
        for k in ("swa_layers", "swa_window", "kv_lora_rank", "qk_rope_head_dim"):
            del h["geometry"]["attention"][k]
        del h["geometry"]["mamba"]["conv_slice_axis"]
        for k in ("sampling", "extra", "swa_start"):
            h["request"].pop(k, None)
        for k in ("min_new_tokens", "stop_strings", "stop_token_ids", "ignore_eos"):
            del h["request"]["stop"][k]
        for k in ("tokens", "text_chars", "reasoning_tokens", "reasoning_finished"):
            del h["request"]["streamed"][k]

    path = _write(tmp_path, "defaults.hsnap", _edit(_vector("hybrid.hsnap"), drop_all))
    assert _agree(path) is None
    for argv in (["info", os.fspath(path)], ["info", "--json", os.fspath(path)]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(argv) == 0
    info = json.loads(out.getvalue())["ranks"][0]
    assert info["identity"]["device"] == "" and info["geometry"]["mamba"]["conv_slice_axis"] == 0
    assert info["request"]["streamed"]["tokens"] == 0 and info["request"]["swa_start"] == 0


# ------------------------------------------------------------- cause 2: stop-string limits


def _stop_strings(strings):
    def fn(h):
        h["request"]["stop"]["stop_strings"] = strings

    return fn


@pytest.mark.parametrize(
    "strings,refused",
    [
        (["x" * spec.MAX_STOP_STRING_LENGTH], False),
        (["停" * spec.MAX_STOP_STRING_LENGTH], False),  # code points, not UTF-8 bytes (12,288 here)
        (["a"] * spec.MAX_STOP_STRINGS, False),
        (["x" * 5000], True),  # the case first reported
        (["ok", "x" * (spec.MAX_STOP_STRING_LENGTH + 1)], True),
        (["a"] * (spec.MAX_STOP_STRINGS + 1), True),
    ],
    ids=["4096", "4096-cjk", "1024-strings", "5000", "4097-second", "1025-strings"],
)
def test_stop_string_limits_are_the_spec_limits(tmp_path, strings, refused):
    """Spec 5.3 (R-5-1): at most 1,024 stop strings of at most 4,096 code points each — the
    numbers the code uses (``hsnap_format.spec``); the spec used to say "no limit"."""
    path = _write(tmp_path, "stop.hsnap", _edit(_vector("hybrid.hsnap"), _stop_strings(strings)))
    cls = _agree(path)
    assert cls == ("MalformedHeaderError" if refused else None)
    if refused:
        ref, ind = _reference(path), _independent(path)
        assert ref[1] == ind[1] and ref[1].startswith("request.stop.stop_strings")


def test_stop_string_limits_are_stated_in_the_spec():
    text = SPEC.read_text(encoding="utf-8")
    stop = text[text.index("`stop`: `max_new_tokens`") :][:600]
    assert f"≤ {spec.MAX_STOP_STRINGS:,} strings" in stop
    assert f"each ≤ {spec.MAX_STOP_STRING_LENGTH:,} code points" in stop
    assert f"≤ {spec.MAX_STOP_TOKEN_IDS:,} ints" in stop
    assert not re.search(r"stop_strings`[^.]*no limit", text)  # what 1.1 said before


def test_writer_refuses_a_stop_string_over_the_limit(tmp_path):
    """R-8-1: what a reader refuses is never written."""
    with hf.open(VECTORS / "attention-only.hsnap") as snap:
        ident, geom, rec = snap.identity, snap.geometry, snap.record()
        state = {s.name: snap.read(s) for s in snap.sections if s.is_state}
    rec.stop_strings = ("x" * (spec.MAX_STOP_STRING_LENGTH + 1),)
    with pytest.raises(hf.MalformedHeaderError, match=r"request\.stop\.stop_strings\[0\]"):
        with hf.SnapshotWriter(tmp_path / "w.hsnap", identity=ident, geometry=geom, record=rec) as w:
            for s in w.pending_state_sections():
                w.write_section(s.name, state[s.name])
            w.commit()
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------- cause 3: verify order


def _bad_section_then_bad_padding() -> tuple[bytes, int, str]:
    """hybrid.hsnap with its first section changed and a padding byte after the fourth
    changed: the section comes first in the file, the padding first in spec 7.2's order."""
    data = bytearray(_vector("hybrid.hsnap"))
    table = craft.split(bytes(data)).header_obj["sections"]
    first, fourth = table[0], table[3]
    data[first["offset"]] ^= 0x01
    pad = fourth["offset"] + fourth["length"] + 3
    assert pad < table[4]["offset"]
    data[pad] = 0x5A
    return bytes(data), pad, first["name"]


def test_verify_reports_padding_before_an_earlier_bad_section(tmp_path):
    """Spec 7.2 (R-7.2-3): the padding first, also when a section earlier in the file is bad,
    for ``verify()``, ``hsnap verify --first`` and ``hsnap verify`` (which lists both).
    ``hsnap verify`` reported the section first."""
    data, pad, name = _bad_section_then_bad_padding()
    path = _write(tmp_path, "two-defects.hsnap", data)
    padding = f"padding at byte {pad}"
    assert _reference(path) == ("DigestMismatchError", padding)
    assert _independent(path) == ("DigestMismatchError", padding)
    rc, first = _hsnap_verify(path, "--first")
    assert rc == 1 and first["field"] == padding and len(first["errors"]) == 1
    rc, every = _hsnap_verify(path)
    assert rc == 1 and [e["field"] for e in every["errors"]] == [padding, f"sections[{name!r}].digest"]
    with hf.open(path) as snap:
        assert [e.field for e in snap.verify_failures()] == [padding, f"sections[{name!r}].digest"]


def test_verify_order_of_an_object_store_snapshot(s3server, tmp_path):
    """The same order when the snapshot is read by ranged GETs (one streaming pass)."""
    from hsnap_format.stores.s3 import client as s3client, options as s3options

    data, pad, name = _bad_section_then_bad_padding()
    bucket, opts = s3server.make_bucket(), s3server.options()
    s3client.client(s3options.StorageOptions.of(opts)).put_object(Bucket=bucket, Key="two-defects.hsnap", Body=data)
    with hf.open(f"s3://{bucket}/two-defects.hsnap", storage_options=opts) as snap:
        with pytest.raises(hf.DigestMismatchError, match=f"padding at byte {pad}"):
            snap.verify()
        assert [e.field for e in snap.verify_failures()] == [f"padding at byte {pad}", f"sections[{name!r}].digest"]
        assert [e.field for e in snap.verify_failures(first=True)] == [f"padding at byte {pad}"]


# ------------------------------------------------------- cause 4: sharding with missing keys


@pytest.mark.parametrize("key", ["attention", "conv", "temporal"])
def test_sharding_missing_key_is_refused_by_name(tmp_path, key):
    """Spec 5.6 (R-5.6-4): ``geometry.sharding`` holds all three keys, each an AXIS or null.
    The reference refused a missing one; the spec-only reader read it as null."""

    def drop(h):
        del h["geometry"]["sharding"][key]

    path = _write(tmp_path, "rank-0.hsnap", _edit(_vector("hybrid-tp2/rank-0.hsnap"), drop))
    assert _agree(path) == "MalformedHeaderError"
    assert _reference(path)[1] == _independent(path)[1] == f"geometry.sharding.{key}"


def test_sharding_null_key_means_not_described(tmp_path):
    """Null (not absence) is how a writer says "not described": accepted by both."""

    def null(h):
        h["geometry"]["sharding"]["conv"] = None

    path = _write(tmp_path, "rank-0.hsnap", _edit(_vector("hybrid-tp2/rank-0.hsnap"), null))
    assert _agree(path) is None


# ---------------------------------------------------------- cause 5: symbolic links


@pytest.fixture
def two_rank(tmp_path):
    d = tmp_path / "set"
    shutil.copytree(VECTORS / "two-rank", d)
    return d


def test_symlinked_rank_path_is_not_followed(two_rank, tmp_path):
    """Spec 7.1 step 1 (R-7.1-2): a symbolic link as the last component of the given path is
    not followed — a rank file (``HsnapIOError``, as the spec said and ``Snapshot()`` did) and a
    directory alike; ``hf.open`` and ``hsnap verify`` followed it. Inside a set it is
    ``MalformedManifestError`` (10.2, R-10-1)."""
    outside = tmp_path / "outside.hsnap"
    os.rename(two_rank / "rank-1.hsnap", outside)
    os.symlink(outside, two_rank / "rank-1.hsnap")
    assert _agree(two_rank / "rank-1.hsnap") == "HsnapIOError"  # the rank path given directly
    assert _agree(two_rank) == "MalformedManifestError"  # the set holding it
    with pytest.raises(hf.HsnapIOError, match="symbolic link"):
        hf.open(two_rank / "rank-1.hsnap")
    assert _agree(outside) is None  # the file itself, by its own name, is fine


@pytest.mark.parametrize("trailing", ["", "/"])
def test_symlinked_set_directory_is_not_followed(two_rank, tmp_path, trailing):
    link = tmp_path / "latest"
    os.symlink(two_rank, link)
    path = os.fspath(link) + trailing
    assert _agree(path) == "HsnapIOError"
    with pytest.raises(hf.HsnapIOError, match="symbolic link"):
        hf.SnapshotSet(path)
    assert _agree(os.path.realpath(link)) is None  # resolved by the caller: read as usual


# ------------------------- the same class: where the spec-only reader itself was off


def _swa_start(h):
    h["request"]["swa_start"] = 2  # kind mha: 5.6 says 0 unless kind is swa


def _dtype_object(h):
    h["geometry"]["attention"]["dtype"] = {"required": [], "optional": []}


def _storage_itemsize(h):
    h["geometry"]["attention"]["storage_dtype"] = "float32"  # dtype bfloat16: 5.6, same itemsize


def _kind_a_list(h):
    h["sections"][0]["kind"] = ["attn_k"]


@pytest.mark.parametrize(
    "edit,field",
    [(_swa_start, "request.swa_start"), (_dtype_object, "geometry.attention.dtype"),
     (_storage_itemsize, "geometry.attention.storage_dtype"), (_kind_a_list, r"sections\[.*\]\.kind")],
    ids=["swa_start-on-mha", "dtype-an-object", "storage_dtype-itemsize", "section-kind-a-list"],
)
def test_independent_reader_agrees_where_it_was_off(tmp_path, edit, field):
    """Found by running mutants through both readers in both directions (the mutation run's
    new ``spec-disagrees`` class): the spec-only reader accepted a non-zero ``swa_start`` on an
    ``mha`` file and a ``storage_dtype`` of another itemsize (5.6 refuses both), and crashed
    (TypeError) on a dtype or section kind that is an object or a list."""
    path = _write(tmp_path, "rank-0.hsnap", _edit(_vector("two-rank/rank-0.hsnap"), edit))
    assert _agree(path) == "MalformedHeaderError"
    ref, ind = _reference(path), _independent(path)
    assert re.fullmatch(field, ind[1]) and re.fullmatch(field, ref[1]), (ref, ind)


def test_del_in_an_object_key_is_raw_as_in_a_string_value(tmp_path):
    """Spec 4: keys are strings, escaped as ``JSON.stringify`` escapes them — DEL (0x7f) raw.
    The reference encoder wrote (and so its reader required) ``\\u007f`` in keys only; the
    spec-only reader, like any JCS implementation, requires DEL raw everywhere."""
    data = _edit(_vector("hybrid.hsnap"), lambda h: h["request"]["sampling"].update({"x\x7fy": "\x7f"}))
    header = craft.split(data).header
    assert header.count(b"\x7f") == 2  # key and value, both raw
    assert _agree(_write(tmp_path, "raw.hsnap", data)) is None
    escaped = craft.rebuild(data, header.replace(b'"x\x7fy"', b'"x\\u007fy"'))
    assert _agree(_write(tmp_path, "escaped.hsnap", escaped)) == "MalformedHeaderError"


def test_independent_reader_header_limit_is_one_mib(tmp_path):
    """7.1 step 8: ``header_length`` ≤ 1 MiB (the spec-only reader allowed 4 MiB): a header one
    byte over, canonical and honest otherwise (an unknown top-level key pads it)."""
    vector, pad = _vector("attention-only.hsnap"), 1 << 20
    for _ in range(3):  # the offsets' digits grow with the data offset: converge on the length
        data = _edit(vector, lambda h: h.update(zz="x" * pad))  # noqa: B023 (runs within the call)
        pad += spec.MAX_HEADER_BYTES + 1 - craft.split(data).header_length
    assert craft.split(data).header_length == spec.MAX_HEADER_BYTES + 1
    path = _write(tmp_path, "big-header.hsnap", data)
    assert _agree(path) == "MalformedHeaderError"
    assert _reference(path)[1].endswith("header_length") and _independent(path)[1] == "header_length"


def test_mutation_run_flags_a_refusal_the_spec_reader_does_not_share(tmp_path):
    """The mutation run's ``spec-disagrees`` class: a typed refusal is a failure when the
    spec-only reader accepts the file, or refuses it at open with another class (7.1's order
    is normative); the same class of a refusal both share stays ``typed``."""
    from mutation import format_target as mutate

    ctx = mutate.Context(str(tmp_path / "scratch"), cli_every=0)
    valid = os.fspath(VECTORS / "hybrid.hsnap")
    refused = {"cls": "typed", "stage": "open", "error": "MalformedHeaderError", "field": "request.stop.stop_strings"}
    assert mutate._spec_reader_agrees(valid, refused, ctx)["cls"] == "spec-disagrees"
    bad = _write(tmp_path, "bad.hsnap", _edit(_vector("hybrid.hsnap"), _stop_strings(["x" * 5000])))
    assert mutate._spec_reader_agrees(os.fspath(bad), refused, ctx)["cls"] == "typed"
    other_class = dict(refused, error="UnsupportedFeatureError")
    assert mutate._spec_reader_agrees(os.fspath(bad), other_class, ctx)["cls"] == "spec-disagrees"
    assert "spec-disagrees" in mutate.FAIL_CLASSES and not mutate.INDEPENDENT_DEVIATIONS


# --------------------------------------------------- section 13.1: every MUST has a rule


_RULE = re.compile(r"R-\d+(?:\.\d+)?-\d+")
_DEFINED = re.compile(r"\[(R-\d+(?:\.\d+)?-\d+)\]")
_MUST = re.compile(r"\bMUST(?: NOT)?\b")


def _spec_sections(text: str) -> list[tuple[str, str]]:
    """(section number, body) for every ``##``/``###`` heading after the preface."""
    parts = re.split(r"^(#{2,3}) (\d+(?:\.\d+)?)\.? .*$", text, flags=re.M)
    return [(parts[i + 1], parts[i + 2]) for i in range(1, len(parts) - 2, 3)]


def _blocks(body: str) -> list[str]:
    """Paragraphs, list items and table rows: the units a rule and its id live in."""
    out = []
    for para in re.split(r"\n\s*\n", body):
        lines = para.split("\n")
        if all(line.startswith("|") for line in lines if line.strip()):
            out += lines  # one block per table row
        else:
            out += re.split(r"\n(?=\s*(?:\d+\.|-) )", para)  # one block per list item
    return out


def _checklist(text: str) -> dict[str, str]:
    """Rule id -> the section its checklist row names."""
    table = text[text.index("### 13.1") :].split("\n## ")[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| (R-[\d.-]+) \| ([\d.]+) \|", table, flags=re.M)}


def test_every_must_has_a_rule_id_and_a_checklist_row():
    """Section 13.1 lists every MUST / MUST NOT of the spec: each MUST in the text is followed,
    in its paragraph, list item or table row and before the next MUST, by its own bracketed
    rule id; every id is defined once, in the section its middle part names, and has exactly
    one checklist row naming that section; every row's id is defined in the text."""
    text = SPEC.read_text(encoding="utf-8")
    checklist = _checklist(text)
    problems, defined = [], {}
    for number, body in _spec_sections(text):
        if number == "13.1":
            continue  # the checklist itself
        for block in _blocks(body):
            musts = [m.start() for m in _MUST.finditer(block)]
            for i, at in enumerate(musts):
                end = musts[i + 1] if i + 1 < len(musts) else len(block)
                if not _DEFINED.search(block, at, end):
                    problems.append(f"section {number}: a MUST without its [R-…] id: {block[max(0, at - 60) : at + 80]!r}")
            for rid in _DEFINED.findall(block):
                if rid in defined:
                    problems.append(f"{rid} defined twice (sections {defined[rid]} and {number})")
                defined[rid] = number
                if rid.split("-")[1] != number:
                    problems.append(f"{rid} defined in section {number}: its id names section {rid.split('-')[1]}")
    for rid, number in defined.items():
        if checklist.get(rid) != number:
            problems.append(f"{rid} (section {number}) has no row in 13.1's checklist" if rid not in checklist
                            else f"{rid}: checklist row names section {checklist[rid]}, the text defines it in {number}")
    problems += [f"checklist row {rid} is defined nowhere in the text" for rid in checklist if rid not in defined]
    assert not problems, "\n".join(problems)
    assert len(defined) >= 30  # the test itself found the rules (a broken parser finds none)


def test_rule_ids_cited_in_code_and_tests_exist():
    """A comment or test citing ``R-x-n`` names a rule of the spec (no stale citations)."""
    defined = set(_DEFINED.findall(SPEC.read_text(encoding="utf-8")))
    cited = {}
    for top in ("hsnap_format", "hsnap_io", "tests", "mutation", "viewer"):
        for p in (ROOT / top).rglob("*.py"):
            for rid in _RULE.findall(p.read_text(encoding="utf-8", errors="replace")):
                cited.setdefault(rid, p.relative_to(ROOT).as_posix())
    stale = {rid: where for rid, where in cited.items() if rid not in defined}
    assert not stale, stale
    assert {"R-5-3", "R-7.1-2", "R-7.2-1"} <= set(cited)  # the reference cites what it implements

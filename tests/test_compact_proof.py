"""Compaction never launders (spec 7.5, 7.6): ``compact`` makes the one proof of a chain that a
restore and ``hsnap verify`` make — links, records (R-7.5-2), page keys (R-7.6-1), every page
reference on its own (R-7.6-2) — so a chain either refuses is refused by it with the same
error, and nothing is written; its output is proved again before it gets its name. Hostile
chains are crafted and re-signed (tests/craft.py): every digest honest, only the rules left."""

from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import craft  # noqa: E402
from test_pagestore import SYSTEM, S, tokens_for, write  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_format import pages as pg  # noqa: E402
from hsnap_format import chain as ch  # noqa: E402
from hsnap_format.chain import base_ref, compact, compact_path, open_chain  # noqa: E402
from hsnap_format.tools.cli import main as hsnap  # noqa: E402

BASE_POS, HEAD_POS = 3 * S, 5 * S + 1  # the base holds pages 0-2; the delta pages 3-4 and one row


@pytest.fixture
def paged_chain(tmp_path):
    """``b.hsnap`` (pages 0-2, plain) and ``d.hsnap`` (a delta of it: pages 3-4 and one row),
    both referencing pages in ``pages/``; ``tokens``: the request's token ids."""
    t = tokens_for(SYSTEM, HEAD_POS + 1, seed=4)
    with pg.PageStore(tmp_path / "pages") as store:
        write(tmp_path / "b.hsnap", store, t[: BASE_POS + 1], "r")
        with hf.open(tmp_path / "b.hsnap") as b:
            ref = base_ref(b, "b.hsnap")
        write(tmp_path / "d.hsnap", store, t, "r", base=ref)
    return tmp_path


def _refs(path: Path) -> list:
    return craft.split(path.read_bytes()).header_obj["pages"]["refs"]


def _rebase(delta: Path, base: Path) -> None:
    """``delta`` re-signed to name ``base`` as it now is (its root digest)."""
    root = craft.split(base.read_bytes()).root_digest.hex()
    delta.write_bytes(craft.mutate_header(delta.read_bytes(), lambda h: h["base"].update(root_digest=root)))


def _set_output_id(path: Path, index: int, value: int) -> None:
    """Output id ``index`` of ``path`` set to ``value``, the file re-signed."""
    data = bytearray(path.read_bytes())
    with hf.open(path) as s:
        at = s.section("request.output_ids").offset + 4 * index
    data[at : at + 4] = struct.pack("<i", value)
    path.write_bytes(craft.resign(bytes(data)))


def _refusals(head: Path, tmp_path: Path) -> tuple:
    """What the chain's verify (a restore's, before it allocates), ``hsnap verify``, ``compact``
    and ``compact_path`` say of ``head``; nothing may be left under the outputs' names."""
    with open_chain(head) as chain:
        with pytest.raises(hf.HsnapError) as proof:
            chain.verify()
    with open_chain(head) as chain:
        with pytest.raises(hf.HsnapError) as comp:
            compact(chain, tmp_path / "c.hsnap")
    with pytest.raises(hf.HsnapError) as path_comp:
        compact_path(head, tmp_path / "cp.hsnap")
    assert hsnap(["verify", str(head)]) == 1
    assert hsnap(["compact", str(head), "-o", str(tmp_path / "cli.hsnap")]) == 1
    for name in ("c.hsnap", "cp.hsnap", "cli.hsnap"):
        assert not (tmp_path / name).exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")], "a temporary left behind"
    for e in (comp.value, path_comp.value):
        assert (type(e), e.field) == (type(proof.value), proof.value.field), (e, proof.value)
    return proof.value


def test_compact_refuses_a_reference_renamed_to_an_earlier_page_object(paged_chain):
    """The delta's page-3 reference names the base's page-2 object (key and root digest), the
    delta re-signed: every digest holds, and the old compaction copied page 2's rows into
    positions 12-15 and wrote a file that verifies. The key is not the chain's (R-7.6-1)."""
    d = paged_chain / "d.hsnap"
    page2 = _refs(paged_chain / "b.hsnap")[2]
    d.write_bytes(craft.mutate_header(d.read_bytes(), lambda h: h["pages"]["refs"].__setitem__(0, list(page2))))
    e = _refusals(d, paged_chain)
    assert isinstance(e, hf.DigestMismatchError) and e.field == "pages.refs[0] (key of page 3)", e


def test_compact_refuses_a_base_whose_outputs_are_not_the_deltas_first(paged_chain):
    """R-7.5-2: the base's last output id (a row of its own, no page: its keys still hold)
    changed and re-signed, the delta re-based on it: every link rule and digest holds."""
    b, d = paged_chain / "b.hsnap", paged_chain / "d.hsnap"
    with hf.open(b) as s:
        n = len(s.read("request.output_ids"))
    _set_output_id(b, n - 1, 7)
    _rebase(d, b)
    e = _refusals(d, paged_chain)
    assert isinstance(e, hf.ChainError) and e.field == "request.output_ids", e


def test_compact_refuses_page_keys_that_are_not_the_chain_over_the_files_tokens(paged_chain):
    """R-7.6-1: a delta's output id inside its page 3 changed and re-signed: its references
    still name existing page objects whose own keys and digests hold, but not this request's."""
    d = paged_chain / "d.hsnap"
    _set_output_id(d, 3 * S + 1 - 6, 99)  # position 13 (prompt of 6): inside page 3
    e = _refusals(d, paged_chain)
    assert isinstance(e, hf.DigestMismatchError) and e.field == "pages.refs[0] (key of page 3)", e


def test_compaction_checks_every_reference_to_a_page_object_it_keeps_open(paged_chain):
    """Page objects are kept open across sections; a later reference to the same object is
    checked on its own (R-7.6-2), not taken because the object was opened for an earlier one:
    writing the hostile chain above — its proof skipped — refuses the re-pointed reference."""
    d = paged_chain / "d.hsnap"
    page2 = _refs(paged_chain / "b.hsnap")[2]
    d.write_bytes(craft.mutate_header(d.read_bytes(), lambda h: h["pages"]["refs"].__setitem__(0, list(page2))))
    with open_chain(d) as chain:
        head = chain.head
        w = hf.SnapshotWriter(paged_chain / "w.hsnap", identity=head.identity, geometry=head.geometry, record=head.record(),
                              swa_start=head.swa_start)
        with w, pytest.raises(hf.PageError) as e:
            ch.write_compacted(chain, w)
    assert e.value.field.startswith("pages.refs[0].index"), e.value
    assert not (paged_chain / "w.hsnap").exists()


def test_compact_publishes_its_output_only_once_proved(paged_chain, monkeypatch):
    """The output is re-opened and proved under its temporary name: one byte changed there
    (after every digest was computed) is refused, and nothing is published or left behind."""
    real = ch.prove_output

    def damaged(tmp, head, **kw):
        with open(tmp, "r+b") as f, hf.open(tmp) as s:
            f.seek(s.sections[0].offset)
            b = f.read(1)
            f.seek(s.sections[0].offset)
            f.write(bytes([b[0] ^ 1]))
        return real(tmp, head, **kw)

    monkeypatch.setattr(ch, "prove_output", damaged)
    with open_chain(paged_chain / "d.hsnap") as chain, pytest.raises(hf.DigestMismatchError):
        compact(chain, paged_chain / "c.hsnap")
    assert not (paged_chain / "c.hsnap").exists()
    assert not [n for n in os.listdir(paged_chain) if n.startswith(".")]
    monkeypatch.setattr(ch, "prove_output", real)
    with open_chain(paged_chain / "d.hsnap") as chain:  # the honest chain compacts, and its output verifies
        compact(chain, paged_chain / "c.hsnap")
    assert hsnap(["verify", str(paged_chain / "c.hsnap")]) == 0


def test_compact_to_an_object_store_withdraws_an_output_whose_proof_fails(paged_chain, s3server, monkeypatch):
    """An object store's upload publishes at completion: the output is proved there, and one
    whose proof fails is removed again (by its ETag) — nothing stays under the key; an honest
    chain compacts to the same bytes as on disk."""
    from hsnap_format.stores import store_for

    opts = s3server.options()
    url = f"s3://{s3server.make_bucket()}/c.hsnap"
    store = store_for(url, opts)
    real = ch.prove_output
    monkeypatch.setattr(ch, "prove_output", lambda *a, **kw: (_ for _ in ()).throw(hf.ChainError(url, "planted", 1, 2)))
    with open_chain(paged_chain / "d.hsnap") as chain, pytest.raises(hf.ChainError):
        compact(chain, url, storage_options=opts)
    assert not store.exists(url)
    monkeypatch.setattr(ch, "prove_output", real)
    with open_chain(paged_chain / "d.hsnap") as chain:
        compact(chain, url, storage_options=opts)
        compact(chain, paged_chain / "local.hsnap")
    assert store.read_bytes(url, 1 << 30)[0] == (paged_chain / "local.hsnap").read_bytes()

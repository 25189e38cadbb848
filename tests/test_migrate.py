"""Live migration of a request between two processes: the source pre-copies
a plain snapshot and deltas while it decodes, stops, writes the last delta; the target applies
each link as it arrives into its own SGLang pools and decodes on (hsnap_io.migrate).

The two-process test runs the tiny hybrid model through real SGLang pools (hsnap_testing.migration);
the others drive MigrationSource / MigrationTarget directly on SGLang's pool classes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

import chain_cases as cc  # noqa: E402
import io_cases as ic  # noqa: E402
from hsnap_testing import pools as sp  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_io import restore_request  # noqa: E402
from hsnap_io.migrate import APPLIED_SUFFIX, FINAL_NAME, LINK_NAME, MigrationSource, MigrationTarget  # noqa: E402
from hsnap_testing import zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- two processes, the tiny model


def _child(role: str, spec_path, result, wait: bool = True):
    cmd = [sys.executable, "-m", "hsnap_testing.migration", role, "--spec", str(spec_path), "--result", str(result)]
    p = zygote.popen(cmd, cwd=ROOT, text=True)
    if wait:
        _wait(p, role)
    return p


def _wait(p, role: str) -> None:
    try:
        _, err = p.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    assert p.returncode == 0, f"{role} child failed:\n{err[-3000:]}"


def test_live_migration_between_two_processes_continues_exactly_under_a_grammar(tmp_path):
    """Source and target are two processes with their own SGLang pools; the request is
    grammar-constrained (xgrammar through SGLang's backend; the target re-derives the matcher
    from the record). Tokens and logprobs equal the uninterrupted run's, bit for bit."""
    spec = {"dir": str(tmp_path / "mig"), "prompt_len": 12, "n": 36, "methods": ["live"], "rounds": 3, "every": 2, "tail": 2,
            "source_size": 256, "target_size": 512, "threads": 1, "timeout_s": 300, "regex": "[a-z ]+"}
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    target = _child("target", spec_path, tmp_path / "target.json", wait=False)  # follows the store from the start
    try:
        _child("source", spec_path, tmp_path / "source.json")
        _wait(target, "target")
    finally:
        if target.poll() is None:
            target.kill()
            target.wait()
    _child("reference", spec_path, tmp_path / "reference.json")
    ref = json.loads((tmp_path / "reference.json").read_text())
    src = json.loads((tmp_path / "source.json").read_text())
    tgt = json.loads((tmp_path / "target.json").read_text())["methods"][0]
    assert len(ref["token_ids"]) == spec["n"]
    assert tgt["token_ids"] == ref["token_ids"]  # the source's outputs, then the target's
    assert tgt["logprobs"] == ref["logprobs"]  # exactly: max |delta| 0.0
    # the source's outputs (and the one more it decodes after the stop, to compare) are the reference's
    assert src["token_ids"] == ref["token_ids"][: len(src["token_ids"])] and src["methods"][0]["outputs"] < spec["n"]
    # the target applied the plain snapshot and every delta in order, then the last one; the source
    # pre-copied until the target had applied every round (its .applied marker), then stopped
    rounds = src["methods"][0]["rounds"]
    applied = tgt["applied"]
    assert len(rounds) >= spec["rounds"]
    assert [a["path"] for a in applied] == [LINK_NAME.format(i) for i in range(len(rounds))] + [FINAL_NAME]
    assert [a["position"] for a in applied[:-1]] == [r["position"] for r in rounds]
    assert all(os.path.exists(os.path.join(spec["dir"], "0-live", LINK_NAME.format(i) + APPLIED_SUFFIX)) for i in range(len(rounds)))
    # the downtime path carries only the tail: the rows decoded after the last round
    assert applied[-1]["final"] and applied[-1]["rows"] == spec["every"]
    assert applied[-1]["position"] == src["methods"][0]["position"] == rounds[-1]["position"] + spec["every"]
    with hf.open(os.path.join(spec["dir"], "0-live", FINAL_NAME)) as final:
        assert final.base.name == LINK_NAME.format(len(rounds) - 1)
        assert all(s.shape[0] == spec["every"] for s in final.sections if s.kind in ("attn_k", "attn_v"))
        assert applied[-1]["bytes_uploaded"] == sum(s.length for s in final.sections if not s.name.startswith("request."))
    assert src["free_after_release"] == src["free_before"]  # the source gave its slots back


# ----------------------------------------------------------------------------- in one process, SGLang's pool classes


def _migrate(ps, req, kind: str, directory, *, ident=None) -> list[str]:
    """The links of a migration of ``req``: two pre-copy rounds at POSITIONS[0..1] and the last
    delta at POSITIONS[2], decoding (``cc.step``) between them."""
    src = MigrationSource(directory, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                          identity=ident or ic.identity())
    for i, pos in enumerate(cc.POSITIONS):
        if i:
            cc.step(ps, req, i, 0, 0)
        (src.stop if i == len(cc.POSITIONS) - 1 else src.precopy)(req.req_pool_idx, cc.record(pos))
    return src.links


def _target(ps) -> MigrationTarget:
    return MigrationTarget(req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                           identity=ic.identity())


def _direct(ps, req, path):
    """A plain export of the source pools at the last position: what the migrated request must equal."""
    return cc.export(ps, req, path, cc.POSITIONS[-1], snapshot_id="direct")


def _same_as_direct(target_ps, got, direct_path) -> bool:
    other = ic.target("hybrid_linear" if target_ps.has_mamba else "mha", target_ps.page_size)
    res = restore_request(direct_path, req_to_token_pool=other.req_to_token_pool, token_to_kv_pool_allocator=other.token_to_kv_pool_allocator,
                          identity=ic.identity())
    return cc.same_rows(cc.restored_rows(target_ps, got), cc.restored_rows(other, res))


@pytest.mark.parametrize("kind,page", [("hybrid_linear", 1), ("mha", 16)], ids=["hybrid_linear-p1", "mha-p16"])
def test_target_applies_each_link_into_the_same_request(kind, page, tmp_path):
    """Each delta's rows land in slots allocated after the request's (paged: SGLang's alloc_extend
    after the last slot), its state over the request's Mamba slot; the result is the request a
    plain restore at the last position gives."""
    ps, req = cc.source(kind, page)
    links = _migrate(ps, req, kind, tmp_path / "mig")
    _direct(ps, req, tmp_path / "direct.hsnap")
    t = ic.target(kind, page)
    tgt = _target(t)
    applied = list(tgt.follow(tmp_path / "mig", timeout_s=5))
    assert [a.path for a in applied] == links and applied[-1].final
    assert [a.rows for a in applied] == [cc.POSITIONS[0], cc.POSITIONS[1] - cc.POSITIONS[0], cc.POSITIONS[2] - cc.POSITIONS[1]]
    got = tgt.request
    assert got.state_position == cc.POSITIONS[-1] and got.record.output_ids.tolist() == cc.record(cc.POSITIONS[-1]).output_ids.tolist()
    assert sp.request_rows(t, sp.RequestRecord(got.req_pool_idx, got.token_indices, got.mamba_pool_idx, got.state_position, 0))
    assert _same_as_direct(t, got, tmp_path / "direct.hsnap")
    free = t.token_to_kv_pool_allocator.available_size()
    tgt.release()
    assert t.token_to_kv_pool_allocator.available_size() > free


def _refused(tgt: MigrationTarget, ps, path, exc_type):
    before = sp.pool_state_fingerprint(ps)
    at = tgt.request.state_position
    with pytest.raises(exc_type) as info:
        tgt.apply(path)
    assert isinstance(info.value, hf.HsnapError)
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []  # nothing allocated, no byte written
    assert tgt.request.state_position == at  # the migration is where it was
    return info.value


def test_delta_whose_base_is_not_the_applied_link_is_refused_pools_identical(tmp_path):
    ps, req = cc.source("hybrid_linear")
    links = _migrate(ps, req, "hybrid_linear", tmp_path / "a")
    other = _migrate(*cc.source("hybrid_linear"), "hybrid_linear", tmp_path / "b")  # the same request, another migration
    _direct(ps, req, tmp_path / "direct.hsnap")
    t = ic.target("hybrid_linear", 1)
    tgt = _target(t)
    tgt.apply(links[0])
    e = _refused(tgt, t, other[1], hf.DigestMismatchError)  # names link-0000 of b: same name, another snapshot
    assert e.field == "base.root_digest"
    e = _refused(tgt, t, links[2], hf.DigestMismatchError)  # skips link-0001: its base is not the applied link
    assert e.field == "base.root_digest"
    e = _refused(tgt, t, links[0], hf.ChainError)  # a plain snapshot is no next link
    assert e.field == "base"
    for link in links[1:]:  # the right links still apply, and give the request exactly
        tgt.apply(link)
    assert _same_as_direct(t, tgt.request, tmp_path / "direct.hsnap")


def test_delta_with_changed_bytes_is_refused_pools_identical(tmp_path):
    ps, req = cc.source("hybrid_linear")
    links = _migrate(ps, req, "hybrid_linear", tmp_path / "a")
    t = ic.target("hybrid_linear", 1)
    tgt = _target(t)
    tgt.apply(links[0])
    flipped = tmp_path / "a" / "flipped.hsnap"  # the right base, one bit of its KV rows changed
    data = bytearray(open(links[1], "rb").read())
    with hf.open(links[1]) as d:
        section = next(s for s in d.sections if s.kind == "attn_k")
    data[section.offset + 3] ^= 0x10
    flipped.write_bytes(bytes(data))
    e = _refused(tgt, t, flipped, hf.DigestMismatchError)  # every byte hashed before allocating
    assert section.name in e.field
    tgt.apply(links[1])
    assert tgt.request.state_position == cc.POSITIONS[1]


def test_target_too_small_for_a_delta_is_refused_pools_identical(tmp_path):
    ps, req = cc.source("hybrid_linear")
    links = _migrate(ps, req, "hybrid_linear", tmp_path / "a")
    t = sp.build("hybrid_linear", size=32, page_size=1, seed=9)  # room for the base (24 rows), not for all deltas
    tgt = _target(t)
    tgt.apply(links[0])
    assert t.token_to_kv_pool_allocator.available_size() < cc.POSITIONS[1] - cc.POSITIONS[0]
    e = _refused(tgt, t, links[1], hf.CapacityError)
    assert "token slots" in str(e)


class HeldSlots:
    """A caller's cache as hsnap_io.slots.Room: token slots it holds (taken from the allocator, as a radix cache's
    unreferenced entries hold theirs) and gives back only when asked to make room."""

    def __init__(self, ps, keep_free: int) -> None:
        self.alloc = ps.token_to_kv_pool_allocator
        self.held = self.alloc.alloc(self.alloc.available_size() - keep_free)
        self.made: list[tuple[int, int]] = []

    def spare(self) -> dict[str, int]:
        return {"token slots": len(self.held)}

    def make(self, token_slots: int, mamba_slots: int) -> None:
        self.made.append((token_slots, mamba_slots))
        short = token_slots - self.alloc.available_size()
        if short > 0:
            self.alloc.free(self.held[:short])
            self.held = self.held[short:]


def _flipped(link, path, kind: str):
    data = bytearray(open(link, "rb").read())
    with hf.open(link) as d:
        section = next(s for s in d.sections if s.kind == kind)
    data[section.offset + section.length // 2] ^= 0x10
    path.write_bytes(bytes(data))
    return path, section.name


def test_a_target_makes_room_only_for_a_link_that_passed_every_check(tmp_path):
    """A target whose free slots are too few for each link but whose caller can free more (a radix cache): the
    capacity checks count the room, a link with a changed byte is refused without the room giving up a slot, and
    a right link gets exactly the slots it allocates freed, right before allocating."""
    ps, req = cc.source("hybrid_linear")
    links = _migrate(ps, req, "hybrid_linear", tmp_path / "a")
    _direct(ps, req, tmp_path / "direct.hsnap")
    t = sp.build("hybrid_linear", size=128, page_size=1, seed=9)
    room = HeldSlots(t, keep_free=10)
    tgt = MigrationTarget(req_to_token_pool=t.req_to_token_pool, token_to_kv_pool_allocator=t.token_to_kv_pool_allocator,
                          identity=ic.identity(), room=room)
    held = len(room.held)
    before = sp.pool_state_fingerprint(t)
    with pytest.raises(hf.DigestMismatchError):  # the first link: a temporal state byte changed
        tgt.apply(_flipped(links[0], tmp_path / "a" / "flipped-0.hsnap", "temporal")[0])
    assert room.made == [] and len(room.held) == held
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(t)) == []
    tgt.apply(links[0])
    assert room.made == [(cc.POSITIONS[0], 1)] and len(room.held) == held - (cc.POSITIONS[0] - 10)
    before = sp.pool_state_fingerprint(t)
    flipped, name = _flipped(links[1], tmp_path / "a" / "flipped-1.hsnap", "attn_k")
    e = _refused(tgt, t, flipped, hf.DigestMismatchError)
    assert name in e.field
    assert len(room.made) == 1 and sp.diff_fingerprints(before, sp.pool_state_fingerprint(t)) == []
    for link in links[1:]:
        tgt.apply(link)
    assert room.made[1:] == [(cc.POSITIONS[1] - cc.POSITIONS[0], 0), (cc.POSITIONS[2] - cc.POSITIONS[1], 0)]
    assert _same_as_direct(t, tgt.request, tmp_path / "direct.hsnap")


def test_final_apply_reads_only_the_last_link(tmp_path):
    """The downtime path: with every earlier link's bytes changed in place after it was applied,
    the last delta still applies (it reads, hashes and uploads only itself) and the request is
    exact; had it read any earlier byte, the digest would refuse it."""
    ps, req = cc.source("hybrid_linear")
    links = _migrate(ps, req, "hybrid_linear", tmp_path / "a")
    _direct(ps, req, tmp_path / "direct.hsnap")
    t = ic.target("hybrid_linear", 1)
    tgt = _target(t)
    for link in links[:-1]:
        tgt.apply(link)
    for link in links[:-1]:
        cc.flip_every_section(link)
        with hf.open(link) as s, pytest.raises(hf.DigestMismatchError):
            s.verify()
    final = tgt.apply(links[-1])
    assert final.final and final.rows == cc.POSITIONS[2] - cc.POSITIONS[1]
    assert _same_as_direct(t, tgt.request, tmp_path / "direct.hsnap")


def test_migration_through_an_object_store(s3server, tmp_path):
    """The same migration with the links under an s3:// prefix (SeaweedFS): the storage seam
    is the transport; the target reads each link with ranged GETs, hashed as they land."""
    opts = s3server.options()
    prefix = f"s3://{s3server.make_bucket()}/mig/req-1"
    ps, req = cc.source("hybrid_linear")
    src = MigrationSource(prefix, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                          identity=ic.identity(), storage_options=opts)
    t = ic.target("hybrid_linear", 1)
    tgt = MigrationTarget(req_to_token_pool=t.req_to_token_pool, token_to_kv_pool_allocator=t.token_to_kv_pool_allocator,
                          identity=ic.identity(), storage_options=opts)
    for i, pos in enumerate(cc.POSITIONS):
        if i:
            cc.step(ps, req, i, 0, 0)
        (src.stop if i == len(cc.POSITIONS) - 1 else src.precopy)(req.req_pool_idx, cc.record(pos))
        applied = tgt.apply(src.links[-1])  # as each link is committed
        assert applied.state_position == pos and applied.final == (i == len(cc.POSITIONS) - 1)
    _direct(ps, req, tmp_path / "direct.hsnap")
    assert _same_as_direct(t, tgt.request, tmp_path / "direct.hsnap")


def test_delta_changed_during_its_upload_is_rolled_back(tmp_path, monkeypatch):
    """A link whose bytes change after it was checked (a writer over the same file): the upload
    hashes what lands, refuses at the last section, and gives back the link's slots, the
    request's row and its Mamba slot (overwritten by then) — exactly, with exact_rollback."""
    ps, req = cc.source("hybrid_linear")
    links = _migrate(ps, req, "hybrid_linear", tmp_path / "a")
    _direct(ps, req, tmp_path / "direct.hsnap")
    t = ic.target("hybrid_linear", 1)
    tgt = MigrationTarget(req_to_token_pool=t.req_to_token_pool, token_to_kv_pool_allocator=t.token_to_kv_pool_allocator,
                          identity=ic.identity(), exact_rollback=True)
    tgt.apply(links[0])
    with hf.open(links[1]) as d:
        last = d.sections[[s.name for s in d.sections].index("request.prompt_ids") - 1]  # the last state section uploaded
    original = open(links[1], "rb").read()
    import hsnap_io.migrate as mig

    upload = mig.upload_piece

    def change_then_upload(engine, b, rows, piece, check):  # a writer over the file while it is uploaded
        if b.name == last.name:
            with open(links[1], "r+b") as f:  # in place: the open file sees it
                f.seek(last.offset)
                f.write(bytes([original[last.offset] ^ 0x01]))
        return upload(engine, b, rows, piece, check)

    monkeypatch.setattr(mig, "upload_piece", change_then_upload)
    e = _refused(tgt, t, links[1], hf.DigestMismatchError)
    assert last.name in e.field
    monkeypatch.undo()
    with open(links[1], "wb") as f:
        f.write(original)
    for link in links[1:]:
        tgt.apply(link)
    assert _same_as_direct(t, tgt.request, tmp_path / "direct.hsnap")


def test_bench_migrate_runs_and_writes_its_table(tmp_path):
    """bench/migrate.py end to end at one small length (its figures are not asserted: speed
    belongs in bench/); the first token after every method equals the source's own."""
    out = tmp_path / "MIGRATE.md"
    p = subprocess.run([sys.executable, "-m", "bench.migrate", "--lengths", "64", "--repeats", "1", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    text = out.read_text()
    assert "| committed tokens | decode step (source, median) | live migration |" in text
    raw = json.loads((tmp_path / "MIGRATE.json").read_text())["results"][0]
    assert set(raw["methods"]) == {"live", "live-nofsync", "stop", "recompute"}
    for name in ("live", "live-nofsync", "stop"):  # the pools' bytes continue the request exactly
        assert raw["methods"][name]["all_same"] and raw["methods"][name]["max_logprob_delta"] == 0.0
    assert raw["methods"]["live"]["rows"] == 4 < raw["methods"]["stop"]["rows"]  # only the tail on the downtime path


def test_follow_without_links_is_a_typed_timeout_and_a_stopped_source_writes_no_more(tmp_path):
    from hsnap_io.migrate import MigrationError

    t = ic.target("hybrid_linear", 1)
    before = sp.pool_state_fingerprint(t)
    (tmp_path / "empty").mkdir()
    with pytest.raises(MigrationError) as info:  # never a hang: the next link named, with how long it was waited for
        list(_target(t).follow(tmp_path / "empty", timeout_s=0.2))
    assert info.value.field == LINK_NAME.format(0)
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(t)) == []
    ps, req = cc.source("hybrid_linear")
    src = MigrationSource(tmp_path / "a", req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                          identity=ic.identity())
    src.stop(req.req_pool_idx, cc.record(cc.POSITIONS[0]))  # stop-and-copy: one plain snapshot
    with pytest.raises(MigrationError):
        src.precopy(req.req_pool_idx, cc.record(cc.POSITIONS[1]))
    assert sorted(os.listdir(tmp_path / "a")) == [FINAL_NAME]
    applied = list(_target(t).follow(tmp_path / "a", timeout_s=5))
    assert [(a.final, a.rows) for a in applied] == [(True, cc.POSITIONS[0])]


def test_accept_hook_refusal_leaves_pools_identical_and_the_link_still_applies(tmp_path):
    """``apply(accept=...)``: the caller's own check (a scheduler's: can this request run here?) runs after every
    check of the link and before anything is allocated; what it raises refuses the link like the checks do."""
    ps, req = cc.source("hybrid_linear")
    links = _migrate(ps, req, "hybrid_linear", tmp_path / "a")
    t = ic.target("hybrid_linear", 1)
    tgt = _target(t)
    seen = []

    class NotHere(hf.HsnapError):
        pass

    def refuse(snap, record):
        seen.append((os.path.basename(snap.path), record.state_position))
        raise NotHere(snap.path, "request", "a request this target runs", "refused by the caller")

    for i, link in enumerate(links):
        before = sp.pool_state_fingerprint(t)
        with pytest.raises(NotHere):
            tgt.apply(link, accept=refuse)
        assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(t)) == []
        assert len(tgt.applied) == i
        tgt.apply(link, accept=lambda snap, record: seen.append(("ok", record.state_position)))
    assert [p for _, p in seen] == [p for pos in cc.POSITIONS for p in (pos, pos)]
    assert tgt.request.state_position == cc.POSITIONS[-1]


def test_abandoned_migration_is_typed_for_the_follower_and_release_frees_every_slot(tmp_path):
    """A source that gives up (``MigrationSource.abandon``) says why in ``abandoned.json``; the following target's
    ``step`` raises MigrationError naming it; ``release`` gives back what was applied: the pools' free counts are
    as before the first link."""
    from hsnap_io.migrate import ABANDONED_NAME, MigrationError

    ps, req = cc.source("hybrid_linear")
    src = MigrationSource(tmp_path / "mig", req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                          identity=ic.identity())
    src.precopy(req.req_pool_idx, cc.record(cc.POSITIONS[0]))
    t = ic.target("hybrid_linear", 1)
    free = (t.token_to_kv_pool_allocator.available_size(), t.req_to_token_pool.mamba_allocator.available_size(), t.req_to_token_pool.available_size())
    tgt = _target(t)
    assert tgt.step(tmp_path / "mig").rows == cc.POSITIONS[0]
    assert tgt.step(tmp_path / "mig") is None  # nothing new yet: never waits
    src.abandon("the request finished on the source")
    with pytest.raises(MigrationError) as info:
        tgt.step(tmp_path / "mig")
    assert info.value.field == ABANDONED_NAME and "the request finished on the source" in str(info.value)
    with pytest.raises(MigrationError):  # the source is stopped: no more links
        src.precopy(req.req_pool_idx, cc.record(cc.POSITIONS[1]))
    tgt.release()
    assert (t.token_to_kv_pool_allocator.available_size(), t.req_to_token_pool.mamba_allocator.available_size(),
            t.req_to_token_pool.available_size()) == free


def test_target_refusal_stops_the_source_with_the_targets_reason(tmp_path):
    """``MigrationTarget.refuse`` puts refused.json (the target's typed reason): the source's ``caught_up`` raises
    MigrationError saying it, instead of waiting for an ``.applied`` marker that never comes."""
    from hsnap_io.migrate import REFUSED_NAME, MigrationError

    ps, req = cc.source("hybrid_linear")
    src = MigrationSource(tmp_path / "mig", req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                          identity=ic.identity())
    src.precopy(req.req_pool_idx, cc.record(cc.POSITIONS[0]))
    assert src.caught_up() is False
    t = ic.target("hybrid_linear", 1)
    tgt = _target(t)
    with pytest.raises(hf.CapacityError) as refused:  # this target cannot hold it
        tgt.step(tmp_path / "mig", accept=lambda snap, record: (_ for _ in ()).throw(hf.CapacityError(snap.path, "target pools", 10, 1)))
    tgt.refuse(tmp_path / "mig", refused.value)
    tgt.release()
    with pytest.raises(MigrationError) as info:
        src.caught_up()
    assert info.value.path.endswith(REFUSED_NAME) and "refused by the target: CapacityError" in str(info.value)


def test_step_whose_applied_marker_cannot_be_put_still_returns_the_applied_link(tmp_path, monkeypatch):
    """Found by ``python -m mutation --target migrate``: step() applied the link into the pools,
    then failed to put its ``.applied`` marker and raised a typed error — a "refusal" with the
    link already in the pools, its slots held by a request the caller believes refused. The link
    is applied: step returns it — silently when the name is taken (a directory here; another
    rank's marker), with a RuntimeWarning when the store refuses the write (a read-only
    container: the source then pre-copies on until it stops) — and the migration goes on to the
    request a plain restore gives."""
    import errno

    from hsnap_format import stores
    from hsnap_format.stores.wrappers import FaultStore

    ps, req = cc.source("hybrid_linear")
    links = _migrate(ps, req, "hybrid_linear", tmp_path / "a")
    _direct(ps, req, tmp_path / "direct.hsnap")
    os.makedirs(links[0] + APPLIED_SUFFIX + "/x")  # the marker of link-0000 cannot be put: its name is taken
    t = ic.target("hybrid_linear", 1)
    tgt = _target(t)
    assert tgt.step(tmp_path / "a").state_position == cc.POSITIONS[0]

    def read_only(operation, path):
        if operation == "put_bytes" and path.endswith(APPLIED_SUFFIX):
            raise hf.HsnapIOError(path, "write", OSError(errno.EROFS, "Read-only file system"))

    monkeypatch.setattr(stores, "LOCAL", FaultStore(stores.LOCAL, read_only))
    with pytest.warns(RuntimeWarning, match=r"link-0001\.hsnap\.applied: not put"):
        applied = tgt.step(tmp_path / "a")
    assert applied.state_position == cc.POSITIONS[1] and tgt.request.state_position == cc.POSITIONS[1]
    assert [a.path for a in tgt.applied] == links[:2]
    final = tgt.step(tmp_path / "a")
    assert final.final and _same_as_direct(t, tgt.request, tmp_path / "direct.hsnap")

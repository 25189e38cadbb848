"""The mutation run (the ``mutation`` package), small enough for CI, and the
regressions it produced.

``test_mutation_core_has_no_failures`` runs the format target in this process on a
fixed seed; the full run (50,000 mutants, worker processes with time and memory
limits) is ``.venv/bin/python -m mutation --mutants 50000 --seed 1 --jobs 2``.
The other tests show that the harness can fail (it reports a planted untyped
exception, a planted acceptance, a hang and a dead worker), and pin what the runs
found: the huge-literal tests (309-400 digit integer literals raised an untyped
OverflowError out of the canonical parser); ``test_found_*`` are files the
reader accepted although the spec refuses them (accepted-but-changed in the run).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
from pathlib import Path

import pytest

import craft
import hsnap_format
from hsnap_format import canonical
from hsnap_format.errors import MalformedHeaderError, MalformedManifestError
from hsnap_format.tools import cli
from mutation import format_target as mutate
from mutation import run as runner

ROOT = Path(__file__).resolve().parents[1]
VEC = ROOT / "spec" / "vectors"

SEED = 20260110
MUTANTS = 1000  # about 4 s on one core; the full run is 50,000


@pytest.fixture(scope="module")
def inputs():
    return mutate.load_inputs()


@pytest.fixture()
def ctx(tmp_path):
    return mutate.Context(str(tmp_path / "scratch"), cli_every=10)


def _failures(tally) -> str:
    return "\n".join(
        f"#{f['i']} {f['cls']} {f['desc']['target']} {json.dumps(f['desc']['ops'])[:300]} re-signed={f['desc']['resign']}: "
        f"{f.get('error', '')} {f.get('where', '')} {f.get('reason', '')} {f.get('message', '')[:200]}"
        for f in tally.failures
    )


# ------------------------------------------------------------------------------ the run


def test_mutation_core_has_no_failures(tmp_path):
    tally = runner.run(MUTANTS, SEED, jobs=0, timeout=20, cli_every=10, scratch=str(tmp_path))
    assert tally.n == MUTANTS
    assert tally.failed == 0, tally.totals_line() + "\n" + _failures(tally)
    # the run covers what it claims to: every operator, target and variant ...
    assert set(tally.by_operator) >= set(mutate.OPERATORS)
    assert set(tally.by_target) == set(mutate.load_inputs()[0])
    assert tally.by_variant["raw"]["typed"] > 0 and tally.by_variant["re-signed"]["typed"] > 0
    # ... and re-signing gets mutants past the integrity layer to every layer of checks
    for layer in ("framing", "json", "table", "features", "identity", "geometry", "request", "manifest"):
        assert tally.typed_layers[layer] > 0, (layer, dict(tally.typed_layers))
    assert tally.total["accepted-valid"] > 0
    assert tally.cli_checked >= MUTANTS // 10 - 5


def test_mutants_are_a_function_of_seed_and_index(inputs):
    a = [mutate.generate(5, i, *inputs) for i in range(40)]
    assert a == [mutate.generate(5, i, *inputs) for i in range(40)]
    assert a != [mutate.generate(6, i, *inputs) for i in range(40)]
    # a pair shares its ops: raw and re-signed variants of one mutation
    assert all(a[2 * k]["ops"] == a[2 * k + 1]["ops"] and not a[2 * k]["resign"] and a[2 * k + 1]["resign"] for k in range(20))
    # no mutant is the vector itself
    for d in a:
        assert mutate.build(dict(d, resign=False), *inputs)[d["target"]] != inputs[0][d["target"]]


# ------------------------------------------------------------- the harness can fail


def test_resign_is_the_identity_on_honest_files():
    for p in sorted(VEC.glob("*.hsnap")) + sorted(VEC.glob("*/rank-*.hsnap")):
        data = p.read_bytes()
        assert craft.resign(data) == data, p
    m = (VEC / "two-rank" / "manifest.json").read_bytes()
    assert craft.resign_manifest(m) == m
    for r in (0, 1):
        assert craft.manifest_for(m, r, (VEC / "two-rank" / f"rank-{r}.hsnap").read_bytes()) == m


def test_resigned_mutant_reaches_the_semantic_checks(inputs, ctx):
    desc = {"i": 1, "target": "hybrid.hsnap", "resign": True, "operator": "j_number",
            "ops": [{"op": "j.set", "path": ["request", "state_position"], "value": 99}]}
    raw = mutate.examine(dict(desc, resign=False), ctx, cli=False)
    assert (raw["cls"], raw["error"]) == ("typed", "DigestMismatchError")
    r = mutate.examine(desc, ctx, cli=False)
    assert (r["cls"], r["error"], r["field"]) == ("typed", "MalformedHeaderError", "request.state_position")


def test_harness_reports_a_planted_untyped_exception(monkeypatch, ctx):
    def planted(*a, **k):
        raise KeyError("planted")

    monkeypatch.setattr(canonical, "loads", planted)  # called by the reader's header parser
    desc = {"i": 1, "target": "attention-only.hsnap", "resign": True, "operator": "j_add_key",
            "ops": [{"op": "j.add", "path": ["request", "extra"], "key": "x", "value": 1}]}
    r = mutate.examine(desc, ctx, cli=False)
    assert (r["cls"], r["error"], r["stage"]) == ("untyped", "KeyError", "open")
    assert r["where"].startswith("hsnap_format/reader.py"), r["where"]  # the deepest library frame
    assert "planted" in r["traceback"]


def test_harness_reports_a_planted_acceptance(ctx):
    """Accepted raw bytes other than the vector's are a failure; the vector's own bytes are not."""
    src = VEC / "attention-only.hsnap"
    data = src.read_bytes()
    flipped = craft.flip(data, craft.split(data).data_offset * 8)
    desc = {"i": 1, "target": "attention-only.hsnap", "resign": False, "operator": "b_flip", "ops": []}
    with hsnap_format.open(src) as snap:  # stands for a reader that accepted the flipped file
        r = mutate._accepted(snap, str(src), {"attention-only.hsnap": flipped}, desc, ctx)
        assert r["cls"] == "accepted-but-changed" and "raw mutant accepted" in r["reason"]
        assert mutate._accepted(snap, str(src), {"attention-only.hsnap": data}, desc, ctx)["cls"] == "accepted-unchanged"


def test_model_refuses_a_file_whose_meaning_differs_from_its_decoding(tmp_path, ctx):
    """The spec model compares the mutant's bytes with what the writer writes for the decoded
    content: a file accepted as meaning something else than it says is caught."""
    src = VEC / "hybrid.hsnap"
    data = src.read_bytes()
    other = craft.mutate_header(data, lambda h: h["request"].__setitem__("rid", "someone-else"))
    with hsnap_format.open(src) as snap:  # decoded: the original; bytes: another rid
        why = mutate._rank_model(snap, other, ctx)
        assert why is not None and why.startswith("request.rid"), why
        assert mutate._rank_model(snap, data, ctx) is None
    # what the spec lets differ is no difference: an unknown key, an absent key with a default, the minor version
    extra = craft.mutate_header(data, lambda h: h["identity"].__setitem__("x-new", [1]))
    no_device = craft.mutate_header(data, lambda h: h["identity"].pop("device") and None)
    minor = craft.rebuild(data, minor=3)
    for k, m in enumerate((extra, no_device, minor)):
        p = craft.write(tmp_path / f"ok{k}.hsnap", m)
        with hsnap_format.open(p) as snap:
            assert mutate._rank_model(snap, m, ctx) is None
    # an absent key decoded as anything but the spec's default is caught
    hm = json.loads(craft.split(no_device).header)
    hw = json.loads(craft.split(data).header)
    hw["identity"]["device"] = "gpu"
    assert mutate._meaning_diff(hm, hw, "", 0).startswith("identity.device: absent")
    # and so are unknown keys where the spec allows none, and non-string features
    hm = json.loads(craft.split(data).header)
    hm["sections"][0]["x"] = 1
    assert "unknown key" in mutate._meaning_diff(hm, json.loads(craft.split(data).header), "", 0)
    hm = json.loads(craft.split(data).header)
    hm["features"]["optional"].append(5)
    assert "non-strings" in mutate._meaning_diff(hm, json.loads(craft.split(data).header), "", 0)


def test_pool_reports_a_hang_and_a_dead_worker(tmp_path, monkeypatch):
    monkeypatch.setenv("HSNAP_MUTATE_INJECT", "2:hang,5:crash")
    tally = runner.run(8, SEED, jobs=1, timeout=2, mem_gib=2, cli_every=0, scratch=str(tmp_path))
    assert tally.n == 8
    assert tally.total["hang"] == 1 and tally.total["untyped"] == 1, tally.totals_line()
    by_i = {f["i"]: f for f in tally.failures}
    assert by_i[2]["cls"] == "hang" and by_i[5]["error"].startswith("worker died")
    assert tally.total["typed"] + tally.total["accepted-unchanged"] + tally.total["accepted-valid"] == 6


# -------------------------------------------------------------- huge literals

HUGE = ["1" + "0" * 308 + "1", "9" * 309, "9" * 400, "-" + "9" * 350, "-" + "9" * 400]
OUT_OF_RANGE = HUGE + ["1" + "0" * 400, "1e400", "-1e400", "1.7976931348623159e+308", "1" + "0" * 400 + ".5"]


@pytest.mark.parametrize("literal", OUT_OF_RANGE, ids=lambda s: f"{s[:6]}..{len(s)}")
def test_canonical_refuses_out_of_range_literals_typed(literal):
    for text in (literal, f"[{literal}]", '{"a":' + literal + "}"):
        with pytest.raises(canonical.CanonicalError, match="range|digits|characters"):
            canonical.loads(text.encode())


@pytest.mark.parametrize("text", ["-0", "-0.0", "1.0", "1E5", "1e5", "01", "0.10", "1" + "0" * 308, "9007199254740993",
                                  "[1e400]", "1e-400", "NaN", "-Infinity"])
def test_non_canonical_numbers_stay_refused(text):
    with pytest.raises(canonical.CanonicalError):
        canonical.loads(text.encode())


@pytest.mark.parametrize("text,value", [("0", 0), ("-9007199254740991", -(2**53 - 1)), ("100000000000000000000", 1e20),
                                        ("1e+21", 1e21), ("5e-324", 5e-324), ("1.7976931348623157e+308", 1.7976931348623157e308),
                                        ("0.00001", 1e-5)])
def test_canonical_numbers_still_decode(text, value):
    assert canonical.loads(text.encode()) == value


def _with_literal(data: bytes, path, literal: str) -> bytes:
    """``data`` re-signed with the value at ``path`` of its header replaced by a raw literal."""
    desc_ops = [{"op": "j.lit", "path": path, "text": literal}]
    return craft.resign(mutate._header_after_json_ops(data, desc_ops, True))


@pytest.mark.parametrize("path", [["request", "state_position"], ["sections", 0, "offset"], ["identity", "tp_size"],
                                  ["request", "sampling", "temperature"], ["geometry", "attention", "layers", 0]])
@pytest.mark.parametrize("literal", HUGE[:2] + HUGE[3:4], ids=lambda s: f"{len(s)}chars")
def test_header_with_huge_integer_is_a_typed_refusal(tmp_path, path, literal):
    p = craft.write(tmp_path / "huge.hsnap", _with_literal((VEC / "hybrid.hsnap").read_bytes(), path, literal))
    with pytest.raises(MalformedHeaderError, match="double range") as e:
        hsnap_format.open(p)
    assert e.value.field == "header" and "\n" not in str(e.value)


@pytest.mark.parametrize("key", ["state_position", "tp_size"])
def test_manifest_with_huge_integer_is_a_typed_refusal(tmp_path, key):
    d = tmp_path / "set"
    d.mkdir()
    for name in ("rank-0.hsnap", "rank-1.hsnap"):
        (d / name).write_bytes((VEC / "two-rank" / name).read_bytes())
    m = (VEC / "two-rank" / "manifest.json").read_bytes()
    (d / "manifest.json").write_bytes(craft.resign_manifest(mutate._manifest_after_json_ops(m, [{"op": "j.lit", "path": [key], "text": "9" * 309}])))
    with pytest.raises(MalformedManifestError, match="double range"):
        hsnap_format.open(d)


@pytest.mark.parametrize("command", ["info", "verify"])
def test_cli_says_one_line_without_traceback(tmp_path, command):
    p = craft.write(tmp_path / "huge.hsnap", _with_literal((VEC / "attention-only.hsnap").read_bytes(), ["request", "state_position"], "9" * 309))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([command, p])
    assert rc == 1
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and "MalformedHeaderError" in lines[0] and "Traceback" not in err.getvalue(), err.getvalue()


def test_mutants_of_the_run_with_huge_literals_are_typed(inputs, ctx):
    """The run's own operator (j_number with the 307-600 digit literals) over every target."""
    n = 0
    for target in inputs[0]:
        for lit in [x for x in mutate.NUMBER_LITERALS if len(x.lstrip("-")) >= 300]:
            obj = json.loads(inputs[0][target].partition(b"\n")[0] if mutate.is_manifest(target) else craft.split(inputs[0][target]).header)
            for path, _ in [n_ for n_ in mutate._nodes(obj, mutate._is_num, root=False)][:2]:
                desc = {"i": 1, "target": target, "resign": True, "operator": "j_number", "ops": [{"op": "j.lit", "path": path, "text": lit}]}
                r = mutate.examine(desc, ctx, cli=False)
                assert r["cls"] == "typed", (target, path, lit[:12], len(lit), r)
                n += 1
    assert n > 100


def test_viewer_refuses_with_one_line(tmp_path):
    app = pytest.importorskip("hsnap_view.app")
    p = craft.write(tmp_path / "huge.hsnap", _with_literal((VEC / "mla-fp8.hsnap").read_bytes(), ["request", "prompt_tokens"], "-" + "9" * 320))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = app.main([p])
    assert rc == 2 and len(err.getvalue().strip().splitlines()) == 1 and "double range" in err.getvalue(), err.getvalue()


# ------------------------------------------- what the 50,000-mutant run found (accepted-but-changed)


def test_unknown_key_in_features_is_ignored(tmp_path):
    """Spec 5.6 (as made normative for 1.1): other keys inside ``features`` are ignored, like
    unknown keys of every header object but section entries (that is how a minor adds fields)."""
    data = craft.mutate_header((VEC / "attention-only.hsnap").read_bytes(), lambda h: h["features"].__setitem__("zzz", []))
    p = craft.write(tmp_path / "features-key.hsnap", data)
    with hsnap_format.open(p) as snap:
        snap.verify()
        assert snap.header["features"]["zzz"] == []


def test_found_manifest_negative_minor_is_refused(tmp_path):
    """Spec 10.1/5: ``version`` is [int, int] and an int is >= 0; the reader accepted [1, -1] (7 of 50,000)."""
    d = tmp_path / "set"
    d.mkdir()
    for name in ("rank-0.hsnap", "rank-1.hsnap"):
        (d / name).write_bytes((VEC / "two-rank" / name).read_bytes())
    m = (VEC / "two-rank" / "manifest.json").read_bytes()
    (d / "manifest.json").write_bytes(craft.resign_manifest(mutate._manifest_after_json_ops(m, [{"op": "j.set", "path": ["version", 1], "value": -1}])))
    with pytest.raises(MalformedManifestError) as e:
        hsnap_format.open(d)
    assert e.value.field == "version"


def test_found_stop_string_over_4096_characters_is_refused(tmp_path):
    """Spec 5: a "string" is at most 4096 characters unless stated, and stop_strings is
    "≤ 1024 strings"; the reader (and so the writer) accepted a 4097-character stop string
    (3 of 50,000, caught by the independent reader)."""
    data = craft.mutate_header((VEC / "hybrid.hsnap").read_bytes(), lambda h: h["request"]["stop"]["stop_strings"].append("a" * 4097))
    p = craft.write(tmp_path / "long-stop.hsnap", data)
    with pytest.raises(MalformedHeaderError) as e:
        hsnap_format.open(p)
    assert e.value.field.startswith("request.stop.stop_strings")


# ============================================== the other targets
#
# python -m mutation --target reshard|resume|retract|gc|gc-url (mutation/targets.py):
# re-signed and raw mutants through re-sharded restores across TP sizes, resume_req and
# load_retracted on SGLang's own pools, and hsnap gc on mixed directories and prefixes.
# The full run is ``python -m mutation --target new --mutants 5000 --url-mutants 1000 --jobs 2``;
# here a bounded run of each on the small seeds, in this process, and the oracles shown
# to catch planted faults (so a run of zeros means something).

from mutation import targets as mt  # noqa: E402

TARGET_MUTANTS = {"reshard": 240, "resume": 200, "retract": 160, "gc": 160, "gc-url": 30}


@pytest.fixture(scope="module")
def target_seeds(tmp_path_factory):
    """target -> the small seeds (two models at TP 1/2/4, a few live Reqs, the gc layouts)."""
    root = tmp_path_factory.mktemp("mutate-seeds")
    built = {}

    def get(target):
        if target not in built:
            built[target] = mt.load_seeds(target, mt.build_seeds(target, str(root / target), small=True))
        return built[target]

    return get


def _store(server) -> dict:
    return {"options": server.options(), "bucket": server.make_bucket()}


def _target_failures(tally) -> str:
    return "\n".join(f"#{f['i']} {f['cls']} {f['desc']['target']} {f['desc']['operator']} re-signed={f['desc']['resign']} "
                     f"{json.dumps(f['desc']['ops'])[:240]}: {f.get('error', '')} {f.get('where', '')} {f.get('reason', '')} "
                     f"{f.get('message', '')[:200]}" for f in tally.failures)


def _bounded_run(target, seeds, tmp_path, **kw):
    n = TARGET_MUTANTS[target]
    tally = runner.run_target(target, n, SEED, seeds_dir=seeds.dir, jobs=0, timeout=30, scratch=str(tmp_path), **kw)
    assert tally.n == n
    assert tally.failed == 0, tally.totals_line() + "\n" + _target_failures(tally)
    return tally


@pytest.mark.parametrize("target", ["reshard", "resume", "retract"])
def test_mutation_run_through_sglang_pools_has_no_failures(target, target_seeds, tmp_path):
    """Re-signed and raw mutants through restore_request(sharding=...) across TP sizes,
    resume_req and load_retracted: only typed refusals that leave the pools byte-identical,
    and acceptances whose rows hold the source bytes (no sentinel, no byte from nowhere)."""
    seeds = target_seeds(target)
    tally = _bounded_run(target, seeds, tmp_path)
    # raw mutants are refused typed; re-signed ones get past the integrity layer to the
    # semantic checks, and some are accepted (the oracle ran on them)
    assert tally.by_variant["raw"]["typed"] > 0 and tally.by_variant["re-signed"]["typed"] > 0
    assert tally.by_variant["re-signed"]["accepted"] > 0
    focused = set(mt.generator(seeds).focused(random.Random(0), *([sorted(seeds.meta["sets"])[1]] if target == "reshard" else [])))
    assert focused - {"manifest", "rewrite"} <= set(tally.by_operator), sorted(focused - set(tally.by_operator))


def test_mutation_run_gc_has_no_failures(target_seeds, tmp_path):
    """Mutated directories (renamed, moved, truncated, re-marked, linked entries) through
    gc.collect(remove=True) and, every 10th, ``hsnap gc --remove``: no committed snapshot
    removed, moved or changed, and gc still removes the leftovers it proves unfinished."""
    tally = _bounded_run("gc", target_seeds("gc"), tmp_path)
    assert tally.removed > 0


def test_mutation_run_gc_url_has_no_failures(s3server, target_seeds, tmp_path):
    """The same against SeaweedFS: s3:// prefixes, sibling prefixes, multipart uploads."""
    tally = _bounded_run("gc-url", target_seeds("gc-url"), tmp_path, store=_store(s3server))
    assert tally.removed > 0


def test_target_mutants_are_a_function_of_seed_and_index(target_seeds):
    for target in ("reshard", "resume", "gc"):
        gen = mt.generator(target_seeds(target))
        a = [gen.generate(5, i) for i in range(30)]
        assert a == [gen.generate(5, i) for i in range(30)]
        assert a != [gen.generate(6, i) for i in range(30)]
        assert all(a[2 * k]["ops"] == a[2 * k + 1]["ops"] and not a[2 * k]["resign"] and a[2 * k + 1]["resign"] for k in range(15))


# ------------------------------------------------------- the oracles catch planted faults


def _unmutated(seeds, target, **extra):
    return dict({"i": 1, "seed": 0, "family": seeds.target, "target": target, "operator": "none", "operators": [], "resign": True,
                 "ops": []}, **extra)


def _reshard_case(seeds):
    return _unmutated(seeds, "swa-tp2/rank-1.hsnap", restore={"set": "swa-tp2", "model": "swa", "source_tp": 2, "target_tp": 1, "target_rank": 0})


def test_reshard_oracle_accepts_the_seed_and_catches_planted_bytes(target_seeds, tmp_path):
    """The unmutated TP 2 SWA set restored at TP 1 is accepted; the same restore with one
    element's bytes replaced afterwards is reported — garbage as uninitialised, the
    sentinel as unwritten — and a restore that writes another slot is reported."""
    import torch

    from hsnap_io import restore_request

    seeds = target_seeds("reshard")
    ex = mt.examiner(seeds, str(tmp_path / "x"))
    desc = _reshard_case(seeds)
    assert ex.examine(desc)["cls"] == "accepted"

    def planted(value, where="row"):
        def restore(*a, **kw):
            res = restore_request(*a, **kw)
            tgt = ex._pools("swa", 1, 0)
            b = next(b for b in tgt.bindings if b.kind == "swa_k")
            if where == "row":  # the last head of the last position's SWA row
                slot = tgt.kv.full_to_swa_index_mapping[res.token_indices[-1]]
                b.buffer[slot, -1].view(torch.uint8)[:] = value
            else:  # a free slot nobody restored into
                b.buffer[-1].view(torch.uint8)[:] = value
            return res
        return restore

    for value, cls, where in ((0x3C, "uninitialised-uploaded", "row"), (mt.SENTINEL, "accepted-unwritten", "row"),
                              (0x3C, "accepted-wrote-elsewhere", "free")):
        ex.restore = planted(value, where)
        r = ex.examine(desc)
        assert r["cls"] == cls, r
    ex.restore = None
    assert ex.examine(desc)["cls"] == "accepted"  # the pools came back to their baseline


def test_reshard_oracle_catches_ranks_that_disagree(target_seeds, tmp_path):
    """The agreement oracle on its own: rank 1 re-signed with another rid, judged against a
    real restore of the unmodified set."""
    from hsnap_io import reshard, restore_request

    seeds = target_seeds("reshard")
    ex = mt.examiner(seeds, str(tmp_path / "x"))
    desc = _reshard_case(seeds)
    tgt = ex._pools("swa", 1, 0)
    assert tgt.reset()
    files = mt.build(desc, seeds.inputs, seeds.groups)
    sharding = reshard.describe(mt.swa_tp_model(), 1, 0)
    res = restore_request(mt.write_files(str(tmp_path / "w"), files), req_to_token_pool=tgt.rtp, token_to_kv_pool_allocator=tgt.alloc,
                          identity=mt.reshard_identity(1, 0), sharding=sharding)
    assert mt.judge_reshard(files, desc, tgt, sharding, res)["cls"] == "accepted"
    other = mt.build(dict(desc, ops=[{"op": "j.set", "path": ["request", "rid"], "value": "another"}]), seeds.inputs, seeds.groups)
    r = mt.judge_reshard(other, desc, tgt, sharding, res)
    assert r["cls"] == "accepted-ranks-disagree" and "request.rid" in r["reason"], r


def test_refusals_that_leak_or_touch_the_pools_are_reported(target_seeds, tmp_path):
    """A refusal after taking a request row is leaked-slots; one after writing a free slot
    is pool-changed; load_retracted refusing with the Req bound to a row is req-changed."""
    import torch

    from hsnap_format import HsnapError

    seeds = target_seeds("resume")
    ex = mt.examiner(seeds, str(tmp_path / "x"))
    desc = _unmutated(seeds, "greedy-hybrid.hsnap")
    assert ex.examine(desc)["cls"] == "accepted"

    def leaks(path, *, req_to_token_pool, **kw):
        req_to_token_pool.alloc_rows(1)
        raise HsnapError(str(path), "planted", "nothing taken", "a row taken")

    def touches(path, *, token_to_kv_pool_allocator, **kw):
        b = token_to_kv_pool_allocator.get_kvcache().full_kv_pool.k_buffer[0]
        b[-1].view(torch.uint8)[:] = 1
        raise HsnapError(str(path), "planted", "nothing written", "a free slot written")

    for call, cls in ((leaks, "leaked-slots"), (touches, "pool-changed")):
        ex.call = call
        assert ex.examine(desc)["cls"] == cls
    ex.call = None
    assert ex.examine(desc)["cls"] == "accepted"

    rseeds = target_seeds("retract")
    rex = mt.examiner(rseeds, str(tmp_path / "r"))
    rdesc = _unmutated(rseeds, "greedy-hybrid.hsnap")
    assert rex.examine(rdesc)["cls"] == "accepted"

    def binds(path, req, **kw):
        req.kv.req_pool_idx = 1
        raise HsnapError(str(path), "planted", "the Req untouched", "bound to row 1")

    rex.call = binds
    assert rex.examine(rdesc)["cls"] == "req-changed"


def test_resume_oracle_catches_a_req_a_fresh_request_could_not_be(target_seeds, tmp_path):
    """A resumed Req that SamplingParams.verify refuses, or with an id outside the
    vocabulary, or whose rows do not hold the file's bytes, is reported."""
    import torch

    from hsnap_sglang.req import resume_req

    seeds = target_seeds("resume")
    ex = mt.examiner(seeds, str(tmp_path / "x"))
    desc = _unmutated(seeds, "greedy-hybrid.hsnap")

    def after(fix):
        def call(*a, **kw):
            req = resume_req(*a, **kw)
            fix(req)
            return req
        return call

    def garbage_row(req):
        tgt = ex._pools("hybrid_linear", 1)
        b = next(b for b in tgt.bindings if b.space == "mamba")
        b.buffer[int(req.kv.mamba_pool_idx)].view(torch.uint8).reshape(-1)[:4] = 0x3C

    for fix, cls in ((lambda r: setattr(r.sampling_params, "temperature", -1.0), "accepted-invalid-req"),
                     (lambda r: r.output_ids.append(10**6), "accepted-invalid-req"),
                     (garbage_row, "uninitialised-uploaded")):
        ex.call = after(fix)
        r = ex.examine(desc)
        assert r["cls"] == cls, r


def test_gc_oracle_catches_a_removed_committed_snapshot(target_seeds, tmp_path):
    """gc.collect followed by the removal of one committed snapshot is reported, even when
    gc itself said nothing."""
    from hsnap_format.stores import gc

    seeds = target_seeds("gc")
    ex = mt.examiner(seeds, str(tmp_path / "x"), cli_every=0)
    desc = {"i": 1, "seed": 0, "family": "gc", "target": "layout1", "operator": "none", "operators": [], "resign": False, "ops": [],
            "layout": 1, "mode": "older_than=0"}
    assert ex.examine(desc)["cls"] in ("accepted", "committed-removed")  # the library's verdict on the seed layout

    def removes(target, **kw):
        items = gc.collect(target, **kw)
        os.unlink(os.path.join(target, "plain.hsnap"))
        return items

    ex.collect = removes
    r = ex.examine(desc)
    assert r["cls"] == "committed-removed" and "plain.hsnap removed" in r["reason"], r


def test_pool_copy_puts_back_every_byte_and_notices_a_change(target_seeds, tmp_path):
    """The harness's own copy of the pools (not hsnap_io's checkpoint): after an accepted
    restore it puts back every buffer, free list and mapping; a changed free list shows."""
    seeds = target_seeds("resume")
    ex = mt.examiner(seeds, str(tmp_path / "x"))
    assert ex.examine(_unmutated(seeds, "logprobs-topk-swa.hsnap"))["cls"] == "accepted"
    tgt = ex._pools("swa_mamba", 1)
    assert tgt.changed()  # the accepted restore holds slots now
    assert tgt.reset() and tgt.changed() == []
    tgt.rtp.free_slots.append(tgt.rtp.free_slots[0])
    assert tgt.changed()
    assert tgt.reset() and mt.free_counts(tgt.rtp, tgt.alloc) == tgt.baseline_free


# ------------------------------------------- live migration and chains (mutation/migrate.py)
#
# python -m mutation --target migrate|chain: hostile links fed to a MigrationTarget after k correct
# ones (apply / step / follow) and chains (plain, checkpoint directories, TP-2 sets) restored with a
# link anywhere mutated, into SGLang's pools with sentinel-filled free rows; the full run is
# ``python -m mutation --target migrate,chain --mutants 3000 --jobs 2``.

from mutation import migrate as mm  # noqa: E402

MIGRATE_MUTANTS = {"migrate": 60, "chain": 60}


@pytest.fixture(scope="module")
def migrate_seeds(tmp_path_factory):
    """target -> seeds: the small set (the hybrid kind: a migration, its foreign links, checkpoints,
    a TP-2 chain), built once for both targets."""
    import torch

    threads = torch.get_num_threads()
    d = mt.build_seeds("chain", str(tmp_path_factory.mktemp("mutate-migrate") / "seeds"), small=True)
    yield lambda target: mt.load_seeds(target, d)
    torch.set_num_threads(threads)  # the examiners' warm() runs torch on one thread


def _examiner(seeds, tmp_path):
    ex = mt.examiner(seeds, str(tmp_path / "x"))
    ex.warm()
    return ex


@pytest.mark.parametrize("target", ["migrate", "chain"])
def test_mutation_run_migrate_and_chain_have_no_failures(target, migrate_seeds, tmp_path):
    """Raw and re-signed mutants: refused typed with the pools and free lists byte-identical
    (migrate: then the correct links apply and the request ends byte-equal to the source's,
    and release gives every slot back), or accepted holding exactly what the accepted file says."""
    n = MIGRATE_MUTANTS[target]
    tally = runner.run_target(target, n, SEED, seeds_dir=migrate_seeds(target).dir, jobs=0, timeout=30, scratch=str(tmp_path))
    assert tally.n == n
    assert tally.failed == 0, tally.totals_line() + "\n" + _target_failures(tally)
    assert tally.by_variant["raw"]["typed"] > 0 and tally.by_variant["re-signed"]["typed"] > 0
    assert tally.total["accepted-unchanged"] + tally.total["accepted-valid"] > 0


def _mig(seeds, target, k, scenario="swap", mode="apply", **extra):
    return {"i": 0, "seed": 0, "family": "migrate", "target": target, "operator": scenario, "operators": [scenario], "resign": False,
            "ops": [], "mig": dict({"kind": "hl", "k": k, "mode": mode, "scenario": scenario}, **extra)}


def test_migrate_hostile_links_are_refused_and_the_migration_goes_on(migrate_seeds, tmp_path):
    """Each kind of hostile next link, through apply, step and follow: typed, pools and
    free lists as before, and the correct links still apply to a request byte-equal to the source's."""
    seeds = migrate_seeds("migrate")
    ex = _examiner(seeds, tmp_path)
    rebased = {"resign": True, "ops": mm.rebase_ops(seeds.inputs["hl/link-0001.hsnap"], "link-0001.hsnap")}
    cases = [
        ("hl-fork/final.hsnap", 3, "swap", {}, "ChainError"),  # a final whose output ids do not extend the applied link's
        ("hl/link-0001.hsnap", 2, "swap", {}, "DigestMismatchError"),  # the same link twice
        ("hl/final.hsnap", 2, "swap", {}, "DigestMismatchError"),  # a link skipped
        ("hl/link-0000.hsnap", 1, "swap", {}, "ChainError"),  # the plain link again
        ("hl-again/link-0002.hsnap", 2, "swap", {}, "DigestMismatchError"),  # another migration of the request
        ("hl-rid/link-0002.hsnap", 2, "swap", rebased, "ChainError"),  # another request, naming the applied link
        ("hl-model/link-0002.hsnap", 2, "swap", rebased, "ChainError"),  # another model, naming the applied link
        ("hl/link-0002.hsnap", 2, "missing", {}, "HsnapIOError"),
        ("hl/link-0002.hsnap", 2, "abandon", {"marker": "dir", "present": False}, "MigrationError"),
        ("hl/link-0002.hsnap", 2, "accept", {"raise": "runtime"}, "caller Refusal"),
        ("hl/link-0000.hsnap", 0, "accept", {"raise": "hsnap"}, "HsnapError"),
    ]
    for target, k, scenario, over, error in cases:
        for mode in ("apply", "step", "follow"):
            if scenario == "abandon" and mode == "apply":
                continue
            desc = _mig(seeds, target, k, scenario, mode, **{x: v for x, v in over.items() if x in ("marker", "present", "raise")})
            desc.update({x: v for x, v in over.items() if x in ("resign", "ops")})
            r = ex.examine(desc)
            want = "waits (step: None)" if (scenario, mode) == ("missing", "step") else "MigrationError" if (scenario, mode) == ("missing", "follow") else error
            assert (r["cls"], r["error"]) == ("typed", want), (target, k, scenario, mode, r)
    assert ex.examine(_mig(seeds, "hl/final.hsnap", 3, "accept", "step", **{"raise": "none-once"}))["cls"] == "accepted-unchanged"
    for rank in (0, 1):  # across TP sizes: a set delta re-signed to name another base digest, its manifest re-bound
        tp = _mig(seeds, "tp12/link-0002.hsnap/rank-0.hsnap", 2, "bytes")
        tp.update(resign=True, ops=[{"op": "j.set", "path": ["base", "root_digest"], "value": "0" * 32}])
        tp["mig"].update(kind="tp12", rank=rank)
        r = ex.examine(tp)
        assert (r["cls"], r["error"]) == ("typed", "DigestMismatchError"), r
    for mode in ("step", "follow"):  # a round whose .applied marker cannot be put is still applied, and says so
        assert ex.examine(_mig(seeds, "hl/link-0001.hsnap", 1, "marker", mode))["cls"] == "accepted-unchanged"


def test_migrate_oracle_catches_planted_faults(migrate_seeds, tmp_path, monkeypatch):
    """The oracle is not the library's: a target that skips the output-id check accepts the
    diverging final (accepted-but-changed); one that uploads a wrong byte is caught; one that
    leaks a row on refusal, or cannot take the correct link after one, is caught — at one TP
    size and across TP sizes (a TP-1 source's set links followed by a TP-2 target rank)."""
    import torch

    import hsnap_io.migrate as mig

    seeds = migrate_seeds("migrate")
    ex = _examiner(seeds, tmp_path)
    fork = _mig(seeds, "hl-fork/final.hsnap", 3)
    assert ex.examine(fork)["cls"] == "typed"
    monkeypatch.setattr(mig, "np", type("np", (), {"array_equal": staticmethod(lambda a, b: True)}))
    r = ex.examine(fork)
    assert r["cls"] == "accepted-but-changed" and "output ids do not extend" in r["reason"], r
    monkeypatch.undo()

    class Corrupts(mig.MigrationTarget):
        def apply(self, *a, **kw):
            out = super().apply(*a, **kw)
            b = next(b for b in self.view.bindings if b.kind == "attn_k")
            b.buffer[int(self.request.token_indices[-1])].view(torch.uint8).reshape(-1)[0] ^= 1
            return out

    class Leaks(mig.MigrationTarget):
        def _prove_delta(self, *a, **kw):
            self.view.req_to_token_pool.alloc_rows(1)
            return super()._prove_delta(*a, **kw)

    class Stuck(mig.MigrationTarget):
        refused = False

        def _prove_delta(self, p, *a, **kw):
            if self.refused:
                raise mig.MigrationError(p, "planted", "the correct link", "refused forever")
            try:
                return super()._prove_delta(p, *a, **kw)
            except hsnap_format.HsnapError:
                self.refused = True
                raise

    honest = _mig(seeds, "hl/final.hsnap", 3, "accept", **{"raise": "none-once"})  # the correct final, accepted by the caller
    tp = _mig(seeds, "tp12/final.hsnap", 3, "accept", **{"raise": "none-once"})  # across TP sizes: rank 1 of a TP-2 target
    tp["mig"]["kind"], tp["mig"]["rank"] = "tp12", 1
    tp_swap = _mig(seeds, "tp12/link-0001.hsnap", 2)  # link-0001 again as the third link
    tp_swap["mig"]["kind"], tp_swap["mig"]["rank"] = "tp12", 0
    assert ex.examine(tp)["cls"] == "accepted-unchanged" and ex.examine(tp_swap)["cls"] == "typed"
    for cls, desc, want in ((Corrupts, honest, "accepted-but-changed"), (Leaks, _mig(seeds, "hl/link-0001.hsnap", 2), "leaked-slots"),
                            (Stuck, _mig(seeds, "hl/link-0001.hsnap", 2), "not-resumable"), (Corrupts, tp, "accepted-but-changed"),
                            (Leaks, tp_swap, "leaked-slots"), (Stuck, tp_swap, "not-resumable")):
        ex.target_cls = cls
        r = ex.examine(desc)
        assert r["cls"] == want, (cls.__name__, r)
    ex.target_cls = None
    assert ex.examine(honest)["cls"] == "accepted-unchanged"  # the pools came back to their baseline


def _chain(target, head="final.hsnap", scenario="swap", resign=False, ops=(), **over):
    ch = dict({"kind": "hl", "group": "hl", "head": head, "ck": False, "scenario": scenario}, **over)
    return {"i": 0, "seed": 0, "family": "chain", "target": target, "operator": scenario, "operators": [scenario], "resign": resign,
            "ops": list(ops), "chain": ch}


def test_chain_hostile_links_are_refused_pools_identical(migrate_seeds, tmp_path):
    """A chain restored with a hostile link below its head: another migration's link of the same
    request (its digest is not the one named), a missing link, a link naming itself (a cycle,
    re-signed), a link whose output ids do not extend its base's, a TP-2 chain's rank file swapped for
    the other rank's: each typed, pools identical. A stray newest checkpoint (another chain's, or
    truncated) is passed over for the newest link that verifies."""
    seeds = migrate_seeds("chain")
    ex = _examiner(seeds, tmp_path)
    own = [{"op": "j.set", "path": ["base", "name"], "value": "link-0001.hsnap"}]
    tp = {"group": "hl-tp2", "head": "link-3", "tp": True, "rank": 1, "mutated": 2}
    cases = [
        (_chain("hl-again/link-0001.hsnap", mutated=1, swap="hl-again/link-0001.hsnap"), "DigestMismatchError"),
        (_chain("hl/link-0001.hsnap", scenario="missing", remove="link-0001.hsnap"), "ChainError"),
        (_chain("hl/link-0001.hsnap", scenario="bytes", resign=True, ops=own, mutated=1, head="link-0001.hsnap"), "ChainError"),
        (_chain("hl-tp2/link-2/rank-0.hsnap", scenario="swap", swap="hl-tp2/link-2/rank-0.hsnap", **tp), "MalformedManifestError"),
        (_chain("hl-tp2/link-2/rank-0.hsnap", scenario="swap", swap="hl-tp2/link-2/rank-0.hsnap", resign=True, **tp), "MalformedManifestError"),
    ]
    for desc, error in cases:
        r = ex.examine(desc)
        assert (r["cls"], r["error"]) == ("typed", error), (desc["target"], desc["chain"], r)
    # a stray newest checkpoint — a fork's link whose chain does not hold, or a truncated one — is passed over: the
    # resume takes the newest link that verifies (hsnap_format.checkpoints.choose_links), restored exactly
    for desc in (_chain("hl-fork/final.hsnap", scenario="stray", group="hl-ck", ck=True, head=mm.CK_NAMES[-1], stray="c.ck000005.hsnap"),
                 _chain("hl/link-0000.hsnap", scenario="stray", group="hl-ck", ck=True, head=mm.CK_NAMES[-1], stray="c.ck000005.hsnap",
                        stray_trunc=4096)):
        r = ex.examine(desc)
        assert r["cls"] in ("accepted-unchanged", "accepted-valid"), (desc["target"], desc["chain"], r)
    fork = ex.examine(_chain("hl-fork/final.hsnap", scenario="stray", stray="final.hsnap"))  # the diverging final as the head
    assert (fork["cls"], fork["error"], fork["field"]) == ("typed", "ChainError", "request.output_ids"), fork


def test_chain_oracle_catches_planted_faults(migrate_seeds, tmp_path):
    """Chain restores: the honest head accepted unchanged; a restore that changes one byte of
    the request's rows after the upload, or that writes a free slot, is caught."""
    import torch

    from hsnap_io import restore_request

    seeds = migrate_seeds("chain")
    ex = _examiner(seeds, tmp_path)
    desc = {"i": 0, "seed": 0, "family": "chain", "target": "hl/final.hsnap", "operator": "none", "operators": [], "resign": False, "ops": [],
            "chain": {"kind": "hl", "group": "hl", "head": "final.hsnap", "ck": False, "scenario": "stray", "stray": ".unused.hsnap"}}
    assert ex.examine(desc)["cls"] == "accepted-unchanged"

    def planted(where):
        def restore(*a, **kw):
            res = restore_request(*a, **kw)
            b = next(b for b in ex.mig._pools("hl").bindings if b.kind == "attn_v")
            slot = int(res.token_indices[5]) if where == "row" else -1
            b.buffer[slot].view(torch.uint8).reshape(-1)[0] ^= 1
            return res
        return restore

    for where, reason in (("row", "differ from the file's"), ("free", "outside the request's slots")):
        ex.restore = planted(where)
        r = ex.examine(desc)
        assert r["cls"] == "accepted-but-changed" and reason in r["reason"], r
    ex.restore = None
    assert ex.examine(desc)["cls"] == "accepted-unchanged"

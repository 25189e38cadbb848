"""The compaction target of the mutation run (mutation/compact.py), small enough for CI:
hostile chains and paged files (re-signed: every digest honest) compacted with
``compact_path``; every output compared with the restore of the same head into SGLang's
pools. The full run is ``python -m mutation --target compact --mutants 5000 --jobs 2``."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from mutation import run as runner  # noqa: E402
from mutation import targets as mt  # noqa: E402

SEED = 20260110
MUTANTS = 60


@pytest.fixture(scope="module")
def compact_seeds(tmp_path_factory):
    """The small set: the hybrid kind's migration, checkpoints, TP-2 chain and paged chain."""
    import torch

    threads = torch.get_num_threads()
    d = mt.build_seeds("compact", str(tmp_path_factory.mktemp("mutate-compact") / "seeds"), small=True)
    yield mt.load_seeds("compact", d)
    torch.set_num_threads(threads)  # the examiner's warm() runs torch on one thread


def _examiner(seeds, tmp_path):
    ex = mt.examiner(seeds, str(tmp_path / "x"))
    ex.warm()
    return ex


def _paged(ops, *, resign=True, mutated=3, scenario="refs", **over):
    """A paged-chain mutant of ``hl-pg``: link ``mutated`` with JSON ``ops``, the final link the head."""
    ch = dict({"kind": "hl", "group": "hl-pg", "head": "final.hsnap", "ck": False, "paged": True, "scenario": scenario, "mutated": mutated}, **over)
    return {"i": 0, "seed": 0, "family": "compact", "target": f"hl-pg/link-{mutated:04d}.hsnap" if mutated < 3 else "hl-pg/final.hsnap",
            "operator": scenario, "operators": [scenario], "resign": resign, "ops": list(ops), "chain": ch}


def test_mutation_run_compact_has_no_failures(compact_seeds, tmp_path):
    """Raw and re-signed mutants of chains and paged chains: refused typed with nothing left
    under the output's name, or compacted into what the restore of the same head holds."""
    tally = runner.run_target("compact", MUTANTS, SEED, seeds_dir=compact_seeds.dir, jobs=0, timeout=60, scratch=str(tmp_path))
    assert tally.n == MUTANTS
    assert tally.failed == 0, tally.totals_line() + "\n" + json.dumps([{k: f.get(k) for k in ("i", "cls", "reason", "error")} for f in tally.failures])
    assert tally.by_variant["raw"]["typed"] > 0 and tally.by_variant["re-signed"]["typed"] > 0
    assert tally.total["accepted-unchanged"] + tally.total["accepted-valid"] > 0


def test_compact_oracle_catches_a_laundered_chain(compact_seeds, tmp_path, monkeypatch):
    """The final link's page reference re-pointed at an earlier page's object (re-signed): refused
    typed as the restore refuses it; with the compaction's proof and page checks planted away
    (the restore keeps its own), it writes it and the oracle calls it laundered."""
    from hsnap_format import chain as hchain
    from hsnap_format import pages as pg

    ex = _examiner(compact_seeds, tmp_path)
    base_refs = mt.header_of(compact_seeds.inputs["hl-pg/link-0000.hsnap"])["pages"]["refs"]
    desc = _paged(mt.json_set(("pages", "refs", 0), list(base_refs[-1])))
    r = ex.examine(desc)
    assert (r["cls"], r["error"]) == ("typed", "DigestMismatchError") and r["field"] == "pages.refs[] (key of page N)", r
    honest = dict(desc, ops=[], chain=dict(desc["chain"], scenario="none"))
    assert ex.examine(honest)["cls"] == "accepted-unchanged"
    real = hchain.compact

    def laundering(chain, path, **kw):  # the compaction as it was: no proof, page objects unchecked
        with monkeypatch.context() as m:
            m.setattr(pg, "check_page", lambda *a, **k: None)
            return real(chain, path, **dict(kw, proved=True))

    monkeypatch.setattr(hchain, "compact", laundering)
    r = ex.examine(desc)
    assert r["cls"] == "compact-laundered" and "key of page" in r["reason"], r


def test_compact_mutants_are_a_function_of_seed_and_index(compact_seeds):
    gen = mt.generator(compact_seeds)
    a = [gen.generate(5, i) for i in range(40)]
    assert a == [gen.generate(5, i) for i in range(40)]
    assert a != [gen.generate(6, i) for i in range(40)]
    assert all(a[2 * k]["ops"] == a[2 * k + 1]["ops"] and not a[2 * k]["resign"] and a[2 * k + 1]["resign"] for k in range(20))
    assert any(d["chain"].get("paged") for d in a) and any(not d["chain"].get("paged") for d in a)

"""The mutation run's compaction target: ``python -m mutation --target compact`` (registered in
mutation/targets.py, whose pools, classes and helpers it shares with mutation/migrate.py).

Seeds: the chain target's (a live migration's links and a checkpoint directory per pool kind,
a TP-2 chain of set directories; mutation/migrate.py) and, per pool kind, the same request
exported as a chain whose every link references its full pages in a page store beside it
(``<kind>-pg/``: ``link-0000`` plain with pages 0-5, three deltas with one page each and rows
around them; page size 4, spec 5.10).

Mutant ``i``: half the time the chain target's mutant ``i`` (a link below the head mutated —
re-signed: the links above re-based on it —, removed, swapped, a stray checkpoint); else a
paged chain with a link's bytes or header mutated, one of its page references re-pointed (at
another reference's object — the object of an earlier page of the base, of the same link —,
its key or root digest alone, dropped, duplicated), its ``pages`` fields changed, a page
object mutated, removed or replaced by another, or a page object mutated, re-signed, stored
under its new name and the reference re-pointed at it (the link re-signed, the links above
re-based). Raw and re-signed variants, as every target.

Each mutant is compacted with :func:`hsnap_format.chain.compact_path`. The oracle:

  typed                 refused with an HsnapError, and nothing left: no output under its  ok
                        name, no temporary
  accepted-unchanged    compacted; the restore of the same head (``restore_request``,        ok
                        digests checked) holds, byte for byte, what the output says — every
                        pool row of the request, its position, its output ids — and the
                        output is the honest chain's compaction
  accepted-valid        the same, of a mutant that is a valid chain of its own (other bytes) ok
  compact-laundered     compacted a chain the restore of the same head refuses               FAILURE
  accepted-wrong-bytes  compacted, and the restore holds other bytes than the output says,   FAILURE
                        or the output is not a plain snapshot of the head's request
  refused-left-output   refused, but something is left under the output's name or a        FAILURE
                        temporary beside it
  untyped, hang, harness-error: as mutation/targets.py says
"""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np

from hsnap_format.errors import HsnapError
from mutation import migrate as mm
from mutation import targets as mt

PG_PAGE = 4  # the page store's page size: every link has full pages and rows around them
PAGE_SUFFIX = ".hpage"


# ============================================================================ seeds


def _paged_into(directory: str, kind: str, page: int) -> None:
    """The migration's request exported at each of its positions as a chain whose links
    reference their full pages in ``directory/pages`` (SGLang's own page keys)."""
    import chain_cases as cc

    from hsnap_io.pagestore import page_store

    ps, req = cc.source(kind, page)
    os.makedirs(directory, exist_ok=True)
    paths: list[str] = []
    with page_store(os.path.join(directory, "pages"), page_size=PG_PAGE) as store:
        for i, pos in enumerate(mm.POSITIONS):
            if i:
                cc.step(ps, req, i, 0, 0)
            p = os.path.join(directory, mm.LINKS[i])
            cc.export(ps, req, p, pos, base=paths[-1] if paths else None, snapshot_id=f"pg-{i}", fsync=False, pages=store)
            paths.append(p)


def build_seeds(out: str, small: bool = False) -> None:
    mm.build_seeds(out, small)
    with open(os.path.join(out, "seeds.json")) as f:
        meta = json.load(f)
    meta["paged"] = {}
    for key, k in sorted(meta["kinds"].items()):
        g = f"{key}-pg"
        _paged_into(os.path.join(out, g), k["kind"], k["page"])
        pages = sorted(n for n in os.listdir(os.path.join(out, g, "pages")) if n.endswith(PAGE_SUFFIX))
        meta["paged"][g] = {"kind": key, "links": list(mm.LINKS), "pages": pages}
    with open(os.path.join(out, "seeds.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)


def load_inputs(d: str, meta: dict) -> tuple[dict, dict]:
    inputs, groups = mm.load_inputs(d, meta)
    for g, p in sorted(meta.get("paged", {}).items()):
        groups[g] = list(p["links"]) + [f"pages/{n}" for n in p["pages"]]
        for m in groups[g]:
            inputs[f"{g}/{m}"] = mt.read_file(os.path.join(d, g, m))
    return inputs, groups


# ============================================================================ generation


def _refs(data: bytes) -> list:
    p = mt.header_of(data).get("pages")
    return list(p["refs"]) if isinstance(p, dict) else []


def _page_file(data: bytes, ref) -> str:
    return f"pages/{mt.header_of(data)['pages']['namespace_id']}-{ref[0]}-{ref[1]}{PAGE_SUFFIX}"


class CompactGen(mm.LinkGen):
    def __init__(self, inputs, groups, meta) -> None:
        super().__init__(inputs, groups, meta)
        self.chain = mm.ChainGen(inputs, groups, meta)

    def generate(self, seed: int, i: int) -> dict:
        rng = random.Random(f"hsnap-mutate-compact:{seed}:{i // 2}")
        if self.meta.get("paged") and rng.random() < 0.5:
            return self._paged(rng, seed, i)
        desc = self.chain.generate(seed, i)
        desc["family"] = "compact"
        return desc

    def _paged(self, rng, seed: int, i: int) -> dict:
        group = mt.pick(rng, sorted(self.meta["paged"]))
        names = list(mm.LINKS)
        head = len(names) - 1 if rng.random() < 0.7 else rng.randrange(len(names))
        j = rng.randrange(head + 1)
        link = f"{group}/{names[j]}"
        scenario = rng.choices(["bytes", "refs", "page", "page-missing", "page-swap", "page-repoint"], [30, 30, 15, 5, 8, 12])[0]
        ch = {"kind": self.meta["paged"][group]["kind"], "group": group, "head": names[head], "ck": False, "paged": True,
              "scenario": scenario, "mutated": j}
        base = {"i": i, "seed": seed, "family": "compact", "resign": bool(i % 2)}
        if scenario == "refs":
            got = self._ref_ops(rng, group, names, j)
            if got is not None:
                op, ops = got
                return dict(base, target=link, operator=f"refs-{op}", operators=[f"refs-{op}"], ops=ops, chain=ch)
            scenario = ch["scenario"] = "bytes"
        if scenario == "bytes":
            desc = mm.draw_bytes(rng, seed, i, "compact", self.inputs, link)
            desc.update(chain=ch)
            return desc
        # a page object referenced by link j (every link of these seeds has at least one)
        refs = _refs(self.inputs[link])
        r = rng.randrange(len(refs))
        page = _page_file(self.inputs[link], refs[r])
        ch.update(page=page, ref=r)
        if scenario in ("page", "page-repoint"):
            data = self.inputs[f"{group}/{page}"]
            desc = mt.generate_with(rng, seed, i, "compact", {mm.ONE: data}, {}, {}, p_generic=1.0)
            desc.update(target=f"{group}/{page}", chain=ch)
            return desc
        if scenario == "page-swap":
            others = [n for n in self.groups[group] if n.startswith("pages/") and n != page]
            ch["swap"] = mt.pick(rng, others)
        return dict(base, target=f"{group}/{page}", operator=scenario, operators=[scenario], ops=[], chain=ch)

    def _ref_ops(self, rng, group: str, names: list, j: int):
        data = self.inputs[f"{group}/{names[j]}"]
        refs = _refs(data)
        if not refs:
            return None
        below = [ref for n in names[: j + 1] for ref in _refs(self.inputs[f"{group}/{n}"])]  # this link's and its bases'
        k = rng.randrange(len(refs))
        other = mt.pick(rng, [x for x in below if x != refs[k]] or below)
        act = rng.choice(["other", "other", "root", "key", "drop", "dup", "swap", "page_size", "namespace", "store", "no-pages"])
        if act == "other":  # the reference names another page's object, whole (key and root)
            return act, mt.json_set(("pages", "refs", k), list(other))
        if act == "root":
            return act, mt.json_set(("pages", "refs", k, 1), other[1])
        if act == "key":
            return act, mt.json_set(("pages", "refs", k, 0), other[0])
        if act == "drop":
            return act, [{"op": "j.del", "path": ["pages", "refs", k]}] if len(refs) > 1 else mt.json_set(("pages", "refs"), [])
        if act == "dup":
            return act, [{"op": "j.ins", "path": ["pages", "refs"], "at": rng.randrange(len(refs) + 1), "value": list(other)}]
        if act == "swap" and len(refs) > 1:
            return act, [{"op": "j.swap", "path": ["pages", "refs"], "a": 0, "b": len(refs) - 1}]
        if act == "page_size":
            return act, mt.json_set(("pages", "page_size"), mt.pick(rng, [1, 2, 3, 8, 16, 0, 1 << 20]))
        if act == "namespace":
            return act, mt.json_set(("pages", "namespace_id"), mt.pick(rng, ["0" * 64, "f" * 64, other[0]]))
        if act == "store":
            return act, mt.json_set(("pages", "store"), mt.pick(rng, ["pages2", "..", "", ".", "pages/", "../pages", "link-0000.hsnap"]))
        return "no-pages", [{"op": "j.del", "path": ["pages"]}]


# ============================================================================ files


def paged_files(desc: dict, inputs: dict, groups: dict) -> dict[str, bytes]:
    """A paged mutant's files (``link-…``, ``pages/…`` -> bytes)."""
    ch = desc["chain"]
    group = ch["group"]
    files = {m: inputs[f"{group}/{m}"] for m in groups[group]}
    names = list(mm.LINKS)
    head, j, sc = names.index(ch["head"]), ch["mutated"], ch["scenario"]
    if sc in ("bytes", "refs"):
        files[names[j]] = mm.mutated(desc, inputs)
        if desc["resign"]:
            mm.rebase_above(files, names, j, head)
    elif sc == "page":
        files[ch["page"]] = mm.mutated(desc, inputs)
    elif sc == "page-missing":
        del files[ch["page"]]
    elif sc == "page-swap":
        files[ch["page"]] = inputs[f"{group}/{ch['swap']}"]
    elif sc == "page-repoint":  # the mutated page under its own new name, the reference at it
        new = mm.mutated(desc, inputs)
        key, root = _refs(files[names[j]])[ch["ref"]][0], mm.root_digest(new)
        try:
            key = mt.header_of(new)["page"]["key"]
        except Exception:  # noqa: BLE001 - a header this oracle cannot read: the old key
            pass
        if not (isinstance(key, str) and isinstance(root, str) and "/" not in key):
            files[ch["page"]] = new
            return files
        ops = mt.json_set(("pages", "refs", ch["ref"]), [key, root])
        files[names[j]] = mt.core.build({"target": mm.ONE, "resign": True, "ops": ops}, {mm.ONE: files[names[j]]}, {})[mm.ONE]
        files[_page_file(files[names[j]], [key, root])] = new
        mm.rebase_above(files, names, j, head)
    return files


def mutant_files(seeds, desc: dict) -> dict[str, bytes]:
    if desc["chain"].get("paged"):
        return paged_files(desc, seeds.inputs, seeds.groups)
    return mm.chain_files(desc, seeds.inputs, seeds.groups)


# ============================================================================ the oracle


def _plain_sections(data: bytes) -> tuple[dict, dict]:
    """A compacted output as this oracle reads it: its header and {section name: raw bytes}."""
    header, secs = mt.parse_rank(data)
    return header, {n: e["raw"] for n, e in secs.items()}


class CompactExaminer:
    """compact_path of a chain's head (or the newest checkpoint); a refusal must leave nothing,
    an output must hold what the restore of the same head puts in the pools."""

    def __init__(self, seeds, scratch: str) -> None:
        self.seeds, self.scratch = seeds, scratch
        self.chain = mm.ChainExaminer(seeds, scratch)  # its pools (one set per kind, and per rank of the TP chain)
        self.honest: dict[tuple, bytes] = {}  # (group, head, rank) -> the honest chain's compacted rank file

    def warm(self) -> None:
        self.chain.warm()

    def _write(self, files: dict, c: str) -> None:
        if os.path.lexists(c):
            shutil.rmtree(c)
        for n, data in files.items():
            mt.write_file(os.path.join(c, n), data)
        os.makedirs(c, exist_ok=True)

    def _out(self) -> str:
        out = os.path.join(self.scratch, "out")
        for n in os.listdir(self.scratch):
            if n not in ("c", "h"):
                p = os.path.join(self.scratch, n)
                shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
        return out

    def _leftovers(self, c: str, files: dict) -> str | None:
        extra = [n for n in os.listdir(self.scratch) if n not in ("c", "h")]
        if extra:
            return f"left beside the output: {sorted(extra)[:4]}"
        tops = {n.split("/")[0] for n in files}
        new = [n for n in os.listdir(c) if n not in tops]
        return f"left in the chain's directory: {sorted(new)[:4]}" if new else None

    def examine(self, desc: dict) -> dict:
        from hsnap_format.chain import compact_path
        from hsnap_format.checkpoints import newest_links

        ch = desc["chain"]
        try:
            files = mutant_files(self.seeds, desc)
            c = os.path.join(self.scratch, "c")
            self._write(files, c)
            out = self._out()
        except Exception as e:  # noqa: BLE001
            r = mt.untyped(e, "build")
            r["cls"] = "harness-error"
            return r
        head, stage = ch["head"], "compact"
        try:
            if ch["ck"]:
                stage = "newest_links"
                head = os.path.basename(newest_links(c).get("c", os.path.join(c, head)))
            stage = "compact"
            compact_path(os.path.join(c, head), out, fsync=False)
        except HsnapError as e:
            r = mt.typed(e, stage)
            left = self._leftovers(c, files)
            return mt.fail("refused-left-output", "after refusal", left) if left else r
        except BaseException as e:  # noqa: BLE001
            if mt.is_control(e):
                raise
            return mt.untyped(e, stage)
        try:
            return self._judge(desc, c, head, out)
        except Exception as e:  # noqa: BLE001
            r = mt.untyped(e, "oracle")
            r["cls"] = "harness-error"
            return r

    def _honest_output(self, ch: dict, head: str, rank) -> bytes:
        """The honest chain's compaction (its seeds, the same head): what an unchanged mutant writes."""
        k = (ch["group"], head, rank)
        if k not in self.honest:
            from hsnap_format.chain import compact_path

            h = os.path.join(self.scratch, "h")
            desc = {"chain": dict(ch, scenario="none"), "resign": False, "target": "", "ops": []}
            files = (paged_files if ch.get("paged") else mm.chain_files)(desc, self.seeds.inputs, self.seeds.groups)
            if not any(n == head or n.startswith(head + "/") for n in files):  # a stray checkpoint: no honest one
                return b""
            self._write(files, os.path.join(h, "c"))
            out = os.path.join(h, "out")
            compact_path(os.path.join(h, "c", head), out, fsync=False)
            self.honest[k] = mt.read_file(out if rank is None else os.path.join(out, f"rank-{rank}.hsnap"))
            shutil.rmtree(h)
        return self.honest[k]

    def _judge(self, desc: dict, c: str, head: str, out: str) -> dict:
        from hsnap_io import restore_request

        ch = desc["chain"]
        tp = bool(ch.get("tp"))
        same = True
        for rank in ([0, 1] if tp else [None]):
            data = mt.read_file(out if rank is None else os.path.join(out, f"rank-{rank}.hsnap"))
            header, raw = _plain_sections(data)
            if "base" in header or "pages" in header:
                return mt.fail("accepted-wrong-bytes", "oracle", f"the output of rank {rank} is not plain: {sorted(header)}")
            tgt = self.chain.mig._pools(ch["kind"])
            if not tgt.reset():
                return mt.harness("reset", f"pools {tgt.label} did not come back to their baseline")
            ident = mm.link_identity(tp_size=2, tp_rank=rank) if tp else None
            try:
                res = restore_request(os.path.join(c, head), req_to_token_pool=tgt.rtp, token_to_kv_pool_allocator=tgt.alloc,
                                      identity=ident, rank=rank, verify=True)
            except HsnapError as e:
                return mt.fail("compact-laundered", "oracle",
                               f"compacted rank {rank} of a chain the restore refuses: {type(e).__name__} {e.field}: {str(e)[:160]}")
            pos = int(header["request"]["state_position"])
            if res.state_position != pos:
                return mt.fail("accepted-wrong-bytes", "oracle", f"the output at position {pos}, the restore at {res.state_position}")
            want = dict(raw, __output_ids=np.frombuffer(raw["request.output_ids"], dtype="<i4"))
            why = mm.judge_rows(tgt, int(res.req_pool_idx), pos, res.mamba_pool_idx, want, np.asarray(res.record.output_ids, dtype=np.int32))
            if not why and np.asarray(res.record.prompt_ids, dtype="<i4").tobytes() != raw["request.prompt_ids"]:
                why = "request.prompt_ids differ from the restore's"
            if why:
                return mt.fail("accepted-wrong-bytes", "oracle", f"rank {rank}: {why}")
            same = same and data == self._honest_output(ch, ch["head"] if not ch["ck"] else head, rank)
        return {"cls": "accepted-unchanged" if same else "accepted-valid", "stage": "oracle"}

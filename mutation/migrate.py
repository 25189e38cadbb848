"""The mutation run's migration and chain targets: ``python -m mutation
--target migrate|chain`` (registered in mutation/targets.py, whose pools, classes and
helpers they share).

Seeds (:func:`build_seeds`): for two pool kinds (a GDN/Mamba hybrid at page 1, MHA at page
16: SGLang's ``alloc`` and ``alloc_extend`` paths), a real live migration written by
:class:`hsnap_io.migrate.MigrationSource` over SGLang's pools while the request decodes
(``link-0000`` plain at 24 positions, ``link-0001``/``link-0002`` deltas at 31/38, the
``final.hsnap`` delta at 45), and beside it honest links that must not continue it: the same
request migrated again (other snapshot ids), another rid, another model, the other pool
kind (another geometry), a final link whose output ids do not extend the applied link's
(re-signed: it verifies on its own); a migration across TP sizes (a TP-1 source with
``sharding=`` writes set links of a Qwen3.5-like model from hsnap_testing/tp_pools.py, each
followed by rank 0 or 1 of a TP-2 target; beside it the plain set at each link's position);
and, for the chain target, the request checkpointed
by :class:`hsnap_format.checkpoints.Checkpoints` (``c.ck000001`` ... ``c.ck000004``, a plain
link every two: two chains in one directory).

``migrate``: mutant ``i`` picks a kind, a number ``k`` of links a
:class:`~hsnap_io.migrate.MigrationTarget` applies correctly (into target pools whose free
rows hold a sentinel, other requests in use), and what comes as link ``k``: its bytes
mutated (header, record, sections, digests: raw and re-signed), another honest link (twice,
skipped, the plain link again, the final early, another migration / rid / model /
geometry, the diverging final; re-signed: the same re-based onto the applied link so it
passes the base check and meets the link rules), a truncated or missing file, the source's
``abandoned.json`` (honest, garbage, huge, a directory), the correct link refused by the
caller's ``accept``, or the correct link whose ``.applied`` marker cannot be put. It is fed through ``apply``, ``step`` or ``follow`` (their ``.applied`` marker).
``chain``: a head of a chain (the migration's final link or an earlier one, or the newest
checkpoint by :func:`~hsnap_format.checkpoints.newest_links`) restored by
``restore_request`` (digests checked before allocating, or ``verify="during"`` with
``exact_rollback``) into the same kind of pools, with a link anywhere below it mutated (its
re-signed variant re-bases every link above it on the mutated one, so the chain rules are
reached), removed, or stray links added to the checkpoint directory.

The oracle (its own parse of each file's header and section bytes, never the library's
planner):

  typed                 refused with an HsnapError (or the caller's own exception out of    ok
                        ``accept``); pools and free lists byte-identical to before the call;
                        migrate: the migration then takes the correct links and ends
                        byte-equal to the source's request, and ``release`` gives back
                        every slot
  accepted-unchanged    accepted; the request's rows and record are what the honest link    ok
                        (chain) says, byte for byte (across TP sizes, a differential oracle:
                        what the plain set at that position restored re-sharded holds —
                        a path the reshard target's independent coverage oracle checks)
  accepted-valid        accepted a re-signed or substituted file that is a valid link of    ok
                        its own (the rows and record are what *it* says, its delta extends
                        the applied link, continuous positions)
  accepted-but-changed  accepted, and some row, record or position differs from what the   FAILURE
                        accepted file (chain) says, or the raw mutant's bytes differ from
                        the honest link's, or a delta whose output ids do not extend the
                        applied link's, or ``accept`` was never asked
  not-resumable         refused typed, but the migration could not take the correct links  FAILURE
                        afterwards (or its position / applied list moved)
  leaked-slots, pool-changed, untyped, hang, harness-error: as mutation/targets.py says
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from types import SimpleNamespace

import numpy as np

from hsnap_format.errors import HsnapError
from mutation import targets as mt

KINDS = {"hl": ("hybrid_linear", 1), "p16": ("mha", 16)}
OTHER_KIND = {"hl": "p16", "p16": "hl"}
POSITIONS = (24, 31, 38, 45)  # link-0000 (plain), link-0001, link-0002, final
LINKS = ("link-0000.hsnap", "link-0001.hsnap", "link-0002.hsnap", "final.hsnap")
CK_NAMES = tuple(f"c.ck{n:06d}.hsnap" for n in range(1, 5))  # checkpoints, a plain link every two
FOREIGN = ("again", "rid", "model")  # honest migrations that are not this one
ATT_KINDS = ("attn_k", "attn_v", "mla_kv", "swa_k", "swa_v")
TARGET_SIZE = 1024


def link_identity(**over):
    import io_cases as ic

    return ic.identity(**over)


# ============================================================================ seeds


def _migrate_into(directory: str, kind: str, page: int, *, rid: str = "req-1", model: str | None = None) -> None:
    """A live migration of one request, written by MigrationSource while it decodes."""
    import chain_cases as cc

    from hsnap_io.migrate import MigrationSource

    ps, req = cc.source(kind, page)
    ident = link_identity(model_id=model) if model else link_identity()
    src = MigrationSource(directory, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                          identity=ident, fsync=False)
    for i, pos in enumerate(POSITIONS):
        if i:
            cc.step(ps, req, i, 0, 0)
        (src.stop if i == len(POSITIONS) - 1 else src.precopy)(req.req_pool_idx, cc.record(pos, rid=rid))


def _checkpoint_into(directory: str, kind: str, page: int) -> None:
    """The same request checkpointed every few tokens (Checkpoints, rebase every 2 links)."""
    import chain_cases as cc

    from hsnap_format.checkpoints import Checkpoints

    ps, req = cc.source(kind, page)
    cp = Checkpoints.start(directory, "c", every=1, rebase_every=2)
    for i, pos in enumerate(POSITIONS):
        if i:
            cc.step(ps, req, i, 0, 0)
        cp.write(lambda path, base, pos=pos, i=i: cc.export(ps, req, path, pos, base=base, snapshot_id=f"ck-{i}", fsync=False), pos)


TP_LINKS = ("link-0", "link-1", "link-2", "link-3")  # a TP-2 chain: one set directory per link
TP_MEMBERS = ("manifest.json", "rank-0.hsnap", "rank-1.hsnap")


def _tp_chain_into(directory: str, kind: str, page: int) -> None:
    """A TP-2 chain of set directories (each rank its own pools and shard, the deltas' base a
    set directory beside them), written by export_request into SetWriter's rank paths."""
    import chain_cases as cc
    import hsnap_format as hf

    from hsnap_io import export_request

    os.makedirs(directory, exist_ok=True)
    srcs = [cc.source(kind, page, seed=10 + r) for r in range(2)]
    paths: list[str] = []
    for i, pos in enumerate(POSITIONS):
        if i:
            for r, (ps, req) in enumerate(srcs):
                cc.step(ps, req, i + 10 * r, 0, 0)
        path = os.path.join(directory, TP_LINKS[i])
        sw = hf.SetWriter(path)
        try:
            for r, (ps, req) in enumerate(srcs):
                export_request(sw.rank_path(r), req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                               req_pool_idx=req.req_pool_idx, record=cc.record(pos),
                               identity=link_identity(tp_size=2, tp_rank=r, snapshot_id=f"tp-{i}", created_at=cc.CREATED_AT),
                               base=paths[-1] if paths else None, fsync=False)
            sw.commit(tp_size=2, fsync=False)
        except BaseException:
            sw.abort()
            raise
        paths.append(path)


TP_MODEL = "qwen35"  # hsnap_testing/tp_pools.py: a Qwen3.5-like GDN hybrid, sharded by reshard.describe
TP_POSITIONS = (2, 3, 4, 5)  # its request holds tp_pools.N_TOKENS = 5 positions
SET_MEMBERS = ("manifest.json", "rank-0.hsnap")


def _tp_record(pos: int):
    import hsnap_format as hf

    return hf.RequestRecord(rid="r-tp", prompt_ids=np.arange(2, dtype=np.int32), output_ids=np.arange(7, 6 + pos, dtype=np.int32),
                            state_position=pos, max_new_tokens=16)


def _tp_migration_into(out: str, key: str) -> None:
    """A migration across TP sizes: a TP-1 source (``sharding=``) writes every link as a TP set;
    beside it, a plain TP-1 set at each link's position (what a target at TP 2 must end with:
    the differential oracle restores it re-sharded)."""
    import hsnap_format as hf
    from hsnap_testing import tp_pools as rp

    from hsnap_io import export_request, reshard
    from hsnap_io.migrate import MigrationSource

    m = rp.MODELS[TP_MODEL]
    ps = rp.build(m, 1, 0, seed=20)
    row, _, _ = rp.place(ps, rp.global_state(m))
    desc = reshard.describe(m.tp, 1, 0)
    src = MigrationSource(os.path.join(out, key), req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc, identity=rp.identity(1, 0),
                          sharding=desc, fsync=False)
    for i, pos in enumerate(TP_POSITIONS):
        (src.stop if i == len(TP_POSITIONS) - 1 else src.precopy)(row, _tp_record(pos))
        sw = hf.SetWriter(os.path.join(out, f"{key}-direct", f"d{i}"))
        export_request(sw.rank_path(0), req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc, req_pool_idx=row, record=_tp_record(pos),
                       identity=rp.identity(1, 0), sharding=desc, fsync=False)
        sw.commit(tp_size=1, fsync=False)


def _diverging_final(data: bytes) -> bytes:
    """``final.hsnap`` with one output id (below the base's count) changed, re-signed: a file
    that verifies on its own but does not continue the link below it."""
    header, secs = mt.parse_rank(data)
    e = secs["request.output_ids"]
    b = bytearray(data)
    at = e["offset"] + 4 * 5  # output 5: inside every base's outputs
    b[at : at + 4] = struct.pack("<i", struct.unpack_from("<i", data, at)[0] + 1)
    import craft

    return craft.resign(bytes(b))


def build_seeds(out: str, small: bool = False) -> None:
    """Both targets' seeds (one builder; ``small``: the hybrid kind only)."""
    meta = {"kinds": {}, "positions": list(POSITIONS), "sets": {}}
    for key, (kind, page) in KINDS.items():
        if small and key != "hl":
            continue
        meta["kinds"][key] = {"kind": kind, "page": page}
        _migrate_into(os.path.join(out, key), kind, page)
        _migrate_into(os.path.join(out, f"{key}-again"), kind, page)
        _migrate_into(os.path.join(out, f"{key}-rid"), kind, page, rid="req-2")
        _migrate_into(os.path.join(out, f"{key}-model"), kind, page, model="tiny/other")
        os.makedirs(os.path.join(out, f"{key}-fork"))
        mt.write_file(os.path.join(out, f"{key}-fork", "final.hsnap"), _diverging_final(mt.read_file(os.path.join(out, key, "final.hsnap"))))
        _checkpoint_into(os.path.join(out, f"{key}-ck"), kind, page)
        if key == "hl":
            _tp_chain_into(os.path.join(out, f"{key}-tp2"), kind, page)
            meta["tp"] = {f"{key}-tp2": key}
    os.makedirs(os.path.join(out, "tp12-direct"))
    _tp_migration_into(out, "tp12")
    meta["tpmig"] = {"tp12": {"model": TP_MODEL, "target_tp": 2}}
    for name in sorted(os.listdir(out)):
        if os.path.isdir(os.path.join(out, name)) and name not in meta.get("tp", {}) and not name.startswith("tp12"):
            meta["sets"][name] = sorted(n for n in os.listdir(os.path.join(out, name)) if n.endswith(".hsnap"))
    with open(os.path.join(out, "seeds.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)


def load_inputs(d: str, meta: dict) -> tuple[dict, dict]:
    inputs, groups = {}, {}
    for g, members in sorted(meta["sets"].items()):
        groups[g] = list(members)
        for m in members:
            inputs[f"{g}/{m}"] = mt.read_file(os.path.join(d, g, m))
    for t in sorted(meta.get("tpmig", {})):
        for link in LINKS + tuple(f"{t}-direct/d{i}" for i in range(len(TP_POSITIONS))):
            g = f"{t}/{link}" if not link.startswith(t) else link
            groups[g] = list(SET_MEMBERS)
            for mem in SET_MEMBERS:
                inputs[f"{g}/{mem}"] = mt.read_file(os.path.join(d, g, mem))
    for t in sorted(meta.get("tp", {})):
        for link in TP_LINKS:
            groups[f"{t}/{link}"] = list(TP_MEMBERS)
            for m in TP_MEMBERS:
                inputs[f"{t}/{link}/{m}"] = mt.read_file(os.path.join(d, t, link, m))
    return inputs, groups


# ============================================================================ reading files (the oracle's own)


def root_digest(data: bytes) -> str | None:
    """The root digest a file's trailer holds (where its preamble says the file ends)."""
    if len(data) < 128:
        return None
    flen = struct.unpack_from("<Q", data, 40)[0]
    t = flen - 64 if 64 <= flen <= len(data) else len(data) - 64
    return data[t + 24 : t + 40].hex()


class Link:
    """One rank file as this oracle reads it: header, sections' bytes, root digest."""

    def __init__(self, data: bytes, name: str) -> None:
        self.name, self.data = name, data
        self.header, self.secs = mt.parse_rank(data)
        self.req = self.header["request"]
        self.base = self.header.get("base")
        self.position = int(self.req["state_position"])
        self.base_position = int(self.base["state_position"]) if self.base else 0
        self.root = root_digest(data)

    def ids(self, what: str) -> np.ndarray:
        return np.frombuffer(self.secs[f"request.{what}"]["raw"], dtype="<i4")

    def att_rows(self, name: str) -> list[bytes]:
        e = self.secs[name]
        rows = int(e["shape"][0])
        raw = e["raw"]
        step = len(raw) // rows if rows else 0
        return [raw[r * step : (r + 1) * step] for r in range(rows)]


def expected(links: list[Link]) -> tuple[dict, str | None]:
    """What a request continued through ``links`` (bottom first) holds: {section name: bytes}
    (attention rows in position order, state and record from the top), or why the links are
    not one chain (positions not continuous, another base, output ids not extended...)."""
    top = links[-1]
    for below, above in zip(links, links[1:]):
        b = above.base
        if not b:
            return {}, f"{above.name}: a plain snapshot above {below.name}"
        if b.get("root_digest") != below.root or b.get("state_position") != below.position:
            return {}, f"{above.name}: its base is not {below.name} (digest/position)"
        if above.base_position != below.position or above.position < below.position:
            return {}, f"{above.name}: positions {above.base_position}..{above.position} after {below.position}"
        if above.req.get("rid") != below.req.get("rid") or above.secs["request.prompt_ids"]["raw"] != below.secs["request.prompt_ids"]["raw"]:
            return {}, f"{above.name}: another request than {below.name}"
        bo, ao = below.ids("output_ids"), above.ids("output_ids")
        if len(ao) < len(bo) or not np.array_equal(ao[: len(bo)], bo):
            return {}, f"{above.name}: output ids do not extend {below.name}'s"
        for k in ("model_id", "weights_version", "tp_size", "tp_rank"):
            if above.header["identity"].get(k) != below.header["identity"].get(k):
                return {}, f"{above.name}: identity.{k} differs from {below.name}'s"
    if links[0].base:
        return {}, f"{links[0].name}: a delta at the bottom"
    out = {}
    for name, e in top.secs.items():
        if e["kind"] in ATT_KINDS:
            rows = []
            for link in links:
                if name not in link.secs:
                    return {}, f"{link.name}: no section {name}"
                got = link.att_rows(name)
                if len(got) != link.position - link.base_position:
                    return {}, f"{link.name}: {name} holds {len(got)} rows for positions {link.base_position}..{link.position}"
                rows += got
            out[name] = b"".join(rows)
        else:
            out[name] = e["raw"]
    out["__rid"] = top.req.get("rid")  # another request with the same bytes is accepted-valid, not unchanged
    return out, None


def pool_bytes(tgt: "mt.TargetPools", row: int, pos: int, mamba_idx) -> dict:
    """The request's bytes in the pools, by the pool's own tables: {binding name: bytes}."""
    import torch

    tok = tgt.rtp.req_to_token[row, :pos].to(torch.int64)
    out = {}
    for b in tgt.bindings:
        if b.space == "mamba":
            out[b.name] = mt.as_bytes(b.buffer[int(mamba_idx)]) if mamba_idx is not None else b""
        else:
            out[b.name] = mt.as_bytes(b.buffer[tok])
    return out


def judge_rows(tgt, row: int, pos: int, mamba_idx, want: dict, record_ids: np.ndarray | None) -> str | None:
    """None when the pools hold ``want`` for the request (every binding) and nothing outside its
    slots changed since the baseline; else why not."""
    import torch

    have = pool_bytes(tgt, row, pos, mamba_idx)
    for name, got in have.items():
        w = want.get(name)
        if w is None:
            return f"{name}: in the pools, not in the file"
        if got != w:
            n = min(len(got), len(w))
            diff = [k for k in range(n) if got[k] != w[k]]
            sentinel = all(got[k] == mt.SENTINEL for k in diff)
            return f"{name}: {len(diff) + abs(len(got) - len(w))} bytes differ from the file's" + (" (the sentinel: never written)" if sentinel and diff else "")
    if record_ids is not None and not np.array_equal(record_ids, want["__output_ids"]):
        return "request.record.output_ids differ from the file's"
    tok = tgt.rtp.req_to_token[row, :pos].to(torch.int64)
    spaces = {"token": tok, "mamba": None if mamba_idx is None else torch.tensor([int(mamba_idx)])}
    for b in tgt.bindings:
        mask = torch.ones(b.buffer.shape[0], dtype=torch.bool)
        r = spaces.get(b.space)
        if r is not None and len(r):
            mask[r] = False
        if mt.as_bytes(tgt.buffers0[b.name][mask]) != mt.as_bytes(b.buffer[mask]):
            return f"{b.name}: rows outside the request's slots changed"
    return None


def accounting(tgt, pos: int, page: int, has_mamba: bool) -> str | None:
    free0, free1 = tgt.baseline_free, mt.free_counts(tgt.rtp, tgt.alloc)
    want = {"rows": 1, "token slots": -(-pos // page) * page, "mamba slots": 1 if has_mamba else 0}
    off = {k: (free0[k] - free1[k], want.get(k, 0)) for k in free0 if free0[k] - free1[k] != want.get(k, 0)}
    if off:
        return "free counts: " + ", ".join(f"{k} fell by {a}, one request takes {b}" for k, (a, b) in off.items())
    return None


# ============================================================================ generation

_HEADER_PATHS = [
    ("base", "root_digest"), ("base", "snapshot_id"), ("base", "state_position"), ("base", "depth"), ("base", "name"),
    ("request", "state_position"), ("request", "rid"), ("request", "prompt_tokens"), ("request", "output_tokens"),
    ("request", "swa_start"), ("request", "streamed", "tokens"), ("request", "remaining_budget"), ("request", "sampling", "temperature"),
    ("identity", "model_id"), ("identity", "weights_version"), ("identity", "tp_size"), ("identity", "tp_rank"),
    ("identity", "snapshot_id"), ("identity", "engine", "version"),
    ("geometry", "attention", "page_size"), ("geometry", "attention", "heads"), ("geometry", "attention", "k_head_dim"),
    ("geometry", "attention", "dtype"), ("geometry", "attention", "layers"), ("geometry", "mamba", "layers"),
    ("features", "required"), ("features", "optional"), ("format", "minor"),
]
_SECTION_FIELDS = ("offset", "length", "shape", "dtype", "digest", "name", "kind")


ONE = "x.hsnap"  # the name a mutated link has while its ops are drawn and applied (mutated())


def mutated(desc: dict, inputs: dict) -> bytes:
    """The bytes of ``desc["target"]`` after its ops (raw, or re-signed)."""
    return mt.build(dict(desc, target=ONE), {ONE: inputs[desc["target"]]}, {})[ONE]


def draw_bytes(rng, seed: int, i: int, family: str, inputs: dict, member: str) -> dict:
    """A byte/JSON mutant of link ``member`` (focused operators, or the format run's)."""
    data = inputs[member]
    desc = mt.generate_with(rng, seed, i, family, {ONE: data}, {}, _focused(rng, ONE, data, member.split("/")[-1]))
    desc["target"] = member
    return desc


def _focused(rng, member: str, data: bytes, own: str) -> dict:
    """Operators aimed at one link: its chain fields, record, identity, geometry, table, bytes."""
    h = mt.header_of(data)

    def header(rng):
        path = mt.pick(rng, _HEADER_PATHS)
        cur = mt.get_path(h, path)
        if cur is None and mt.get_path(h, path[:-1]) is None:
            return None
        if path == ("base", "name"):
            v = mt.pick(rng, [*LINKS, *CK_NAMES, own, "", "../x.hsnap", "a/b.hsnap", ".", "link-0000.hsnap/"])
        elif path == ("base", "root_digest"):
            v = mt.pick(rng, ["0" * 32, "f" * 32, (cur or "")[:-1] + "0", "", None, (cur or "").upper()])
        elif path == ("base", "depth"):
            v = mt.pick(rng, [0, 2, 3, 64, 65, 10**6, -1, 2**53, None])
        elif path == ("request", "state_position"):
            v = mt.pick(rng, [cur + 1, cur - 1, 0, POSITIONS[0], h.get("base", {}).get("state_position", 0), 10**9]) if isinstance(cur, int) else 0
        else:
            v = mt.nearby(rng, cur)
        return member, mt.json_set(path, v)

    def base_whole(rng):  # the base object removed, emptied, another type, or an extra key
        act = rng.randrange(4)
        if act == 0:
            return member, [{"op": "j.del", "path": ["base"]}] if "base" in h else None
        if act == 1:
            return member, mt.json_set(("base",), mt.pick(rng, [{}, None, [], "link-0000.hsnap", 1]))
        if act == 2 and "base" in h:
            return member, [{"op": "j.add", "path": ["base"], "key": "extra", "value": 1}]
        if "base" not in h:  # a plain link made a delta of something
            return member, mt.json_set(("base",), {"name": "link-0000.hsnap", "root_digest": "0" * 32, "snapshot_id": "x", "state_position": 0, "depth": 1})
        return None

    def table(rng):
        k = rng.randrange(len(h["sections"]))
        f = mt.pick(rng, _SECTION_FIELDS)
        cur = h["sections"][k].get(f)
        if f == "shape":
            v = mt.pick(rng, [[cur[0] + 1] + cur[1:], [max(cur[0] - 1, 0)] + cur[1:], [0] + cur[1:], cur[:-1], cur + [1], [10**12] + cur[1:]])
        else:
            v = mt.nearby(rng, cur)
        return member, mt.json_set(("sections", k, f), v)

    def state_bytes(rng):
        ops = mt.section_byte_ops(rng, data, names=("conv", "temporal", "attn_k", "attn_v"))
        return (member, ops) if ops else None

    def record_bytes(rng):
        ops = mt.section_byte_ops(rng, data, names=("request.output_ids", "request.prompt_ids", "request.output_logprobs"),
                                   values=[0, 1, -1, 99, 100, 2**31 - 1, 2**31], width=4)
        return (member, ops) if ops else None

    def truncate(rng):
        return member, [{"op": "b.trunc", "len": mt.pick(rng, [0, 1, 63, 64, 4095, 4096, len(data) // 2, len(data) - 64, len(data) - 1])}]

    return {"header": (6, header), "base": (2, base_whole), "table": (3, table), "state": (3, state_bytes),
            "record": (2, record_bytes), "truncate": (1, truncate)}


def rebase_ops(below: bytes, below_name: str) -> list:
    """JSON ops that make a file name ``below`` (by name, digest, id, position, depth) as its base."""
    h = mt.header_of(below)
    depth = (h["base"]["depth"] if isinstance(h.get("base"), dict) and isinstance(h["base"].get("depth"), int) else 0) + 1
    return mt.json_set(("base",), {"name": below_name, "root_digest": root_digest(below), "snapshot_id": h["identity"]["snapshot_id"],
                                    "state_position": h["request"]["state_position"], "depth": depth})


class LinkGen:
    def __init__(self, inputs, groups, meta) -> None:
        self.inputs, self.groups, self.meta = inputs, groups, meta
        self.kinds = sorted(meta["kinds"])


class MigrateGen(LinkGen):

    def generate(self, seed: int, i: int) -> dict:
        rng = random.Random(f"hsnap-mutate-migrate:{seed}:{i // 2}")
        if self.meta.get("tpmig") and rng.random() < 0.25:
            return self._generate_tp(rng, seed, i)
        key = mt.pick(rng, self.kinds)
        k = rng.randrange(len(LINKS))
        mode = mt.pick(rng, ["apply", "apply", "step", "follow"])
        scenario = rng.choices(["bytes", "swap", "missing", "abandon", "accept", "marker"], [60, 22, 4, 7, 7, 3])[0]
        resign = bool(i % 2)
        mig = {"kind": key, "k": k, "mode": mode, "scenario": scenario}
        base = {"i": i, "seed": seed, "family": "migrate", "resign": resign}
        if scenario == "bytes":
            desc = draw_bytes(rng, seed, i, "migrate", self.inputs, f"{key}/{LINKS[k]}")
            desc.update(mig=mig)
            return desc
        if scenario == "swap":
            choices = [f"{key}/{n}" for j, n in enumerate(LINKS) if j != k]
            choices += [f"{key}-{f}/{LINKS[k]}" for f in FOREIGN]
            choices += [f"{key}-fork/final.hsnap"]
            other = OTHER_KIND[key]
            if other in self.meta["kinds"]:
                choices.append(f"{other}/{LINKS[k]}")
            src = mt.pick(rng, choices)
            ops = []
            if resign and k > 0:  # re-based onto the applied link: past the base check, into the link rules
                ops = rebase_ops(self.inputs[f"{key}/{LINKS[k - 1]}"], LINKS[k - 1])
            return dict(base, target=src, operator=f"swap-{src.split('/')[0].replace(key, 'own', 1)}", operators=["swap"], ops=ops, mig=mig)
        if scenario == "abandon":
            mig.update(mode=mt.pick(rng, ["step", "follow"]), present=rng.random() < 0.3,
                       marker=mt.pick(rng, ["honest", "garbage", "huge", "empty", "dir", "utf8", "deep"]))
        elif scenario == "accept":
            mig["raise"] = mt.pick(rng, ["hsnap", "value", "runtime", "none-once"])
        elif scenario == "marker":  # the round's .applied marker cannot be put (a directory holds its name)
            mig.update(mode=mt.pick(rng, ["step", "follow"]), k=rng.randrange(len(LINKS) - 1))
        return dict(base, target=f"{key}/{LINKS[k]}", operator=scenario, operators=[scenario], ops=[], mig=mig)


    def _generate_tp(self, rng, seed: int, i: int) -> dict:
        """A migration across TP sizes (TP-1 source, set links) followed by rank ``rank`` of a TP-2
        target: link k's rank file or manifest mutated (re-signed: the manifest re-bound), another
        of its links, missing, abandoned, refused by accept, or its marker blocked."""
        key = mt.pick(rng, sorted(self.meta["tpmig"]))
        k = rng.randrange(len(LINKS))
        mig = {"kind": key, "rank": rng.randrange(2), "k": k, "mode": mt.pick(rng, ["apply", "apply", "step", "follow"]),
               "scenario": rng.choices(["bytes", "swap", "missing", "abandon", "accept", "marker"], [65, 15, 4, 6, 6, 4])[0]}
        base = {"i": i, "seed": seed, "family": "migrate", "resign": bool(i % 2)}
        group = f"{key}/{LINKS[k]}"
        sc = mig["scenario"]
        if sc == "bytes":
            member = f"{group}/rank-0.hsnap"
            link_inputs = {f"{group}/{mem}": self.inputs[f"{group}/{mem}"] for mem in SET_MEMBERS}
            focused = {n: v for n, v in _focused(rng, member, self.inputs[member], LINKS[k]).items() if n != "state"}
            desc = mt.generate_with(rng, seed, i, "migrate", link_inputs, {group: list(SET_MEMBERS)}, focused)
            desc["mig"] = mig
            return desc
        if sc == "swap":
            src = mt.pick(rng, [f"{key}/{n}" for j, n in enumerate(LINKS) if j != k])
            return dict(base, target=src, operator="swap-tp", operators=["swap"], ops=[], mig=mig)
        if sc == "abandon":
            mig.update(mode=mt.pick(rng, ["step", "follow"]), present=rng.random() < 0.3, marker=mt.pick(rng, ["honest", "garbage", "dir"]))
        elif sc == "accept":
            mig["raise"] = mt.pick(rng, ["hsnap", "value", "runtime", "none-once"])
        elif sc == "marker":
            mig.update(mode=mt.pick(rng, ["step", "follow"]), k=rng.randrange(len(LINKS) - 1))
        return dict(base, target=f"{key}/{LINKS[mig['k']]}", operator=sc, operators=[sc], ops=[], mig=mig)


# ============================================================================ the migrate examiner


class Refusal(Exception):
    """What the caller's accept raises (not an HsnapError)."""


def _marker_bytes(kind: str) -> bytes | None:
    return {"honest": json.dumps({"reason": "the request finished", "links": 2}).encode(), "garbage": bytes(range(256)) * 3,
            "huge": b"x" * (3 << 20), "empty": b"", "utf8": b'{"reason": "\xff\xfe\xc3"}', "deep": b"[" * 200000}.get(kind)


class MigrateExaminer:
    """Target pools per kind (sentinel in every free row, three other requests in use); each
    mutant gets a fresh MigrationTarget that applies ``k`` correct links, then meets the
    hostile one; judged by :mod:`this oracle <mutation.migrate>`."""

    def __init__(self, seeds, scratch: str) -> None:
        self.seeds, self.scratch = seeds, scratch
        self.pools: dict[str, "mt.TargetPools"] = {}
        self.links = {key: [Link(seeds.inputs[f"{key}/{n}"], n) for n in LINKS] for key in seeds.meta["kinds"]}
        self.link_files = {key: [{n: seeds.inputs[f"{key}/{n}"]} for n in LINKS] for key in seeds.meta["kinds"]}
        for key in seeds.meta.get("tpmig", {}):  # set links: rank-0's file read as this oracle reads any link
            self.links[key] = [Link(seeds.inputs[f"{key}/{n}/rank-0.hsnap"], n) for n in LINKS]
            self.link_files[key] = [{f"{n}/{mem}": seeds.inputs[f"{key}/{n}/{mem}"] for mem in SET_MEMBERS} for n in LINKS]
        self.honest = {key: [expected(self.links[key][: j + 1])[0] for j in range(len(LINKS))] for key in seeds.meta["kinds"]}
        self.ref_pools: dict[str, "mt.TargetPools"] = {}
        for key, exp in self.honest.items():
            for j, e in enumerate(exp):
                e["__output_ids"] = self.links[key][j].ids("output_ids")
        self.target_cls = None  # the class under test (default MigrationTarget); tests plant faults here

    def _pools(self, key: str) -> "mt.TargetPools":
        if key not in self.pools and key not in KINDS:  # "<tp kind>-r<rank>": rank of the TP-2 target
            self.pools[key] = self._tp_pools(int(key.rsplit("-r", 1)[1]), 90)
        if key not in self.pools:
            from hsnap_testing import pools as sp

            kind, page = KINDS[key]
            ps = sp.build(kind, size=TARGET_SIZE, page_size=page, seed=None)
            mt.fill_sentinel(mt.bindings_of(ps))
            sp.occupy(ps, 3, 50, seed=7)
            self.pools[key] = mt.TargetPools(ps.req_to_token_pool, ps.token_to_kv_pool_allocator, label=f"{kind} page {page}", extra=ps)
        return self.pools[key]

    @staticmethod
    def _tp_pools(rank: int, seed: int) -> "mt.TargetPools":
        from hsnap_testing import tp_pools as rp

        ps = rp.build(rp.MODELS[TP_MODEL], 2, rank, seed=seed + rank)
        mt.fill_sentinel(mt.bindings_of(SimpleNamespace(req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc)))
        rp.place(ps, rp.global_state(rp.MODELS[TP_MODEL], seed=5))  # another request in use
        return mt.TargetPools(ps.rtp, ps.alloc, label=f"{TP_MODEL} tp2 rank{rank}")

    def _tp_reference(self, key: str, rank: int) -> None:
        """Differential oracle of a migration across TP sizes: the plain TP-1 set at each link's
        position restored re-sharded (restore_request(sharding=), whose bytes the reshard target's
        independent coverage oracle checks) into pools of the same rank: what the request holds."""
        from hsnap_testing import tp_pools as rp

        from hsnap_io import reshard, restore_request

        pk = f"{key}-r{rank}"
        if pk in self.honest:
            return
        out = []
        for j in range(len(LINKS)):
            ref = self._tp_pools(rank, 50)
            res = restore_request(os.path.join(self.seeds.dir, f"{key}-direct", f"d{j}"), req_to_token_pool=ref.rtp, token_to_kv_pool_allocator=ref.alloc,
                                  identity=rp.identity(2, rank), sharding=reshard.describe(rp.MODELS[TP_MODEL].tp, 2, rank))
            want = pool_bytes(ref, int(res.req_pool_idx), res.state_position, res.mamba_pool_idx)
            want.update(__output_ids=self.links[key][j].ids("output_ids"), __rid=self.links[key][j].req.get("rid"), __position=res.state_position)
            out.append(want)
        self.honest[pk] = out

    def warm(self) -> None:
        import torch

        import hsnap_io.migrate  # noqa: F401

        # one thread: the pools are tiny, and two workers on a loaded machine with torch's
        # default threads each ran 15x slower (the caller puts it back if it must)
        torch.set_num_threads(1)
        for key in self.seeds.meta["kinds"]:
            self._pools(key)
        for key in self.seeds.meta.get("tpmig", {}):
            for rank in range(2):
                self._pools(f"{key}-r{rank}")
                self._tp_reference(key, rank)

    def _target(self, tgt, m: dict):
        from hsnap_io.migrate import MigrationTarget

        cls = self.target_cls or MigrationTarget
        if "rank" in m:
            from hsnap_testing import tp_pools as rp

            from hsnap_io import reshard

            return cls(req_to_token_pool=tgt.rtp, token_to_kv_pool_allocator=tgt.alloc, identity=rp.identity(2, m["rank"]),
                       sharding=reshard.describe(rp.MODELS[TP_MODEL].tp, 2, m["rank"]))
        return cls(req_to_token_pool=tgt.rtp, token_to_kv_pool_allocator=tgt.alloc, identity=link_identity())

    @staticmethod
    def _put(c: str, files: dict) -> None:
        """A link's files into container ``c`` (a rank file, or a set directory's members), replacing what is there."""
        for name in {n.split("/")[0] for n in files}:
            p = os.path.join(c, name)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            elif os.path.lexists(p):
                os.unlink(p)
        for name, data in files.items():
            mt.write_file(os.path.join(c, name), data)

    def _files(self, desc) -> dict | None:
        """What comes as link k: {name in the container: bytes} (None: nothing comes)."""
        m = desc["mig"]
        k, name = m["k"], LINKS[m["k"]]
        if m["scenario"] in ("missing",) or m["scenario"] == "abandon" and not m.get("present"):
            return None
        if m["scenario"] in ("abandon", "accept", "marker"):
            return self.link_files[m["kind"]][k]
        if "rank" in m:  # a set link: its members (a swap: another link's, under this link's name)
            if m["scenario"] == "swap":
                j = LINKS.index(desc["target"].split("/")[1])
                return {f"{name}/{mem}": data for mem, data in ((n.split("/", 1)[1], d) for n, d in self.link_files[m["kind"]][j].items())}
            group = f"{m['kind']}/{name}"
            return {f"{name}/{n[len(group) + 1:]}": data for n, data in mt.build(desc, self.seeds.inputs, self.seeds.groups).items()}
        if m["scenario"] == "swap" and not desc["ops"]:
            return {name: self.seeds.inputs[desc["target"]]}
        return {name: mutated(desc, self.seeds.inputs)}

    def examine(self, desc: dict) -> dict:
        m = desc["mig"]
        key, k, mode, scenario = m["kind"], m["k"], m["mode"], m["scenario"]
        pk = key if "rank" not in m else f"{key}-r{m['rank']}"
        try:
            hostile = self._files(desc)
            tgt = self._pools(pk)
            if not tgt.reset():
                return mt.harness("reset", f"pools {tgt.label} did not come back to their baseline: {tgt.changed()[:5]}")
            c = os.path.join(self.scratch, "c")
            if os.path.lexists(c):
                shutil.rmtree(c)
            os.makedirs(c)
            for j in range(k):
                self._put(c, self.link_files[key][j])
            name = LINKS[k]
            if hostile is not None:
                self._put(c, hostile)
            if scenario == "marker":
                os.makedirs(os.path.join(c, name + ".applied", "x"))
            if scenario == "abandon":
                p = os.path.join(c, "abandoned.json")
                if m["marker"] == "dir":
                    os.makedirs(p)
                else:
                    mt.write_file(p, _marker_bytes(m["marker"]))
            mig = self._target(tgt, m)
            for j in range(k):
                mig.apply(os.path.join(c, LINKS[j]))
        except Exception as e:  # noqa: BLE001
            r = mt.untyped(e, "build")
            r["cls"] = "harness-error"
            return r
        before, free_b = tgt.mark(), mt.free_counts(tgt.rtp, tgt.alloc)
        pos_b, applied_b = (mig.request.state_position if mig.request else None), len(mig.applied)
        asked = []

        def accept(snap, record):
            asked.append(1)
            how = m.get("raise")
            if how == "hsnap":
                raise HsnapError(snap.path, "accept", "a request this scheduler can run", "refused by the caller")
            if how == "value":
                raise ValueError("the caller refuses")
            if how == "runtime":
                raise Refusal("the caller refuses")

        kw = {"accept": accept} if scenario == "accept" else {}
        stage = f"{mode} link {k}"
        try:
            if mode == "apply":
                got = mig.apply(os.path.join(c, name), **kw)
            elif mode == "step":
                got = mig.step(c, **kw)
            else:  # follow's first link (a missing one: its typed timeout)
                got = next(iter(mig.follow(c, timeout_s=0.05, poll_s=0.005, **kw)))
        except HsnapError as e:
            return self._after_refusal(mt.typed(e, stage), desc, tgt, mig, before, free_b, pos_b, applied_b, c)
        except (ValueError, Refusal) as e:
            if scenario == "accept" and asked and str(e) == "the caller refuses":
                r = {"cls": "typed", "stage": stage, "error": f"caller {type(e).__name__}", "field": "accept"}
                return self._after_refusal(r, desc, tgt, mig, before, free_b, pos_b, applied_b, c)
            return self._after_refusal(mt.untyped(e, stage), desc, tgt, mig, before, free_b, pos_b, applied_b, c)
        except BaseException as e:  # noqa: BLE001
            if mt.is_control(e):
                raise
            return self._after_refusal(mt.untyped(e, stage), desc, tgt, mig, before, free_b, pos_b, applied_b, c)
        if got is None:  # step: nothing committed under the next names yet
            r = {"cls": "typed", "stage": stage, "error": "waits (step: None)", "field": name}
            return self._after_refusal(r, desc, tgt, mig, before, free_b, pos_b, applied_b, c)
        try:
            return self._judge_accepted(desc, tgt, mig, got, hostile, c, asked)
        except Exception as e:  # noqa: BLE001
            r = mt.untyped(e, "oracle")
            r["cls"] = "harness-error"
            return r

    def _after_refusal(self, r, desc, tgt, mig, before, free_b, pos_b, applied_b, c) -> dict:
        m = desc["mig"]
        key, k = m["kind"], m["k"]
        pk = key if "rank" not in m else f"{key}-r{m['rank']}"
        free1 = mt.free_counts(tgt.rtp, tgt.alloc)
        what = f"{r['error']} {r.get('field') or r.get('message', '')[:80]}"
        keep = {x: r[x] for x in ("where", "traceback", "message") if x in r}
        lower = {x: (free_b[x], free1.get(x)) for x in free_b if free1.get(x, 0) < free_b[x]}
        if lower:
            return dict(mt.fail("leaked-slots", "after refusal", f"{what}: free counts fell: " + ", ".join(f"{x} {a}->{b}" for x, (a, b) in lower.items())),
                        refusal=r["cls"], **keep)
        changed = tgt.refusal_changes(before)
        if changed:
            return dict(mt.fail("pool-changed", "after refusal", f"{what}: changed {', '.join(changed[:6])}"), refusal=r["cls"], **keep)
        if r["cls"] != "typed":
            return r
        now = mig.request.state_position if mig.request else None
        if now != pos_b or len(mig.applied) != applied_b:
            return mt.fail("not-resumable", "after refusal", f"{what}: the migration moved: position {pos_b}->{now}, applied {applied_b}->{len(mig.applied)}")
        if m["scenario"] != "marker" and os.path.exists(os.path.join(c, LINKS[k] + ".applied")):
            return mt.fail("not-resumable", "after refusal", f"{what}: {LINKS[k]}.applied put beside a refused link")
        # the correct links still apply, and the request ends as the source's
        try:
            for j in range(k, len(LINKS)):
                self._put(c, self.link_files[key][j])
                mig.apply(os.path.join(c, LINKS[j]))
        except BaseException as e:  # noqa: BLE001
            if mt.is_control(e):
                raise
            return mt.fail("not-resumable", "after refusal", f"{what}: then the correct {LINKS[j]}: {type(e).__name__}: {str(e)[:200]}")
        req = mig.request
        why = judge_rows(tgt, int(req.req_pool_idx), req.state_position, req.mamba_pool_idx, self.honest[pk][-1], req.record.output_ids)
        why = why or accounting(tgt, req.state_position, KINDS[key][1] if key in KINDS else 1, req.mamba_pool_idx is not None)
        if why:
            return mt.fail("not-resumable", "after refusal", f"{what}: the correct links applied after it, then {why}")
        return self._release(mig, tgt) or r

    @staticmethod
    def _release(mig, tgt) -> dict | None:
        mig.release()
        if mt.free_counts(tgt.rtp, tgt.alloc) != tgt.baseline_free:
            return mt.fail("leaked-slots", "release", f"after release: free {mt.free_counts(tgt.rtp, tgt.alloc)}, baseline {tgt.baseline_free}")
        return None

    def _judge_accepted(self, desc, tgt, mig, got, hostile: dict, c: str, asked: list) -> dict:
        m = desc["mig"]
        key, k, scenario = m["kind"], m["k"], m["scenario"]
        honest = self.links[key]
        if scenario == "accept" and m.get("raise") != "none-once":
            return mt.fail("accepted-but-changed", "oracle", f"accepted although the caller's accept {'was never asked' if not asked else 'refused it'}")
        if "rank" in m:
            return self._judge_accepted_tp(desc, tgt, mig, got, hostile, c)
        raw = scenario == "bytes" and not desc["resign"]
        try:
            link = Link(honest[k].data if raw else hostile[LINKS[k]], LINKS[k])
            chain = self._chain_of(link, honest[:k], c) if k == 0 else honest[:k] + [link]
            want, bad = expected(chain)
        except (KeyError, ValueError, TypeError, IndexError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            return mt.fail("accepted-but-changed", "oracle", f"accepted a link this oracle cannot read: {type(e).__name__}: {e}")
        if bad:
            return mt.fail("accepted-but-changed", "oracle", f"accepted a link that does not continue the applied ones: {bad}")
        want["__output_ids"] = chain[-1].ids("output_ids")
        req = mig.request
        if req.state_position != chain[-1].position or got.state_position != chain[-1].position:
            return mt.fail("accepted-but-changed", "oracle", f"position {req.state_position} (returned {got.state_position}), the file's {chain[-1].position}")
        why = judge_rows(tgt, int(req.req_pool_idx), req.state_position, req.mamba_pool_idx, want, req.record.output_ids)
        why = why or accounting(tgt, req.state_position, KINDS[key][1], req.mamba_pool_idx is not None)
        why = why or (None if req.record.rid == want["__rid"] else f"request.record.rid {req.record.rid!r}, the file's {want['__rid']!r}")
        if why:
            return mt.fail("accepted-but-changed", "oracle", why)
        if m["mode"] != "apply" and scenario != "marker" and not got.final and not os.path.exists(os.path.join(c, os.path.basename(got.path) + ".applied")):
            return mt.fail("accepted-but-changed", "oracle", "step applied a round without putting its .applied marker")
        same = len(want) == len(self.honest[key][k]) and all(
            np.array_equal(v, self.honest[key][k][n]) if isinstance(v, np.ndarray) else v == self.honest[key][k].get(n) for n, v in want.items())
        cls = "accepted-unchanged" if same else "accepted-valid"
        return self._release(mig, tgt) or {"cls": cls, "stage": "oracle"}

    def _judge_accepted_tp(self, desc, tgt, mig, got, hostile: dict, c: str) -> dict:
        """Across TP sizes, the differential oracle: after an accepted link k the request holds what
        the plain set at that position restored re-sharded holds, byte for byte (a re-signed link
        whose rank file's own state bytes differ from the honest one's cannot be judged by it:
        counted accepted-valid); and what its record says."""
        m = desc["mig"]
        key, k = m["kind"], m["k"]
        pk = f"{key}-r{m['rank']}"
        try:
            link = Link(hostile[f"{LINKS[k]}/rank-0.hsnap"], LINKS[k])
        except (KeyError, ValueError, TypeError, IndexError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            return mt.fail("accepted-but-changed", "oracle", f"accepted a link this oracle cannot read: {type(e).__name__}: {e}")
        j = next((x for x, h in enumerate(self.links[key]) if h.position == link.position), None)
        if j is None:
            return mt.fail("accepted-but-changed", "oracle", f"accepted a link at position {link.position}: no link of the source's is there")
        below = self.links[key][k - 1] if k else None  # the link applied last (rank 0's file of its set)
        if below is not None and (not isinstance(link.base, dict) or link.base.get("root_digest") != below.root
                                  or link.base.get("state_position") != below.position):
            return mt.fail("accepted-but-changed", "oracle", f"accepted a link whose base is not the applied {below.name}")
        want, req = self.honest[pk][j], mig.request
        if req.state_position != want["__position"] or got.state_position != want["__position"]:
            return mt.fail("accepted-but-changed", "oracle", f"position {req.state_position} (returned {got.state_position}), the link's {want['__position']}")
        raw = desc["resign"] is False and m["scenario"] == "bytes"
        honest_state = {n: e["raw"] for n, e in self.links[key][j].secs.items() if e["kind"] not in ("prompt_ids", "output_ids", "output_logprobs")}
        state = {n: e["raw"] for n, e in link.secs.items() if e["kind"] not in ("prompt_ids", "output_ids", "output_logprobs")}
        why = judge_rows(tgt, int(req.req_pool_idx), req.state_position, req.mamba_pool_idx, dict(want, __output_ids=link.ids("output_ids")),
                         req.record.output_ids)
        if why and (raw or state == honest_state):
            return mt.fail("accepted-but-changed", "oracle", why)
        why = accounting(tgt, req.state_position, 1, req.mamba_pool_idx is not None)
        if why:
            return mt.fail("accepted-but-changed", "oracle", why)
        if raw and not np.array_equal(link.ids("output_ids"), want["__output_ids"]):
            return mt.fail("accepted-but-changed", "oracle", "a raw mutant accepted with other output ids than the source's")
        same = state == honest_state and np.array_equal(link.ids("output_ids"), want["__output_ids"]) and link.req.get("rid") == want["__rid"]
        return self._release(mig, tgt) or {"cls": "accepted-unchanged" if same else "accepted-valid", "stage": "oracle"}

    def _chain_of(self, head: Link, below: list, c: str) -> list[Link]:
        """The first link accepted: a plain one, or a chain found by base names in the container."""
        chain, seen = [head], {head.name}
        while chain[0].base:
            nm = chain[0].base.get("name")
            if not isinstance(nm, str) or nm in seen or not os.path.isfile(os.path.join(c, nm)):
                break
            seen.add(nm)
            chain.insert(0, Link(mt.read_file(os.path.join(c, nm)), nm))
        return chain


# ============================================================================ chain restore


class ChainGen(LinkGen):

    def generate(self, seed: int, i: int) -> dict:
        rng = random.Random(f"hsnap-mutate-chain:{seed}:{i // 2}")
        verify = "during" if rng.random() < 0.3 else True  # read once, each section hashed as it lands (exact_rollback)
        desc = self._generate_tp(rng, seed, i) if self.meta.get("tp") and rng.random() < 0.25 else self._generate_plain(rng, seed, i)
        desc["chain"]["verify"] = verify
        return desc

    def _generate_plain(self, rng, seed: int, i: int) -> dict:
        key = mt.pick(rng, self.kinds)
        ck = rng.random() < 0.3
        group = f"{key}-ck" if ck else key
        names = list(CK_NAMES if ck else LINKS)
        head = len(names) - 1 if ck or rng.random() < 0.7 else rng.randrange(1, len(names))
        if ck:  # the newest of a plain link every two: its chain is links 2..3
            below = [2, 3]
        else:
            below = list(range(head + 1))
        scenario = rng.choices(["bytes", "missing", "stray", "swap"], [70, 8, 12 if ck else 0, 10])[0]
        ch = {"kind": key, "group": group, "head": names[head], "ck": ck, "scenario": scenario}
        base = {"i": i, "seed": seed, "family": "chain", "resign": bool(i % 2)}
        j = mt.pick(rng, below)
        if scenario == "bytes":
            desc = draw_bytes(rng, seed, i, "chain", self.inputs, f"{group}/{names[j]}")
            ch["mutated"] = j
            desc.update(chain=ch)
            return desc
        if scenario == "missing":
            ch["remove"] = names[j] if j != head else names[max(j - 1, 0)]
            return dict(base, target=f"{group}/{names[j]}", operator="missing", operators=["missing"], ops=[], chain=ch)
        if scenario == "stray":  # a higher-numbered "checkpoint" that is not one of this chain
            src = mt.pick(rng, [f"{group}/{n}" for n in CK_NAMES] + [f"{key}/{n}" for n in LINKS] + [f"{key}-fork/final.hsnap",
                                                                                                     f"{key}-rid/final.hsnap"])
            ch["stray"] = mt.pick(rng, ["c.ck000005.hsnap", "c.ck999999.hsnap", "c.ck0000010.hsnap", ".c.ck000009.hsnap"])
            ch["stray_trunc"] = mt.pick(rng, [None, None, 0, 64, 4096])
            return dict(base, target=src, operator="stray", operators=["stray"], ops=[], chain=ch)
        # swap: a link below the head replaced by an honest file of another chain (same name)
        others = [f"{key}-{f}/{names[j]}" for f in FOREIGN if not ck] + ([f"{OTHER_KIND[key]}/{names[j]}"] if not ck and OTHER_KIND[key] in self.meta["kinds"] else [])
        others += [f"{group}/{n}" for n in names if n != names[j]]
        src = mt.pick(rng, others)
        ch["mutated"], ch["swap"] = j, src
        return dict(base, target=src, operator="swap", operators=["swap"], ops=[], chain=ch)


    def _generate_tp(self, rng, seed: int, i: int) -> dict:
        """A TP-2 chain of set directories: rank ``rank`` of its head restored, a rank file or the
        manifest of a link at or below the head mutated (re-signed: the manifest re-bound, the
        same rank of every link above re-based), a link directory or rank file removed, or a rank
        file swapped for another link's or the other rank's."""
        group = mt.pick(rng, sorted(self.meta["tp"]))
        key = self.meta["tp"][group]
        head = len(TP_LINKS) - 1 if rng.random() < 0.7 else rng.randrange(1, len(TP_LINKS))
        rank = rng.randrange(2)
        j = rng.randrange(head + 1)
        scenario = rng.choices(["bytes", "missing", "swap"], [80, 8, 12])[0]
        ch = {"kind": key, "group": group, "head": TP_LINKS[head], "ck": False, "tp": True, "rank": rank, "scenario": scenario, "mutated": j}
        base = {"i": i, "seed": seed, "family": "chain", "resign": bool(i % 2)}
        link = f"{group}/{TP_LINKS[j]}"
        if scenario == "bytes":
            mr = rank if rng.random() < 0.8 else 1 - rank
            member = f"{link}/rank-{mr}.hsnap"
            link_inputs = {f"{link}/{m}": self.inputs[f"{link}/{m}"] for m in TP_MEMBERS}
            desc = mt.generate_with(rng, seed, i, "chain", link_inputs, {link: list(TP_MEMBERS)},
                                    _focused(rng, member, self.inputs[member], TP_LINKS[j]))
            desc.update(chain=ch)
            return desc
        if scenario == "missing":
            ch["remove"] = mt.pick(rng, [TP_LINKS[j], f"{TP_LINKS[j]}/rank-{rank}.hsnap", f"{TP_LINKS[j]}/manifest.json"])
            if ch["remove"] == TP_LINKS[head]:
                ch["remove"] += f"/rank-{1 - rank}.hsnap"
            return dict(base, target=f"{link}/rank-{rank}.hsnap", operator="missing", operators=["missing"], ops=[], chain=ch)
        src = mt.pick(rng, [f"{group}/{x}/rank-{rank}.hsnap" for x in TP_LINKS if x != TP_LINKS[j]] + [f"{link}/rank-{1 - rank}.hsnap"])
        ch["swap"] = src
        return dict(base, target=src, operator="swap", operators=["swap"], ops=[], chain=ch)


def tp_chain_files(desc: dict, inputs: dict, groups: dict) -> dict[str, bytes]:
    """A TP chain mutant's files (``link-i/member`` -> bytes)."""
    import craft

    ch = desc["chain"]
    group, rank, j = ch["group"], ch["rank"], ch["mutated"]
    files = {f"{x}/{m}": inputs[f"{group}/{x}/{m}"] for x in TP_LINKS for m in TP_MEMBERS}
    sc = ch["scenario"]
    moved = None  # the rank whose file of link j changed (its links above are re-based when re-signed)
    if sc == "bytes":
        for name, data in mt.build(desc, inputs, groups).items():
            files[name[len(group) + 1 :]] = data
        m = re_rank(desc["target"])
        moved = m
    elif sc == "missing":
        for name in [n for n in files if n == ch["remove"] or n.startswith(ch["remove"] + "/")]:
            del files[name]
    elif sc == "swap":
        files[f"{TP_LINKS[j]}/rank-{rank}.hsnap"] = inputs[ch["swap"]]
        if desc["resign"]:
            man = f"{TP_LINKS[j]}/manifest.json"
            files[man] = craft.manifest_for(files[man], rank, files[f"{TP_LINKS[j]}/rank-{rank}.hsnap"])
        moved = rank
    if desc["resign"] and moved is not None:
        for a in range(j + 1, TP_LINKS.index(ch["head"]) + 1):
            below, above = f"{TP_LINKS[a - 1]}/rank-{moved}.hsnap", f"{TP_LINKS[a]}/rank-{moved}.hsnap"
            try:
                if not mt.header_of(files[above]).get("base"):
                    break
                ops = rebase_ops(files[below], TP_LINKS[a - 1])
                files[above] = mt.core.build({"target": ONE, "resign": True, "ops": ops}, {ONE: files[above]}, {})[ONE]
                man = f"{TP_LINKS[a]}/manifest.json"
                files[man] = craft.manifest_for(files[man], moved, files[above])
            except Exception:  # noqa: BLE001 - a link the re-basing cannot read: left as it is
                break
    return files


def re_rank(name: str) -> int | None:
    base = name.rsplit("/", 1)[-1]
    return int(base[5:-6]) if base.startswith("rank-") and base.endswith(".hsnap") and base[5:-6].isdigit() else None


def chain_files(desc: dict, inputs: dict, groups: dict) -> dict[str, bytes]:
    """The container's files (name -> bytes) of a chain mutant; a re-signed mutant of a link
    below the head gets every link above it re-based on it (so its digest is the one named)."""
    ch = desc["chain"]
    if ch.get("tp"):
        return tp_chain_files(desc, inputs, groups)
    group = ch["group"]
    files = {n: inputs[f"{group}/{n}"] for n in groups[group]}
    names = list(CK_NAMES if ch["ck"] else LINKS)
    sc = ch["scenario"]
    if sc == "bytes":
        j = ch["mutated"]
        files[names[j]] = mutated(desc, inputs)
        if desc["resign"]:
            rebase_above(files, names, j, names.index(ch["head"]))
    elif sc == "missing":
        files.pop(ch["remove"], None)
    elif sc == "stray":
        data = inputs[desc["target"]]
        if ch.get("stray_trunc") is not None:
            data = data[: ch["stray_trunc"]]
        files[ch["stray"]] = data
    elif sc == "swap":
        j = ch["mutated"]
        files[names[j]] = inputs[ch["swap"]]
        if desc["resign"]:
            rebase_above(files, names, j, names.index(ch["head"]))
    return files


def rebase_above(files: dict, names: list, j: int, head: int) -> None:
    """Links ``j+1 .. head`` re-based, each on the (mutated) link below it: base name, root
    digest, snapshot id, position and depth as the file below says; re-signed."""
    for a in range(j + 1, head + 1):
        try:
            if not mt.header_of(files[names[a]]).get("base"):
                return
            ops = rebase_ops(files[names[a - 1]], names[a - 1])
            files[names[a]] = mt.core.build({"target": ONE, "resign": True, "ops": ops}, {ONE: files[names[a]]}, {})[ONE]
        except Exception:  # noqa: BLE001 - a link the re-basing cannot read: left as it is
            return


class ChainExaminer:
    """restore_request of a chain's head (or the newest checkpoint) into pools whose free rows
    hold a sentinel; refusals must leave them byte-identical, acceptances hold what the chain
    says (this module's own walk down the base names)."""

    def __init__(self, seeds, scratch: str) -> None:
        self.seeds, self.scratch = seeds, scratch
        self.mig = MigrateExaminer(seeds, scratch)  # its pools (one set per kind)
        self.restore = None  # the call under test (default restore_request)

    def warm(self) -> None:
        self.mig.warm()

    def _honest(self, ch) -> dict:
        if ch.get("tp"):
            files = {f"{x}/{m}": self.seeds.inputs[f"{ch['group']}/{x}/{m}"] for x in TP_LINKS for m in TP_MEMBERS}
            return self._walk(files, ch["head"], ch["rank"])[0]
        files = {n: self.seeds.inputs[f"{ch['group']}/{n}"] for n in self.seeds.groups[ch["group"]]}
        return self._walk(files, ch["head"])[0]

    @staticmethod
    def _walk(files: dict, head: str, rank: int | None = None) -> tuple[dict, str | None]:
        """The chain below ``head`` by base names (rank ``rank`` of set directories): what it holds."""
        at = (lambda nm: nm) if rank is None else (lambda nm: f"{nm}/rank-{rank}.hsnap")
        if at(head) not in files:
            return {}, f"{at(head)} is not there"
        chain, seen = [Link(files[at(head)], head)], {head}
        while chain[0].base:
            nm = chain[0].base.get("name")
            if not isinstance(nm, str) or nm in seen or at(nm) not in files:
                return {}, f"{chain[0].name}: base {nm!r} not found once beside it"
            seen.add(nm)
            chain.insert(0, Link(files[at(nm)], nm))
        want, bad = expected(chain)
        if not bad:
            want["__output_ids"] = chain[-1].ids("output_ids")
            want["__position"] = chain[-1].position
        return want, bad

    def examine(self, desc: dict) -> dict:
        from hsnap_format.checkpoints import newest_links
        from hsnap_io import restore_request

        ch = desc["chain"]
        key = ch["kind"]
        try:
            files = chain_files(desc, self.seeds.inputs, self.seeds.groups)
            tgt = self.mig._pools(key)
            if not tgt.reset():
                return mt.harness("reset", f"pools {tgt.label} did not come back to their baseline: {tgt.changed()[:5]}")
            c = os.path.join(self.scratch, "c")
            if os.path.lexists(c):
                shutil.rmtree(c)
            for n, data in files.items():
                mt.write_file(os.path.join(c, n), data)
            os.makedirs(c, exist_ok=True)
        except Exception as e:  # noqa: BLE001
            r = mt.untyped(e, "build")
            r["cls"] = "harness-error"
            return r
        free0 = mt.free_counts(tgt.rtp, tgt.alloc)
        head = ch["head"]
        ident = link_identity(tp_size=2, tp_rank=ch["rank"]) if ch.get("tp") else link_identity()
        try:
            if ch["ck"]:
                stage = "newest_links"
                head = os.path.basename(newest_links(c).get("c", os.path.join(c, head)))
            stage = "restore"
            verify = ch.get("verify", True)
            res = (self.restore or restore_request)(os.path.join(c, head), req_to_token_pool=tgt.rtp, token_to_kv_pool_allocator=tgt.alloc,
                                                    identity=ident, verify=verify, exact_rollback=verify == "during")
        except HsnapError as e:
            return mt.refused(mt.typed(e, stage), tgt, free0)
        except BaseException as e:  # noqa: BLE001
            if mt.is_control(e):
                raise
            return mt.refused(mt.untyped(e, stage), tgt, free0)
        try:
            return self._judge(desc, files, head, tgt, res)
        except Exception as e:  # noqa: BLE001
            r = mt.untyped(e, "oracle")
            r["cls"] = "harness-error"
            return r

    def _judge(self, desc, files, head, tgt, res) -> dict:
        ch = desc["chain"]
        raw = ch["scenario"] == "bytes" and not desc["resign"]
        honest = self._honest(ch)
        if ch.get("tp") and raw and re_rank(desc["target"]) is None:  # a raw manifest mutant: the rank files are the honest ones
            raw = True
        if raw and head == ch["head"]:
            want, bad = honest, None
        else:
            try:
                want, bad = self._walk(files, head, ch.get("rank") if ch.get("tp") else None)
            except (KeyError, ValueError, TypeError, IndexError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
                return mt.fail("accepted-but-changed", "oracle", f"accepted a chain this oracle cannot read: {type(e).__name__}: {e}")
        if bad:
            return mt.fail("accepted-but-changed", "oracle", f"accepted a chain that is not one: {bad}")
        if res.state_position != want["__position"]:
            return mt.fail("accepted-but-changed", "oracle", f"position {res.state_position}, the chain's {want['__position']}")
        why = judge_rows(tgt, int(res.req_pool_idx), res.state_position, res.mamba_pool_idx, want, None)
        why = why or accounting(tgt, res.state_position, KINDS[ch["kind"]][1], res.mamba_pool_idx is not None)
        if why:
            return mt.fail("accepted-but-changed", "oracle", why)
        same = set(want) == set(honest) and all(
            np.array_equal(v, honest[n]) if isinstance(v, np.ndarray) else v == honest[n] for n, v in want.items())
        return {"cls": "accepted-unchanged" if same else "accepted-valid", "stage": "oracle"}


def mutant_files(seeds, desc: dict) -> dict[str, bytes]:
    if seeds.target == "chain":
        return chain_files(desc, seeds.inputs, seeds.groups)
    ex = MigrateExaminer.__new__(MigrateExaminer)
    ex.seeds = seeds
    ex.link_files = {key: [{n: seeds.inputs[f"{key}/{n}"]} for n in LINKS] for key in seeds.meta["kinds"]}
    for key in seeds.meta.get("tpmig", {}):
        ex.link_files[key] = [{f"{n}/{mem}": seeds.inputs[f"{key}/{n}/{mem}"] for mem in SET_MEMBERS} for n in LINKS]
    return MigrateExaminer._files(ex, desc) or {}

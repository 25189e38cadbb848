"""hsnap inside a TP 2 server on CPU: every rank writes its rank file of one snapshot set (hsnap_io.tp's
protocol over the scheduler's TP CPU group, manifest last); a fresh TP 2 server resumes the set, each rank its own
file, exactly; a set one rank cannot restore (its file corrupted) is refused on every rank — the other rank gives
back what it had allocated (the agreement runs inside the restore's rollback) — with the failing rank's reason.
Checkpoints of a TP 2 server are chains of sets; after a SIGKILL of the source mid-decode the target resumes the
newest link exactly.  A request live-migrated from one TP 2 server to the other (every link a set, applied by both
target ranks in step) continues exactly.

The servers also show TP 2 itself on CPU: ``python -m hsnap_sglang.serve --tp 2`` runs two scheduler ranks (gloo
all-reduce; one core range per rank through SGLANG_CPU_OMP_THREADS_BIND, which the wrapper sets) and serves greedy
requests deterministically, within bfloat16 rounding of transformers' float32 model (tolerance: see test_engine.py;
the TP-sharded reductions add their own rounding); the target stops on SIGTERM with no process left."""

from __future__ import annotations

import os
import shutil

import pytest

from engine_support import PROMPT_IDS, full_distribution, reference_logprobs
from hsnap_support import Stream, error_of, flush_cache, hsnap_server, paced, payload, prompt, references, start_together, stats, tokens, wait_idle, wait_links

from hsnap_format import open_chain, open_snapshot
from hsnap_format.checkpoints import choose_links, newest_links, parse_link
from hsnap_format.stores import store_for
from hsnap_sglang import client

pytestmark = [pytest.mark.engine, pytest.mark.slow]

N = 48
CK_PROMPT, CK_N, CK_M = prompt(74, 30), 120, 8
S_IDS, S_N = prompt(78, 24), 40
K_IDS, K_N = prompt(79, 24), 40
M_IDS, M_N = prompt(80, 26), 160  # live-migrated TP 2 -> TP 2
PAGE = 16
SHARED = prompt(75, 2 * PAGE)  # a system prompt: two full pages every drained request holds
DRAINED = {"d1": (SHARED + prompt(76, 8), 40), "d2": (SHARED + prompt(77, 12), 44)}
DRAINED_S3 = {"e1": DRAINED["d1"], "e2": DRAINED["d2"]}  # the same requests, drained under an s3:// prefix
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tp2(tiny_model_dir, tmp_path_factory, store):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("TP 2 on CPU needs two cores (one per rank)")
    work = tmp_path_factory.mktemp("hsnap-tp2")
    ids = prompt(71, 40)
    src = hsnap_server(tiny_model_dir, work / "src.log", "--tp", "2")
    # the target is another process from the start; it is asked nothing until the source has stopped
    dst = hsnap_server(tiny_model_dir, work / "dst.log", "--tp", "2", "--max-mamba-cache-size", "7", "--max-total-tokens", "3000",
                       env=store["env"])
    start_together(src, dst)
    try:
        full = {"input_ids": PROMPT_IDS, "sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 512}
        greedy = [src.post("/generate", full)]
        flush_cache(src.url)  # the same request again from an empty tree: determinism, not the cache
        greedy.append(src.post("/generate", full))
        other = Stream(src.url, payload("other", prompt(72, 21), 60))
        x = Stream(src.url, payload("x", ids, N))
        with paced(src.url):
            other.start()
            x.start()
            x.wait_tokens(8)
            out = client.pause(src.url, "x", str(work / "x-set"))
        x.finish()
        other.finish()
        # a live migration TP 2 -> TP 2: every link a set (each rank's file a delta of its own rank of the round
        # before), applied by each target rank as it comes, in step; the client's stream relayed by the source
        m = Stream(src.url, payload("m", M_IDS, M_N))
        with paced(src.url, 0.05):  # the 156 tokens after the move's start take 7.8 s at least: it ends while m decodes
            m.start()
            m.wait_tokens(4)
            moved = client.move(src.url, dst.url, "m", str(work / "mig"), tail=2, max_rounds=3, timeout_s=120)
        m.finish()
        forwards_m = stats(dst.url, "m")["forwards"]
        mig_idle = (wait_idle(src.url), wait_idle(dst.url))
        mig_files = sorted(os.listdir(work / "mig"))
        mig_link0 = sorted(os.listdir(work / "mig" / "link-0000.hsnap"))
        crashed = _checkpoint_then_sigkill(src, work)
    except BaseException:
        dst.stop()
        src.stop()
        raise
    try:
        # a copy of the set whose rank-1 file has one byte flipped inside a state section
        import hsnap_format as hf

        bad = work / "x-set-bad"
        shutil.copytree(work / "x-set", bad)
        with hf.open(str(bad / "rank-1.hsnap")) as snap:
            sec = next(s for s in snap.sections if s.kind == "temporal")
        with open(bad / "rank-1.hsnap", "r+b") as f:
            f.seek(sec.offset + 7)
            b = f.read(1)[0]
            f.seek(sec.offset + 7)
            f.write(bytes([b ^ 0x10]))
        before = wait_idle(dst.url)
        try:
            client.resume(dst.url, str(bad))
            refused = None
        except client.ServerError as e:
            refused = e
        after = wait_idle(dst.url)
        mig_s3 = f"s3://{store['bucket']}/mig-tp2"  # a TP server's links are sets of local rank files: both sides refuse
        tp_s3 = (error_of(client.migrate, dst.url, "no-such-rid", mig_s3, timeout_s=5), error_of(client.follow, dst.url, mig_s3, timeout_s=5))
        o = Stream(dst.url, payload("o", prompt(73, 30), 70))
        o.start()
        o.wait_tokens(2)
        run = client.resume(dst.url, str(work / "x-set"))
        o.finish()
        forwards = stats(dst.url, "x")["forwards"]
        cut = crashed["c"].events[-1]  # what the client of c had when the source died
        had = (len(cut.get("text") or ""), len(cut.get("output_ids") or []))
        chunks: list = []
        run_c = client.resume(dst.url, str(work / "ck"), seen=had, on_chunk=lambda rid, text, ids, e: chunks.append((text, ids)))
        forwards_c = stats(dst.url, "c")["forwards"]
        # a dedup drain of the TP 2 server: every running request a set in one directory, the full pages of attention
        # rows of each rank stored once in its page store; resumed from it here
        drained, streams = _dedup_drained(dst.url, DRAINED, str(work / "drained"))
        # the same dedup drain under an s3:// prefix (a real SeaweedFS): each request a set of rank objects there,
        # each rank's full pages in the one page store beside them; resumed from the prefix
        e_url = f"s3://{store['bucket']}/drained-tp2"
        drained_s3, e_streams = _dedup_drained(dst.url, DRAINED_S3, e_url)
        run_e = client.resume(dst.url, e_url)
        # a pause of the TP 2 server into an object store: a set under an s3:// prefix, resumed from its URL here
        s_url = f"s3://{store['bucket']}/s-set"
        s_stream = Stream(dst.url, payload("s", S_IDS, S_N))
        with paced(dst.url):
            s_stream.start()
            s_stream.wait_tokens(4)
            paused_s3 = client.pause(dst.url, "s", s_url)
        s_stream.finish()
        before_s = stats(dst.url, "s")["forwards"]["extend"]
        run_s = client.resume(dst.url, s_url)
        extend_s = stats(dst.url, "s")["forwards"]["extend"] - before_s
        # checkpoints of the TP 2 server under an s3:// prefix: each link a set there; the request then paused, the
        # prefix resumed from its newest link (the chain checked below both ranks)
        k_url = f"s3://{store['bucket']}/ck"
        k_stream = Stream(dst.url, payload("k", K_IDS, K_N))
        with paced(dst.url):
            k_stream.start()
            k_stream.wait_tokens(2)
            k_first = client.checkpoint(dst.url, "k", k_url, every=4)
            wait_links(dst.url, "k", 2, stream=k_stream)
            k_paused = client.pause(dst.url, "k", str(work / "k-final"))
        k_stream.finish()
        run_k = client.resume(dst.url, k_url)
        options = {"endpoint_url": store["env"]["AWS_ENDPOINT_URL"], "key": store["env"]["AWS_ACCESS_KEY_ID"],
                   "secret": store["env"]["AWS_SECRET_ACCESS_KEY"], "region": "us-east-1"}
        s3_objects = sorted(e.path.rsplit("/", 1)[1] for e in store_for(s_url, options).list(s_url))
        before_d = {rid: stats(dst.url, rid)["forwards"]["extend"] for rid in DRAINED}  # each one's prefill here
        run_d = client.resume(dst.url, str(work / "drained"))
        extends_d = {rid: stats(dst.url, rid)["forwards"]["extend"] - before_d[rid] for rid in DRAINED}
        idle = wait_idle(dst.url)
        flush_cache(dst.url)
        refs = references(dst.url, {"x": (ids, N), "other": (prompt(72, 21), 60), "o": (prompt(73, 30), 70)})
        refs.update(references(dst.url, DRAINED))  # as they ran: the two together
        refs.update(references(dst.url, {"s": (S_IDS, S_N)}))
        refs.update(references(dst.url, {"k": (K_IDS, K_N)}))
        refs.update(references(dst.url, {"m": (M_IDS, M_N)}))
        ref_c = Stream(dst.url, payload("c-ref", CK_PROMPT, CK_N))
        ref_c.start()
        ref_c.finish()
    finally:
        dst_code = dst.stop()
    return {"work": work, "out": out, "x": x, "other": other, "o": o, "run": run, "forwards": forwards, "refs": refs, "idle": idle,
            "refused": refused, "before": before, "after": after, "greedy": greedy, "dst_code": dst_code,
            "dst_alive": dst.living_descendants(), "src_ready_s": src.ready_after_s,
            "tp_s3": tp_s3, "mig": {"moved": moved, "stream": m, "forwards": forwards_m, "idle": mig_idle, "files": mig_files, "link0": mig_link0},
            "crashed": crashed, "had": had, "cut": cut, "chunks": chunks, "run_c": run_c, "forwards_c": forwards_c, "ref_c": ref_c.final,
            "drained": drained, "drained_streams": streams, "run_d": run_d, "extends_d": extends_d,
            "drained_s3": {"url": e_url, "answer": drained_s3, "streams": e_streams, "run": run_e},
            "s3": {"url": s_url, "paused": paused_s3, "stream": s_stream, "run": run_s, "extend": extend_s, "objects": s3_objects},
            "k": {"url": k_url, "first": k_first, "paused": k_paused, "run": run_k}}


def _dedup_drained(url: str, requests: dict, into: str) -> tuple[dict, dict]:
    """``requests`` streamed together in the server, each drained (dedup, PAGE-position pages) into ``into`` after 4
    outputs: the drain's answer and the finished streams."""
    streams = {rid: Stream(url, payload(rid, ids, n)) for rid, (ids, n) in requests.items()}
    with paced(url):
        for st in streams.values():
            st.start()
        for st in streams.values():
            st.wait_tokens(4)
        drained = client.drain(url, into, dedup=True, page_size=PAGE)
    for st in streams.values():
        st.finish()
    return drained, streams


def _checkpoint_then_sigkill(src, work) -> dict:
    """Request c checkpointed every CK_M tokens in the TP 2 source (each link a set), the source's process group
    SIGKILLed once three links are committed, mid-decode."""
    c = Stream(src.url, payload("c", CK_PROMPT, CK_N))
    with paced(src.url):
        c.start()
        c.wait_tokens(2)
        first = client.checkpoint(src.url, "c", str(work / "ck"), every=CK_M)
        wait_links(src.url, "c", 3, stream=c)
        during = stats(src.url)["checkpoints"]  # the links committed before the kill
        alive = src.crash()
    c.join(60)
    return {"c": c, "first": first, "during": during, "alive": alive, "log": src.log_tail()}


def test_tp2_live_migration_to_a_tp2_server_continues_exactly(tp2):
    """TP 2 -> TP 2 live: pre-copy rounds and the final link are sets (a rank file each, manifest last), applied by
    both target ranks in step; the request continues in the target bit for bit as its uninterrupted run there, with
    decode steps only; both servers' pool accounting agrees afterwards."""
    mig = tp2["mig"]
    src, run = mig["moved"].source, mig["moved"].run
    assert src["tp_size"] == 2 and len(src["rounds"]) >= 1
    assert mig["stream"].final["meta_info"]["finish_reason"]["type"] == "hsnap_export"
    assert run.final["meta_info"]["finish_reason"]["type"] == "length"
    assert tokens(run.final) == tp2["refs"]["m"]
    assert mig["forwards"] == {"decode": M_N - src["output_tokens"], "extend": 0}
    assert [a["committed_positions"] for a in run.info["links"]] == [r["committed_positions"] for r in src["rounds"]] + [
        src["committed_positions"]]
    rounds = [f"link-{i:04d}.hsnap" for i in range(len(src["rounds"]))]
    assert mig["files"] == sorted(rounds + [r + ".applied" for r in rounds] + ["final.hsnap", "final.hsnap.claimed"])
    assert "rank-0.hsnap" in mig["link0"] and "rank-1.hsnap" in mig["link0"]
    for idle in mig["idle"]:
        assert idle["checks"]["pool_leak"] is False and idle["checks"]["req_rows_ok"] is True, idle["checks"]
        assert idle["follows"] == [] and idle["arrived"] == [] and idle["migrations"] == {}
    assert tokens(tp2["run"].final) == tp2["refs"]["x"]  # x, paused before the migration, resumed exactly


def test_tp2_migration_through_an_object_store_is_refused_by_name_on_both_sides(tp2):
    for e in tp2["tp_s3"]:
        assert e is not None and e.status == 400 and "a local directory" in str(e.error.get("expected")), e


def test_tp2_serves_greedy_deterministically_close_to_transformers(tp2, tiny_model_dir):
    import torch

    print(f"\nlaunch_server --tp 2: launch -> ready {tp2['src_ready_s']:.1f} s")
    first, second = tp2["greedy"]
    assert first["meta_info"]["output_token_logprobs"] == second["meta_info"]["output_token_logprobs"]
    ids = [p[1] for p in first["meta_info"]["output_token_logprobs"]]
    _, decode = reference_logprobs(tiny_model_dir, PROMPT_IDS, ids, "float32")
    rows = torch.tensor([full_distribution(t) for t in first["meta_info"]["output_top_logprobs"]], dtype=torch.float64)
    assert (rows - decode).abs().max().item() <= 0.25
    assert tp2["dst_code"] is not None and tp2["dst_alive"] == []  # the target stopped by SIGTERM, no process left


def test_tp2_checkpoints_are_sets_resumed_exactly_after_a_sigkill(tp2):
    """A TP 2 server checkpoints a request: each link a set (a manifest, each rank's file a delta of its own rank
    of the link before, down to a plain first link), committed whole while the request decodes.  After a SIGKILL of
    the source mid-decode, a fresh TP 2 server resumes the newest link: at most CK_M tokens (plus a whole-character
    wait) lost, then tokens and logprobs equal to an uninterrupted run, by decoding only, the client's text
    continuous."""
    crashed, work = tp2["crashed"], tp2["work"]
    why = f"log: {crashed['log'][-800:]}"
    assert crashed["alive"] == [] and crashed["c"].events[-1]["meta_info"]["finish_reason"] is None, why
    first = crashed["first"]
    assert first["tp_size"] == 2 and first["link"] == 1 and first["base"] is None and crashed["during"]["c"]["links"] >= 3
    links = sorted(n for n in os.listdir(work / "ck") if parse_link(n))
    assert all(sorted(os.listdir(work / "ck" / n)) == ["manifest.json", "rank-0.hsnap", "rank-1.hsnap"] for n in links), links
    newest = newest_links(str(work / "ck"))["c"]
    assert os.path.basename(newest) == links[-1] and len(links) >= 3
    for rank in (0, 1):
        with open_chain(newest, rank=rank) as chain:
            assert len(chain) == len(links) and chain.links[0].base is None
            assert [link.identity.tp_rank for link in chain.links] == [rank] * len(links)
            chain.verify()
            link_outputs = chain.head.request["output_tokens"]
    # every link committed before the kill survived it; at TP > 1 a link is written in lockstep (the decode waits
    # for it), so at most a link's worth of tokens, and the one being written, are lost
    assert link_outputs >= crashed["during"]["c"]["last_output_tokens"], why
    assert 0 <= tp2["had"][1] - link_outputs <= 2 * CK_M, why
    # a copy whose newest link has one byte of its rank-1 file flipped: the link before it is the newest that holds
    bad = work / "ck-bad"
    shutil.copytree(work / "ck", bad)
    with open_snapshot(str(bad / links[-1] / "rank-1.hsnap")) as snap:  # a state byte: the file opens, its chain fails
        at = next(sec for sec in snap.sections if sec.kind == "temporal").offset + 7
    with open(bad / links[-1] / "rank-1.hsnap", "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 0x10]))
    choice = choose_links(str(bad))["c"]
    assert os.path.basename(choice.path) == links[-2] and [os.path.basename(p) for p, _ in choice.passed_over] == [links[-1]]
    info = tp2["run_c"].info[0]
    assert info["ok"] and info["path"] == newest and info["result"]["committed_positions"] == len(CK_PROMPT) + link_outputs - 1
    ref, final = tp2["ref_c"], tp2["run_c"].final
    assert tokens(final) == tokens(ref)
    text = (tp2["cut"].get("text") or "") + "".join(t for t, _ in tp2["chunks"])
    ids = list(tp2["cut"].get("output_ids") or []) + [i for _, chunk in tp2["chunks"] for i in chunk]
    assert text == ref["text"] and ids == ref["output_ids"]
    assert tp2["forwards_c"]["extend"] == 0


def test_tp2_export_writes_every_rank_and_the_manifest(tp2):
    import hsnap_format as hf

    out = tp2["out"]
    assert out["tp_size"] == 2
    with hf.open(str(tp2["work"] / "x-set")) as snap:
        assert sorted(snap.ranks) == [0, 1] and snap.manifest.snapshot_id == out["snapshot_id"]
        for r in snap.ranks.values():
            r.verify()
            assert r.state_position == out["committed_positions"] and r.identity.tp_size == 2
    assert out["bytes"] == sum(os.path.getsize(tp2["work"] / "x-set" / f"rank-{r}.hsnap") for r in (0, 1))
    assert tp2["x"].final["meta_info"]["finish_reason"]["path"] == str(tp2["work"] / "x-set")


def test_tp2_resume_is_exact_with_decode_inputs_only(tp2):
    assert tokens(tp2["run"].final) == tp2["refs"]["x"]
    assert tp2["forwards"] == {"decode": N - tp2["out"]["output_tokens"], "extend": 0}
    assert tokens(tp2["other"].final) == tp2["refs"]["other"] and tokens(tp2["o"].final) == tp2["refs"]["o"]
    assert tp2["idle"]["checks"]["pool_leak"] is False


def test_tp2_one_rank_refusing_refuses_on_every_rank_without_side_effect(tp2):
    e = tp2["refused"]
    assert isinstance(e, client.ServerError), "the corrupted set was resumed"
    assert e.error_type == "DigestMismatchError" and e.error.get("tp_rank") == 1, e.error
    assert "rank-1.hsnap" in e.error["path"]
    keep = lambda s: {"pools": s["pools"], "requests": s["requests"]}  # noqa: E731
    assert keep(tp2["before"]) == keep(tp2["after"]) and tp2["after"]["checks"]["pool_leak"] is False


def test_tp2_dedup_drain_writes_a_set_per_request_pages_once_and_each_resumes_exactly(tp2):
    """A dedup drain of a TP 2 server: each running request a set in the directory (a manifest and both ranks'
    files), its stream ended with its path; each rank's full pages of attention rows in the one page store beside
    them, the shared prompt's pages put once per rank and referenced by both requests (the answer sums the ranks);
    the directory resumed in the same server continues each exactly, decoding only."""
    d = tp2["drained"]
    assert d["ok"] and sorted(i["rid"] for i in d["items"]) == sorted(DRAINED), d
    for item in d["items"]:
        assert item["ok"] and item["result"]["tp_size"] == 2, item
        assert sorted(os.listdir(item["path"])) == ["manifest.json", "rank-0.hsnap", "rank-1.hsnap"]
        stream = tp2["drained_streams"][item["rid"]]
        assert stream.final["meta_info"]["finish_reason"]["path"] == item["path"]
    dd = d["dedup"]
    full_pages = {i["rid"]: i["result"]["committed_positions"] // PAGE for i in d["items"]}
    shared = len(SHARED) // PAGE
    assert dd["page_size"] == PAGE and dd["pages_put"] == 2 * (shared + sum(n - shared for n in full_pages.values())), dd
    assert dd["pages_reused"] == 2 * shared * (len(DRAINED) - 1), dd  # each rank: the prompt's pages reused once
    pages = [p for p in (tp2["work"] / "drained" / "pages").iterdir() if p.is_file()]
    assert len(pages) == dd["pages_put"] and sum(p.stat().st_size for p in pages) == dd["page_bytes_put"]
    run = tp2["run_d"]
    assert sorted(run.finals) == sorted(DRAINED)
    for rid in DRAINED:
        assert tokens(run.finals[rid]) == tp2["refs"][rid], rid
        assert tp2["extends_d"][rid] == 0, rid  # resumed by decoding: no extend since the drain


def test_tp2_dedup_drain_into_an_object_store_puts_each_ranks_pages_once_and_resumes_exactly(tp2):
    """The dedup drain of a TP 2 server under an ``s3://`` prefix: each request a set there (rank objects, manifest
    last), each rank's full pages put once into the page store beside them; the prefix resumed, each request as its
    uninterrupted run (the same requests as the local drain's, so the same references)."""
    e = tp2["drained_s3"]
    d = e["answer"]
    assert d["ok"] and sorted(i["rid"] for i in d["items"]) == sorted(DRAINED_S3), d
    assert all(i["result"]["tp_size"] == 2 and i["path"].startswith(e["url"] + "/") for i in d["items"]), d
    shared = len(SHARED) // PAGE
    full_pages = {i["rid"]: i["result"]["committed_positions"] // PAGE for i in d["items"]}
    assert d["dedup"]["pages_put"] == 2 * (shared + sum(n - shared for n in full_pages.values())), d["dedup"]
    assert d["dedup"]["pages_reused"] == 2 * shared * (len(DRAINED_S3) - 1), d["dedup"]
    run = e["run"]
    assert sorted(run.finals) == sorted(DRAINED_S3)
    for rid, same in (("e1", "d1"), ("e2", "d2")):
        assert e["streams"][rid].final["meta_info"]["finish_reason"]["type"] == "hsnap_export"
        assert tokens(run.finals[rid]) == tp2["refs"][same], rid


def test_tp2_pause_into_an_object_store_writes_a_set_and_resumes_exactly(tp2):
    """A TP 2 server pauses a request under an ``s3://`` prefix (a real SeaweedFS): each rank uploads its rank
    object, rank 0 the manifest last (no pending marker left); the same server resumes it from the URL exactly, by
    decoding only."""
    s3 = tp2["s3"]
    assert s3["paused"]["tp_size"] == 2 and s3["paused"]["path"] == s3["url"], s3["paused"]
    assert s3["stream"].final["meta_info"]["finish_reason"]["path"] == s3["url"]
    assert s3["objects"] == ["manifest.json", "rank-0.hsnap", "rank-1.hsnap"]
    assert tokens(s3["run"].final) == tp2["refs"]["s"] and s3["extend"] == 0


def test_tp2_checkpoints_into_an_object_store_prefix_resume_from_the_newest_link(tp2):
    """A TP 2 server's checkpoints under an ``s3://`` prefix: each link a set there; after the request left (paused
    elsewhere), the prefix resumes from its newest link — a delta set whose chain is checked below both ranks —
    and the request continues exactly from there."""
    k = tp2["k"]
    assert k["first"]["tp_size"] == 2 and k["first"]["path"].startswith(k["url"] + "/") and k["first"]["link"] == 1
    info = k["run"].info[0]
    assert info["ok"] and parse_link(info["path"].rstrip("/").rsplit("/", 1)[1])[1] >= 2, info
    assert info["result"]["committed_positions"] <= len(K_IDS) + k["paused"]["output_tokens"] - 1  # a link, not the pause
    assert tokens(k["run"].final) == tp2["refs"]["k"]

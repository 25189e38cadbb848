"""Live migration of a decoding request between two processes, on real SGLang pools.

The tiny hybrid model (:mod:`hsnap_testing.model`) decodes through SGLang's own pools: after every step the
request's new attention row and its GDN conv / temporal state are written into its slots (its row of
``req_to_token``, its Mamba slot), as a forward pass of the engine writes them. :mod:`hsnap_io.migrate` moves the
request: the source pre-copies rounds while it keeps decoding, then stops and writes the last delta; the target
applies every link into its own pools as it arrives and, after the last, continues decoding from what is in its
pools (the model's cache is rebuilt from the pool slots: nothing of the history is recomputed).

Roles (``python -m hsnap_testing.migration ROLE --spec SPEC.json --result OUT.json``; arguments as one JSON
object, results as JSON, no pickle):

* ``reference``: the uninterrupted run of ``n`` outputs.
* ``source``: prefill, decode; for each method of ``spec["methods"]`` (``live``, ``stop``, ``recompute``) migrate
  the request through ``DIR/<i>-<method>`` and keep decoding (the next method continues the same request: a
  measurement convenience; the last method releases the slots).
* ``target``: for each method, take the request over (fresh pools of another capacity, other requests in them,
  every buffer filled with noise) and decode on to ``n`` outputs (``recompute``: re-prefill the history instead).

Clock: ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every process of the machine), so the downtime is the
source's time of its last token to the target's time of its first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import Any

import torch

from . import pools as kit_pools
from .model import ModelGeometry, TinyModel, pool_tensors_to_cache, read_from_pools

METHODS = ("live", "live-nofsync", "stop", "recompute")  # live-nofsync: the links are not fsynced (visible, not durable)
RECOMPUTE_FILE = "history.json"  # the recompute method's only transfer: the token ids (written atomically)
READY_SUFFIX = ".ready"  # the target is waiting for this method's links


def _pin_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (only possible before any parallel work)
        pass


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _wait_for(path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: not there after {timeout_s} s")
        time.sleep(0.001)


# --------------------------------------------------------------------------- decoding through the pools


class PooledRequest:
    """One request decoding through real SGLang pools: its slots follow the model's cache."""

    def __init__(self, pools: kit_pools.PoolSet, geom: ModelGeometry) -> None:
        if pools.page_size != 1:
            raise ValueError("the decode loop allocates one slot per step (page size 1)")
        self.pools, self.geom = pools, geom
        self.slots = kit_pools.alloc_request(pools, 0, seed=0)  # a row and a Mamba slot; token slots come with the positions
        self.token = self.slots.token_indices
        self.position = 0

    def sync(self, cache) -> None:
        """Write the positions the cache gained (their K/V rows into new slots) and the whole GDN state."""
        g, p = self.geom, self.pools
        n = cache.get_seq_length()
        if n > self.position:
            fresh = p.token_to_kv_pool_allocator.alloc(n - self.position)
            if fresh is None:
                raise RuntimeError(f"no room for {n - self.position} token slots")
            fresh = fresh.to(torch.int64)
            p.req_to_token_pool.req_to_token[self.slots.req_pool_idx, self.position : n] = fresh.to(torch.int32)
            kv = p.kv_pool
            for lid in g.full_attention_layer_ids:
                layer = cache.layers[lid]
                kv.get_key_buffer(lid)[fresh] = layer.keys[0, :, self.position : n].permute(1, 0, 2)
                kv.get_value_buffer(lid)[fresh] = layer.values[0, :, self.position : n].permute(1, 0, 2)
            self.token = torch.cat([self.token, fresh])
            self.position = n
        state = p.req_to_token_pool.mamba_pool.mamba_cache
        for lid in g.linear_layer_ids:
            m, layer = p.req_to_token_pool.mamba_map[lid], cache.layers[lid]
            state.conv[0][m, self.slots.mamba_pool_idx] = layer.conv_states[0][0, :, 1:]
            state.temporal[m, self.slots.mamba_pool_idx] = layer.recurrent_states[0][0].transpose(-1, -2)

    def release(self) -> None:
        kit_pools.free_request(self.pools, dataclasses.replace(self.slots, token_indices=self.token, n_tokens=self.position))


def cache_from_pools(pools: kit_pools.PoolSet, geom: ModelGeometry, token_indices, mamba_idx: int):
    """The model's cache rebuilt from a request's pool slots (every row)."""
    tensors = read_from_pools(pools.req_to_token_pool, pools.token_to_kv_pool_allocator, token_indices, mamba_idx, geom)
    return pool_tensors_to_cache(tensors, geom, len(token_indices))


def extend_cache(cache, pools: kit_pools.PoolSet, geom: ModelGeometry, fresh, mamba_idx: int) -> None:
    """Append the rows of slots ``fresh`` to ``cache`` and take the GDN state from the Mamba slot."""
    g = geom
    kv = pools.kv_pool
    if len(fresh):
        for lid in g.full_attention_layer_ids:
            k = kv.get_key_buffer(lid)[fresh].permute(1, 0, 2).unsqueeze(0)
            v = kv.get_value_buffer(lid)[fresh].permute(1, 0, 2).unsqueeze(0)
            cache.layers[lid].update(k.contiguous(), v.contiguous())
    state = pools.req_to_token_pool.mamba_pool.mamba_cache
    for lid in g.linear_layer_ids:
        m, layer = pools.req_to_token_pool.mamba_map[lid], cache.layers[lid]
        layer.conv_states[0][0, :, 0] = 0  # never read by the next output (SGLang keeps K-1 columns)
        layer.conv_states[0][0, :, 1:] = state.conv[0][m, mamba_idx]
        layer.recurrent_states[0][0] = state.temporal[m, mamba_idx].transpose(-1, -2)


# --------------------------------------------------------------------------- grammar (xgrammar, SGLang's backend)


def grammar_backend(vocab_size: int):
    """SGLang's xgrammar backend over the tiny model's tokenizer, and the ids of its special tokens."""
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
    from transformers import PreTrainedTokenizerFast

    from hsnap_sglang.tiny import SPECIAL_TOKENS, build_tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(vocab_size), eos_token=SPECIAL_TOKENS[0])
    specials = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    return XGrammarGrammarBackend(tok, vocab_size=vocab_size, model_eos_token_ids=[tok.eos_token_id]), specials


class Sampler:
    """Greedy selection, under a grammar matcher when the request has one (special tokens, the stop
    token among them, never selected: the request decodes its whole budget, as with ``ignore_eos``)."""

    def __init__(self, vocab_size: int, grammar=None) -> None:
        self.vocab_size = vocab_size
        self.matcher, self.banned = grammar if grammar is not None else (None, [])

    def select(self, logits: torch.Tensor) -> tuple[int, float]:
        logits = logits.float()
        lp = torch.log_softmax(logits, dim=-1)
        if self.matcher is None:
            tok = int(torch.argmax(logits))
        else:
            mask = self.matcher.allocate_vocab_mask(self.vocab_size, 1, "cpu")
            self.matcher.fill_vocab_mask(mask, 0)
            masked = logits.clone().unsqueeze(0)
            self.matcher.apply_vocab_mask(masked, mask)
            masked[0, self.banned] = float("-inf")
            tok = int(torch.argmax(masked[0]))
            self.matcher.accept_token(tok)
        return tok, float(lp[tok])


def matcher_for(spec: dict, vocab_size: int, output_ids=()):
    """``(matcher, banned ids)``: a fresh matcher of the request's grammar, fed ``output_ids``
    (:func:`hsnap_sglang.req.replay_grammar`, as a resume re-derives it); None without a grammar."""
    if not spec.get("regex"):
        return None
    from hsnap_sglang.req import replay_grammar

    backend, specials = grammar_backend(vocab_size)
    return replay_grammar(backend, ("regex", spec["regex"]), output_ids, require_reasoning=False)[1], specials


# --------------------------------------------------------------------------- roles


def _demo(spec: dict) -> TinyModel:
    _pin_threads(int(spec.get("threads", 1)))
    demo = TinyModel(spec.get("arch", "qwen3_5"), int(spec.get("model_seed", 0)))
    impl = spec.get("attn_implementation", "eager")
    demo.model.config._attn_implementation = impl
    for layer in demo.model.model.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is not None and hasattr(attn, "config"):
            attn.config._attn_implementation = impl
    return demo


def _prompt(spec: dict) -> list[int]:
    g = torch.Generator().manual_seed(int(spec.get("prompt_seed", 3)))
    return torch.randint(3, 500, (int(spec["prompt_len"]),), generator=g).tolist()


def _record(spec: dict, prompt, outputs, logprobs):
    import hsnap_format as hf

    sampling: dict[str, Any] = {"temperature": 0.0, "top_p": 1.0}
    if spec.get("regex"):
        sampling["regex"] = spec["regex"]
    return hf.RequestRecord(rid=spec.get("rid", "mig-1"), prompt_ids=list(prompt), output_ids=list(outputs), output_logprobs=list(logprobs),
                            state_position=len(prompt) + len(outputs) - 1, sampling=sampling, max_new_tokens=int(spec["n"]),
                            streamed_tokens=len(outputs))


def _prefill(demo: TinyModel, spec: dict, prompt, sampler: Sampler):
    """The prompt, in chunks of ``prefill_chunk`` positions (the whole prompt at once without it)."""
    chunk = int(spec.get("prefill_chunk") or len(prompt))
    cache = demo.dec.new_cache()
    for a in range(0, len(prompt), chunk):
        logits = demo.dec._forward(torch.tensor([prompt[a : a + chunk]]), cache)
    return cache, sampler.select(logits)


def reference(spec: dict) -> dict:
    demo = _demo(spec)
    prompt = _prompt(spec)
    sampler = Sampler(demo.geom.vocab_size, matcher_for(spec, demo.geom.vocab_size))
    cache, (tok, lp) = _prefill(demo, spec, prompt, sampler)
    outputs, logprobs = [tok], [lp]
    while len(outputs) < spec["n"]:
        tok, lp = sampler.select(demo.dec.step(cache, outputs[-1]))
        outputs.append(tok)
        logprobs.append(lp)
    return {"token_ids": outputs, "logprobs": logprobs}


def source(spec: dict) -> dict:
    """Decode, migrating through ``spec["dir"]/<method>`` for each method in turn."""
    from hsnap_io.migrate import MigrationSource

    demo = _demo(spec)
    prompt = _prompt(spec)
    pools, _ = demo.pools(size=int(spec["source_size"]), mamba_size=4, others=(13,), noise_seed=11)
    sampler = Sampler(demo.geom.vocab_size, matcher_for(spec, demo.geom.vocab_size))
    free_before = pools.token_to_kv_pool_allocator.available_size()
    req = PooledRequest(pools, demo.geom)
    t = time.perf_counter()
    cache, (tok, lp) = _prefill(demo, spec, prompt, sampler)
    req.sync(cache)
    prefill_s = time.perf_counter() - t
    outputs, logprobs, steps = [tok], [lp], []

    def decode(k: int) -> float:
        """k decode steps through the pools; the time of the last token."""
        for _ in range(k):
            t0 = time.perf_counter()
            logits = demo.dec.step(cache, outputs[-1])
            req.sync(cache)  # the forward's writes into the request's slots
            tok, lp = sampler.select(logits)
            outputs.append(tok)
            logprobs.append(lp)
            steps.append(time.perf_counter() - t0)
        return time.monotonic()

    def record():
        return _record(spec, prompt, outputs, logprobs)

    def precopy(mig, entry) -> None:
        t0 = time.perf_counter()
        info = mig.precopy(req.slots.req_pool_idx, record())
        entry["rounds"].append({"position": record().state_position, "payload_bytes": info.payload_bytes, "export_s": time.perf_counter() - t0})

    log = []
    for i, method in enumerate(spec["methods"]):
        where = os.path.join(spec["dir"], f"{i}-{method}")
        _wait_for(where + READY_SUFFIX, float(spec.get("timeout_s", 600)))  # the target is done with the method before
        entry: dict[str, Any] = {"method": method, "rounds": []}
        if method == "recompute":  # the history's token ids are all that moves
            t_last = decode(int(spec["tail"]))
            os.makedirs(where, exist_ok=True)
            _write_json(os.path.join(where, RECOMPUTE_FILE), {"prompt": prompt, "outputs": outputs, "logprobs": logprobs})
            entry["export_s"] = time.monotonic() - t_last
        else:
            mig = MigrationSource(where, req_to_token_pool=pools.req_to_token_pool, token_to_kv_pool_allocator=pools.token_to_kv_pool_allocator,
                                  identity=demo.identity(), fsync=bool(spec.get("fsync", True)) and method != "live-nofsync")
            t_last = None
            if method in ("live", "live-nofsync"):
                for r in range(int(spec["rounds"])):  # pre-copy rounds, decoding on between them
                    if r:
                        decode(int(spec["every"]))
                    precopy(mig, entry)
                # then: decode on; each time the target has applied every round, either few rows are new
                # (at most `every`: stop) or a round takes the new ones — never a round the target has
                # not asked for by applying the last, so a target slow to take the base in is not flooded
                since, checks = 0, 0
                while True:
                    t_last = decode(int(spec["every"]))
                    since, checks = since + int(spec["every"]), checks + 1
                    if checks >= int(spec.get("max_rounds", 1000)):
                        break
                    if mig.caught_up():
                        if since <= int(spec["every"]):
                            break
                        precopy(mig, entry)
                        since = 0
            else:
                t_last = decode(int(spec["tail"]))  # the last tokens on the source; then it stops the request
            t0 = time.perf_counter()
            info = mig.stop(req.slots.req_pool_idx, record())
            entry.update(export_s=time.perf_counter() - t0, final_payload_bytes=info.payload_bytes, final_file_bytes=info.file_length)
        entry.update(t_last=t_last, position=record().state_position, outputs=len(outputs))
        log.append(entry)
    decode(1)  # the token the source would have decoded next: what the target's first token is compared with
    req.release()  # every last link is durable: the source's slots go back
    free_after = pools.token_to_kv_pool_allocator.available_size()
    return {"token_ids": outputs, "logprobs": logprobs, "prefill_s": prefill_s, "methods": log, "free_before": free_before, "free_after_release": free_after,
            "pool_size": pools.size, "decode_step_s": steps}


def _warm(demo: TinyModel, spec: dict) -> None:
    """A few steps of another request first: the target is a serving process, its decode path warm."""
    sampler = Sampler(demo.geom.vocab_size)
    cache, (tok, _) = _prefill(demo, {}, _prompt({"prompt_len": 8, "prompt_seed": 99}), sampler)
    for _ in range(3):
        tok, _ = sampler.select(demo.dec.step(cache, tok))


def target(spec: dict) -> dict:
    """Take the request over for each method in turn and decode on."""
    from hsnap_io.migrate import MigrationTarget

    demo = _demo(spec)
    pools, _ = demo.pools(size=int(spec["target_size"]), mamba_size=8, others=(7, 23), noise_seed=23)
    identity = demo.identity()
    _warm(demo, spec)
    out = []
    os.makedirs(spec["dir"], exist_ok=True)
    for i, method in enumerate(spec["methods"]):
        where = os.path.join(spec["dir"], f"{i}-{method}")
        with open(where + READY_SUFFIX, "w"):  # one method at a time: each measured on an idle target
            pass
        entry: dict[str, Any] = {"method": method}
        if method == "recompute":
            path = os.path.join(where, RECOMPUTE_FILE)
            _wait_for(path, float(spec.get("timeout_s", 600)))
            with open(path) as f:
                hist = json.load(f)
            t0 = time.monotonic()
            outputs, logprobs = hist["outputs"], hist["logprobs"]
            sampler = Sampler(demo.geom.vocab_size, matcher_for(spec, demo.geom.vocab_size, outputs))
            cache = demo.dec.new_cache()
            history = hist["prompt"] + outputs
            chunk = int(spec.get("prefill_chunk") or len(history))
            t_step = time.perf_counter()
            for a in range(0, len(history), chunk):  # every position of the history again
                logits = demo.dec._forward(torch.tensor([history[a : a + chunk]]), cache)
            entry["restore_s"] = time.monotonic() - t0
            entry["applied"] = []
        else:
            tgt = MigrationTarget(req_to_token_pool=pools.req_to_token_pool, token_to_kv_pool_allocator=pools.token_to_kv_pool_allocator, identity=identity)
            cache, applied = None, []
            for link in tgt.follow(where, timeout_s=float(spec.get("timeout_s", 600))):
                t_apply = time.monotonic()
                req = tgt.request
                if cache is None:
                    cache = cache_from_pools(pools, demo.geom, req.token_indices, req.mamba_pool_idx)
                else:
                    extend_cache(cache, pools, demo.geom, req.token_indices[req.state_position - link.rows :], req.mamba_pool_idx)
                applied.append({"path": os.path.basename(link.path), "rows": link.rows, "position": link.state_position,
                                "bytes_uploaded": link.bytes_uploaded, "final": link.final, "cache_s": time.monotonic() - t_apply,
                                "t_applied": t_apply})
            rec = tgt.request.record
            outputs, logprobs = rec.output_ids.tolist(), rec.output_logprobs.tolist()
            sampler = Sampler(demo.geom.vocab_size, matcher_for(dict(rec.sampling), demo.geom.vocab_size, outputs))
            t_step = time.perf_counter()
            logits = demo.dec.step(cache, outputs[-1])  # the pending token: the first forward on the target
            entry["applied"] = applied
            entry["slots"] = {"req_pool_idx": tgt.request.req_pool_idx, "token_slots": len(tgt.request.token_indices)}
        tok, lp = sampler.select(logits)
        t_first = time.monotonic()
        entry["first_step_s"] = time.perf_counter() - t_step
        outputs, logprobs = outputs + [tok], logprobs + [lp]
        while spec.get("continue", True) and len(outputs) < spec["n"] and method == spec["methods"][-1]:
            tok, lp = sampler.select(demo.dec.step(cache, outputs[-1]))
            outputs.append(tok)
            logprobs.append(lp)
        if method != "recompute":
            tgt.release()
        entry.update(t_first=t_first, token_ids=outputs, logprobs=logprobs)
        out.append(entry)
    return {"methods": out}


ROLES = {"reference": reference, "source": source, "target": target}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hsnap_testing.migration")
    p.add_argument("role", choices=sorted(ROLES))
    p.add_argument("--spec", required=True, help="JSON file: the run's parameters")
    p.add_argument("--result", required=True)
    a = p.parse_args(argv)
    with open(a.spec) as f:
        spec = json.load(f)
    _write_json(a.result, ROLES[a.role](spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

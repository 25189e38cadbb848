"""A live SGLang ``Req`` and its :class:`hsnap_format.RequestRecord`, both ways: the checks every request must pass
to continue (the field table's refusals and SGLang's own checks of a fresh request), ``Req`` -> record
(:func:`req_record`), record -> the checked carried values (:func:`decode_carried`) and a ``Req`` built by SGLang's
constructor (:func:`rebuild_req`)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from array import array
from typing import Any, Mapping

import numpy as np

from hsnap_format import HsnapError, HsnapIOError, MalformedHeaderError, RequestRecord
from hsnap_format.errors import Phrase

from hsnap_io.sglang_env import import_sglang

from ..detokenize import sglang_form
from .fields import CARRIED, ENGINE_VERSION, FORMAT, FORMAT_KEY, REFUSED, TABLES, sglang_attributes, unclassified
from .values import MAX_PLAIN, TOKEN_ID_LIMIT, Bounds, InvalidValue, component_type, json_text, short_repr, unpack


class UnsupportedRequestError(HsnapError):
    """The request holds state hsnap cannot carry (refused before anything is written)."""


# ----------------------------------------------------------------------------- codecs


def _json_default(o):
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if isinstance(o, (array, tuple)):
        return list(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.generic):
        return o.item()
    if hasattr(o, "__struct_fields__"):  # a msgspec struct (kv_hints): its builtins
        import msgspec

        return msgspec.to_builtins(o)
    raise TypeError(f"{type(o).__name__} is not JSON data")


def _encode(codec: str, value, where: str, path=None):
    try:
        if codec == "plain":
            if not _plain_ok(value):
                raise TypeError(f"{type(value).__name__} {value!r} is not a JSON scalar")
            return value
        if codec == "ints":
            return None if value is None else [int(x) for x in value]
        if codec == "intset":
            return None if value is None else sorted(int(x) for x in value)
        if codec == "json":
            return json.dumps(value, default=_json_default, ensure_ascii=False, sort_keys=True, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise UnsupportedRequestError(path, where, f"a value hsnap can carry ({codec})", f"{e}") from None
    raise AssertionError(codec)


def decode_carried(record: RequestRecord, path, *, swa_start: int) -> dict[str, dict[str, Any]]:
    """Class -> {attribute: typed value} of every carried extra in ``record`` (keys
    ``sglang.<Class>.<attr>``), each checked by its table row's ``value`` against the
    record's own counts — the one place where a record's extras are checked, before
    anything is built or allocated. Refusals are :class:`MalformedHeaderError` naming
    ``request.extra.<key>``. Absent keys are left out (SGLang's constructor defaults)."""
    extra = record.extra
    bounds = Bounds(len(record.prompt_ids), len(record.output_ids), int(record.state_position), int(swa_start), None)
    vocab = _carried_value(extra, "Req", "vocab_size", bounds, path)  # the bound of every carried token id
    bounds = dataclasses.replace(bounds, vocab=vocab if vocab is not _ABSENT else None)
    out: dict[str, dict[str, Any]] = {}
    for cls in ("Req", "ReqKvInfo", "ReqLogprob"):
        values = out[cls] = {}
        for name, f in TABLES[cls].items():
            if f.disposition == CARRIED and f.codec != "record":
                v = _carried_value(extra, cls, name, bounds, path)
                if v is not _ABSENT:
                    values[name] = v
    rq = out["Req"]
    if rq.get("surr_offset") is not None and rq.get("read_offset") is not None and rq["read_offset"] < rq["surr_offset"]:
        raise MalformedHeaderError(path, "request.extra.sglang.Req.read_offset", Phrase(f">= surr_offset ({rq['surr_offset']})"), rq["read_offset"])
    sent = rq.get("send_decode_id_offset")
    if sent is not None:  # within surr_and_decode_ids as resume re-derives it
        decode_ids = (len(record.prompt_ids) - rq["surr_offset"] + rq.get("cur_decode_ids_len", 0)) if rq.get("surr_offset") is not None else 0
        if sent > decode_ids:
            raise MalformedHeaderError(path, "request.extra.sglang.Req.send_decode_id_offset",
                                       Phrase(f"<= len(prompt[surr_offset:]) + cur_decode_ids_len ({decode_ids})"), sent)
    return out


_ABSENT = object()


def _carried_value(extra: Mapping[str, Any], cls: str, name: str, bounds: Bounds, path):
    key = f"sglang.{cls}.{name}"
    if key not in extra:
        return _ABSENT
    f = TABLES[cls][name]
    try:
        v = f.value(unpack(f.codec, extra[key]), bounds)
    except InvalidValue as e:
        raise MalformedHeaderError(path, f"request.extra.{key}", e.expected, e.found) from None
    return set(v) if f.codec == "intset" and v is not None else v


def _plain_ok(v) -> bool:
    if v is None or isinstance(v, (bool, str)):
        return True
    if isinstance(v, int):
        return abs(v) <= MAX_PLAIN
    if isinstance(v, float):
        return math.isfinite(v)
    return False


# ----------------------------------------------------------------------------- sampling params


def _sampling_to_record(sp, path=None) -> dict[str, Any]:
    """SamplingParams -> the record's flat ``sampling`` map. Values that are not JSON
    scalars (sets, dicts, structs, seeds past 2**53, infinities) are JSON strings of
    their msgspec builtins, named in ``__json__`` so decoding is unambiguous. (Not
    msgspec.json: it writes an infinite logit bias as null.)"""
    import msgspec

    out: dict[str, Any] = {}
    encoded = []
    for name in sp.__struct_fields__:
        v = getattr(sp, name)
        if _plain_ok(v) or (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            out[name] = v
            continue
        try:
            out[name] = json.dumps(msgspec.to_builtins(v), allow_nan=True, ensure_ascii=False, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise UnsupportedRequestError(path, f"SamplingParams.{name}", "JSON data", f"{short_repr(v)} ({e})") from None
        encoded.append(name)
    out["__json__"] = encoded
    return out


def sampling_from_record(d: Mapping[str, Any], path):
    """The record's ``sampling`` map -> SamplingParams, each field converted to its declared
    type (JSON texts bounded first); the values are checked afterwards, on the rebuilt Req,
    by :func:`_check_request` (SGLang's own verify)."""
    import_sglang()
    import typing

    import msgspec
    from sglang.srt.sampling.sampling_params import SamplingParams

    hints = typing.get_type_hints(SamplingParams)
    fields = SamplingParams.__struct_fields__
    encoded = d.get("__json__", [])
    if type(encoded) is not list or not all(type(n) is str and n in fields for n in encoded):
        raise MalformedHeaderError(path, "request.sampling.__json__", Phrase("a list of SamplingParams field names"), encoded)
    kwargs = {}
    for name in fields:
        if name not in d:
            raise MalformedHeaderError(path, f"request.sampling.{name}", "present (written by snapshot_req)", Phrase("missing"))
        v = d[name]
        try:
            kwargs[name] = msgspec.convert(json_text(v) if name in encoded else v, hints[name])
        except InvalidValue as e:
            raise MalformedHeaderError(path, f"request.sampling.{name}", e.expected, e.found) from None
        except (msgspec.ValidationError, TypeError, ValueError) as e:
            raise MalformedHeaderError(path, f"request.sampling.{name}", Phrase(str(hints[name]).replace("typing.", "")), Phrase(f"{short_repr(v)} ({e})")) from None
    try:  # is_normalized=True makes __post_init__ keep the normalized values as they are
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as e:  # __post_init__ of a record that says it is not normalized
        raise MalformedHeaderError(path, "request.sampling", Phrase("SamplingParams SGLang builds"), Phrase(short_repr(str(e), 160))) from None


def check_stop_agrees(record: RequestRecord, sp, path) -> None:
    """The record's typed ``stop`` fields and the SamplingParams carried in ``sampling``
    describe the same budget and stop conditions (snapshot_req writes both from one object)."""
    stop_strs = sp.stop_strs if isinstance(sp.stop_strs, list) else ([sp.stop_strs] if sp.stop_strs else [])
    pairs = [
        ("max_new_tokens", record.max_new_tokens, sp.max_new_tokens),
        ("min_new_tokens", record.min_new_tokens, sp.min_new_tokens),
        ("ignore_eos", record.ignore_eos, sp.ignore_eos),
        ("stop_token_ids", sorted(record.stop_token_ids), sorted(sp.stop_token_ids or ())),
        ("stop_strings", list(record.stop_strings), list(stop_strs)),
    ]
    for name, typed, carried in pairs:
        if typed != carried:
            raise MalformedHeaderError(path, f"request.stop.{name}", Phrase(f"the value of request.sampling ({short_repr(carried)})"), typed)


# ----------------------------------------------------------------------------- checks shared by snapshot and resume


def _check_request(req, tokenizer, refuse) -> None:
    """What a request must pass to continue: hsnap's refusals of state it cannot carry (the
    table) and every check SGLang runs on a fresh request (SamplingParams.normalize and
    verify(vocab_size) as its tokenizer manager runs them, token ids below vocab_size, one
    selected logprob per output token). Runs on the source ``Req`` before a snapshot is
    written and on the rebuilt ``Req`` before a resume allocates. ``refuse(field,
    expected, found, detail=None)`` makes the exception; fields are ``Class.attr``."""
    attrs = sglang_attributes(req)
    for cls, values in attrs.items():
        for name, f in TABLES[cls].items():
            if f.disposition == REFUSED and name in values and not f.ok(values[name]):
                raise refuse(f"{cls}.{name}", f.neutral, short_repr(values[name]), detail=f.why)
    vocab = req.vocab_size
    if type(vocab) is not int or not 1 <= vocab <= TOKEN_ID_LIMIT:
        raise refuse("Req.vocab_size", Phrase(f"the model's vocabulary size, 1..{TOKEN_ID_LIMIT}"), vocab)
    n_out = len(req.output_ids)
    checks = [
        ("Req.output_ids", "at least one output token (a decoding request)", n_out, n_out >= 1),
        ("Req.origin_input_ids_unpadded", "equal to origin_input_ids (no multimodal padding)", "different", list(req.origin_input_ids_unpadded) == list(req.origin_input_ids)),
        ("Req.extra_key", f"ending with lora_id {req.lora_id!r}", req.extra_key, req.lora_id is None or (req.extra_key or "").endswith(req.lora_id)),
    ]
    for fld, exp, found, ok in checks:
        if not ok:
            raise refuse(fld, exp, found)
    _check_ids(req.origin_input_ids, "Req.origin_input_ids", vocab, refuse)
    _check_ids(req.output_ids, "Req.output_ids", vocab, refuse)
    _check_sampling(req.sampling_params, vocab, tokenizer, refuse)
    lp = req.logprob
    if req.return_logprob:
        if lp.output_token_logprobs_val is None or len(lp.output_token_logprobs_val) != n_out:
            raise refuse("ReqLogprob.output_token_logprobs_val", f"{n_out} entries (one per output token)", None if lp.output_token_logprobs_val is None else len(lp.output_token_logprobs_val))
        k = lp.top_logprobs_num
        if k > 0:
            for name in ("output_top_logprobs_val", "output_top_logprobs_idx"):
                rows = getattr(lp, name)
                if rows is None or len(rows) != n_out or any(len(r) != k for r in rows):
                    raise refuse(f"ReqLogprob.{name}", f"{n_out} rows of {k}", short_repr(rows))
            _check_ids(lp.output_top_logprobs_idx, "ReqLogprob.output_top_logprobs_idx", vocab, refuse)


def _check_ids(values, field: str, vocab: int, refuse) -> None:
    """Token ids in 0..vocab-1, checked before any cast (an id of 2**31 must be reported as
    itself, with its index, not as the int32 it would wrap to)."""
    expected = Phrase(f"token ids in 0..{vocab - 1} (vocab_size {vocab})")
    a = np.asarray(values)
    if a.size and a.dtype.kind in "iu":
        bad = np.flatnonzero((a < 0) | (a >= vocab))
        if bad.size:
            at = np.unravel_index(int(bad[0]), a.shape)
            raise refuse(field + "".join(f"[{int(i)}]" for i in at), expected, int(a[at]))
    elif a.size:  # ints past int64, floats, other objects: one by one
        for at in np.ndindex(a.shape):
            t = a[at]
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
                found = (int(t) if int(t).bit_length() <= 256 else Phrase(f"an integer of {int(t).bit_length()} bits")) if isinstance(t, (int, np.integer)) else short_repr(t)
                raise refuse(field + "".join(f"[{int(i)}]" for i in at), expected, found)


_INT64 = (-(2**63), 2**63 - 1)


def _check_sampling(sp, vocab: int, tokenizer, refuse) -> None:
    """SamplingParams as SGLang's tokenizer manager admits a fresh request: normalized,
    ``normalize(tokenizer)`` raises nothing (stop counts and lengths, the tokenizer the
    stop conditions need), ``verify(vocab_size)`` raises nothing; every integer fits int64."""
    from sglang.srt.sampling.sampling_params import raise_if_tokenizer_required
    from sglang.srt.sampling.watermarking.core import normalize_watermark_request

    if sp.is_normalized is not True:
        raise refuse("SamplingParams.is_normalized", True, sp.is_normalized, detail="SamplingParams.normalize has run (SGLang's tokenizer manager runs it on every request)")
    for name in sp.__struct_fields__:
        v = getattr(sp, name)
        if type(v) is int and not _INT64[0] <= v <= _INT64[1]:
            raise refuse(f"SamplingParams.{name}", Phrase("an integer that fits int64"), v)
    if tokenizer is None:  # SGLang's own rule: these need tokenizer.decode / its eos id
        for name, args in (("stop_strs", (sp.stop_strs, None, 0)), ("stop_regex_strs", (None, sp.stop_regex_strs, 0)), ("min_new_tokens", (None, None, sp.min_new_tokens))):
            try:
                raise_if_tokenizer_required(None, *args)
            except ValueError:
                raise refuse("Req.tokenizer", Phrase(f"a tokenizer (SamplingParams.{name} needs one)"), None) from None
    for step, run in (("normalize", lambda p: p.normalize(tokenizer)), ("verify", lambda p: p.verify(vocab)),
                      ("watermark", lambda p: normalize_watermark_request(p.watermark))):
        probe = copy.copy(sp)  # normalize() rewrites fields: checked on a copy, the carried values stay
        try:
            run(probe)
        except (ValueError, TypeError, OverflowError) as e:
            raise refuse(_sampling_field(str(e)), Phrase(f"a value SGLang's SamplingParams.{step} accepts"), Phrase(short_repr(str(e), 160))) from None


# SGLang refusals that do not start with the field they are about
_SAMPLING_MESSAGES = {"reasoning end token": "custom_params", "stop strings are allowed": "stop_strs", "stop_regex": "stop_regex_strs",
                      "watermark": "watermark"}


def _sampling_field(message: str) -> str:
    """The SamplingParams field an SGLang refusal is about ("top_p must be in (0, 1]...")."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    first = re.match(r"[A-Za-z_]*", message).group()
    if first in SamplingParams.__struct_fields__:
        return f"SamplingParams.{first}"
    return next((f"SamplingParams.{name}" for text, name in _SAMPLING_MESSAGES.items() if text in message), "SamplingParams")


# ----------------------------------------------------------------------------- snapshot


def check_req(req, *, path=None) -> None:
    """Refuse a request hsnap cannot carry, naming the field. Reads only."""
    missing = unclassified(req)
    if missing:
        raise UnsupportedRequestError(path, missing[0], f"an attribute classified in hsnap_sglang.req.fields.TABLES (SGLang {ENGINE_VERSION})", "unclassified")

    def refuse(field, expected, found, detail=None):
        return UnsupportedRequestError(path, field, expected, found, detail=detail)

    _check_request(req, req.tokenizer, refuse)
    kv = req.kv
    evicted_outside_swa = {component_type()(c).name: n for c, n in kv.component_evicted_seqlens.items() if n and component_type()(c) != component_type().SWA}
    checks = [
        ("ReqKvInfo.req_pool_idx", "a req_to_token row (the request holds KV)", kv.req_pool_idx, kv.req_pool_idx is not None),
        ("ReqKvInfo.kv_committed_len", f"seqlen - 1 = {req.seqlen - 1} (a committed decode boundary)", kv.kv_committed_len, kv.kv_committed_len == req.seqlen - 1),
        (
            "ReqKvInfo.kv_allocated_len",
            f"kv_committed_len = {kv.kv_committed_len} (no speculative draft tokens or decode step in flight)",
            kv.kv_allocated_len,
            kv.kv_allocated_len == kv.kv_committed_len,
        ),
        ("ReqKvInfo.component_evicted_seqlens", "no evicted positions outside SWA (hsnap restores SWA eviction only)", evicted_outside_swa, not evicted_outside_swa),
    ]
    for fld, exp, found, ok in checks:
        if not ok:
            raise UnsupportedRequestError(path, fld, exp, found)


def _f32(values, where: str, path) -> np.ndarray:
    """float values as float32, refusing any that float32 would round (SGLang's
    logprobs are float32 tensors turned into Python floats, so they never are)."""
    a64 = np.asarray(values, dtype=np.float64)
    a32 = a64.astype(np.float32)
    same = (a32.astype(np.float64) == a64) | (np.isnan(a64) & np.isnan(a32))
    if not same.all():
        i = np.unravel_index(int(np.argmin(same)), same.shape)
        raise UnsupportedRequestError(path, where, "float32 values (as SGLang computes logprobs)", f"{a64[i]!r} at {tuple(int(x) for x in i)}")
    return a32


def req_record(req, *, path=None) -> tuple[RequestRecord, int]:
    """The request record of ``req`` and its SWA start (positions without SWA rows)."""
    import_sglang()
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    check_req(req, path=path)  # token ids in 0..vocab_size-1 (<= 2**31) before the int32 casts below
    attrs = sglang_attributes(req)
    if "Req" in attrs:  # a resumed request's anchored detokenizer fields: SGLang's own form (detokenize.sglang_form)
        attrs["Req"].update({k: v for k, v in sglang_form(req).items() if k in attrs["Req"]})
    sp, lp, kv = req.sampling_params, req.logprob, req.kv
    extra: dict[str, Any] = {FORMAT_KEY: FORMAT}
    for cls, values in attrs.items():
        if cls == "SamplingParams":
            continue
        for name, f in TABLES[cls].items():
            if f.disposition == CARRIED and f.codec != "record" and name in values:
                value = values[name]
                if name == "component_evicted_seqlens":
                    value = {ComponentType(c).name: int(n) for c, n in value.items()}
                extra[f"sglang.{cls}.{name}"] = _encode(f.codec, value, f"{cls}.{name}", path)
    outputs = {}
    if req.return_logprob:
        outputs["output_logprobs"] = _f32(lp.output_token_logprobs_val, "ReqLogprob.output_token_logprobs_val", path)
        if lp.top_logprobs_num > 0:
            outputs["top_logprob_values"] = _f32(lp.output_top_logprobs_val, "ReqLogprob.output_top_logprobs_val", path)
            outputs["top_logprob_ids"] = np.asarray(lp.output_top_logprobs_idx, dtype=np.int64).astype(np.int32)
    stop_strs = sp.stop_strs if isinstance(sp.stop_strs, list) else ([sp.stop_strs] if sp.stop_strs else [])
    record = RequestRecord(
        rid=req.rid,
        prompt_ids=np.asarray(req.origin_input_ids, dtype=np.int64).astype(np.int32),
        output_ids=np.asarray(req.output_ids, dtype=np.int64).astype(np.int32),
        state_position=int(kv.kv_committed_len),
        sampling=_sampling_to_record(sp, path),
        max_new_tokens=sp.max_new_tokens,
        min_new_tokens=int(sp.min_new_tokens or 0),
        stop_strings=tuple(stop_strs),
        stop_token_ids=tuple(sorted(sp.stop_token_ids or ())),
        ignore_eos=bool(sp.ignore_eos),
        streamed_tokens=int(req.send_token_offset),
        streamed_text_chars=len(req.decoded_text or ""),
        reasoning_tokens=int(req.reasoning_tokens),
        reasoning_finished=bool(req._is_reasoning_over),
        rng_state=None,  # SGLang 0.5.23 has no per-request generator (docs/sglang.md)
        extra=extra,
        **outputs,
    )
    swa_start = int(kv.get_evicted_seqlen(ComponentType.SWA))
    record.validate(path)
    return record, swa_start


# ----------------------------------------------------------------------------- record -> Req

# Record fields of a Req attribute that is not carried in record.extra (refusal messages at resume)
_RECORD_FIELDS = {
    "Req.origin_input_ids": "request.prompt_ids",
    "Req.origin_input_ids_unpadded": "request.prompt_ids",
    "Req.output_ids": "request.output_ids",
    "ReqLogprob.output_token_logprobs_val": "request.output_logprobs",
    "ReqLogprob.output_top_logprobs_val": "request.top_logprob_values",
    "ReqLogprob.output_top_logprobs_idx": "request.top_logprob_ids",
    "SamplingParams": "request.sampling",
}


def _record_field(field: str) -> str:
    """``Class.attr[i]`` of the rebuilt Req -> where the record holds it."""
    base, bracket, rest = field.partition("[")
    cls, _, attr = base.partition(".")
    where = _RECORD_FIELDS.get(base) or (f"request.sampling.{attr}" if cls == "SamplingParams" else f"request.extra.sglang.{base}")
    return where + bracket + rest


def read_record(snap, path) -> RequestRecord:
    """The record of the open file, every section hashed as it is read (what is returned is
    what was hashed), and its cross-field rules."""
    try:
        record = snap.record()
    except OSError as e:
        raise HsnapIOError(snap.path, "read", e) from None
    record.validate(snap.path)
    return record


# Req constructor arguments resume passes from the carried values (the rest are set after it)
_CONSTRUCTOR_ARGS = ("return_logprob", "sampling_logprobs_mode", "return_flat_raw_top_logprobs", "stream", "lora_id", "require_reasoning",
                     "eos_token_ids", "vocab_size", "priority", "routing_key", "cache_salt", "bootstrap_host", "bootstrap_port",
                     "bootstrap_room", "disagg_prefill_dp_rank", "kv_hints")


def rebuild_req(record: RequestRecord, carried, sp, *, tokenizer, http_worker_ipc, req_kwargs):
    """A Req from SGLang's constructor holding the record's request (no slots yet)."""
    from sglang.srt.managers.schedule_batch import Req

    rq, lpx = carried["Req"], carried["ReqLogprob"]
    req = Req(
        record.rid,
        "",  # origin_input_text: the constructor does not keep it
        array("q", record.prompt_ids.tolist()),
        sp,
        top_logprobs_num=lpx.get("top_logprobs_num", 0),
        token_ids_logprob=lpx.get("token_ids_logprob"),
        http_worker_ipc=http_worker_ipc,
        **{name: rq[name] for name in _CONSTRUCTOR_ARGS if name in rq},
        **req_kwargs,
    )
    for name, value in rq.items():  # after the constructor: extra_key is stored, not re-concatenated
        setattr(req, name, value)
    req.output_ids = array("q", record.output_ids.tolist())
    req.send_token_offset = record.streamed_tokens
    req.reasoning_tokens = record.reasoning_tokens
    req._is_reasoning_over = record.reasoning_finished
    req.tokenizer = tokenizer
    for name, value in lpx.items():
        setattr(req.logprob, name, value)
    if req.return_logprob and record.output_logprobs is not None:  # absent: refused by _check_request
        req.logprob.output_token_logprobs_val = record.output_logprobs.tolist()
        if record.top_logprob_values is not None:
            req.logprob.output_top_logprobs_val = record.top_logprob_values.tolist()
            req.logprob.output_top_logprobs_idx = record.top_logprob_ids.tolist()
    if req.surr_offset is not None and "cur_decode_ids_len" in rq:
        req.surr_and_decode_ids = req.origin_input_ids_unpadded[req.surr_offset :] + req.output_ids[: rq["cur_decode_ids_len"]]
    return req


def check_resumed(req, tokenizer, path) -> None:
    """:func:`_check_request` on the rebuilt Req, refusals naming the record field."""

    def refuse(field, expected, found, detail=None):
        if field == "Req.tokenizer":  # the target lacks what the request needs: not the file's fault
            return HsnapError(path, "resume_req(tokenizer=...)", expected, found, detail=detail)
        return MalformedHeaderError(path, _record_field(field), expected, found, detail=detail or "refused for a fresh request too")

    _check_request(req, tokenizer, refuse)

"""The text of a request at a hand-off: what its client had, and how the target's detokenizer goes on from there.

SGLang's ``DetokenizerManager`` turns output ids into text incrementally: text whose last character is complete is
*committed*; while the newest tokens end inside a character (an incomplete UTF-8 byte sequence) only their printable
prefix is sent and is *pending* — sent, not committed — until a later token completes it.  Its state per request is
a window of ids (context from ``surr``, new text from ``read``), the committed text and the pending characters.
A hand-off that ignores it is visibly wrong around a character split by the pause (CJK text, emoji, byte-fallback
tokens): the source's finishing message flushes the incomplete bytes as U+FFFD, and a target that re-anchors on the
last few tokens loses the character the next token completes.  Three parts make the text of a resumed request the
text of an uninterrupted one, event by event:

* **the source** (detokenizer process, :func:`around_decode_batch_token_id_output`): the message that ends an
  exported request's stream is decoded as a streaming step — the client's text ends where an uninterrupted stream's
  text was at that token, nothing flushed;
* **the target's HTTP process**: :func:`replay` runs SGLang's own algorithm over the snapshot's prompt and output ids
  (one token per message, as the scheduler streams them) to find that text, the window and the pending characters;
  the client's state is seeded with the text, and the first ``pending`` characters of the target detokenizer's first
  output for the request are dropped (:func:`around_handle_batch_output`: the client has them already — an
  uninterrupted detokenizer skips them the same way);
* **the target's scheduler** (:func:`anchor_detokenizer`): the request's detokenization window is the one
  :func:`replay` found, so each later step decodes the ids an uninterrupted stream decodes.

The replay assumes what SGLang does by default: one output token per message (``--stream-interval 1``, no stop string
whose prefix holds output back).  With a larger interval or a held-back stop-string prefix the source grouped tokens
otherwise, and the text around the pause can differ from the uninterrupted stream's by where a pending character was
cut (tokens and the final ids never differ).  Its cost is two small decodes per output token, off the event loop:
~54 ms at 4,096 output tokens with the tiny model's tokenizer here (a 32k-token output ~0.4 s before the restore).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Sequence

from .client import HAND_OFF

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class HandoffText:
    """A request's text state after its last output token, as an uninterrupted detokenizer holds it."""

    text: str  # what the client had: the committed text and the printable part of what is pending
    surr: int  # the detokenizer's window, as positions in prompt + output ids: context from here,
    read: int  # new text from here
    pending: int  # characters at the end of ``text`` sent but not committed


def initial_window(prompt_len: int) -> tuple[int, int]:
    """SGLang's first window for a request (``Req.init_incremental_detokenize``): the last few prompt tokens as
    context, new text from the first output."""
    from sglang.srt.managers.schedule_batch import INIT_INCREMENTAL_DETOKENIZATION_OFFSET

    return max(prompt_len - INIT_INCREMENTAL_DETOKENIZATION_OFFSET, 0), prompt_len


def replay(tokenizer, prompt: Sequence[int], outputs: Sequence[int], *, skip_special_tokens: bool = True,
           spaces_between_special_tokens: bool = True, batch_decode: bool | None = None) -> HandoffText:
    """The detokenizer's state after ``outputs``, computed by SGLang's own incremental algorithm
    (``DetokenizerManager._decode_batch_token_id_output``) fed one token per message, decoding as this server's
    detokenizer does (``batch_decode``: not ``--disable-tokenizer-batch-decode``; None: this process's serving
    settings, else batched).  Without a tokenizer (a server started with ``--skip-tokenizer-init``) there is no
    text: an empty state at SGLang's first window."""
    surr0, read0 = initial_window(len(prompt))
    if tokenizer is None or not outputs:
        return HandoffText("", surr0, read0, 0)
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager

    d = DetokenizerManager.__new__(DetokenizerManager)  # its decoding state and methods only: no sockets
    if batch_decode is None:
        batch_decode = not _serving_disables_batch_decode()
    d.tokenizer, d.decode_status, d.disable_tokenizer_batch_decode = tokenizer, {}, not batch_decode
    d.is_tool_call_parser_gpt_oss, d.tool_close_token_ids = False, ()
    try:
        d.vocab_size = len(tokenizer)
    except TypeError:
        d.vocab_size = getattr(tokenizer, "vocab_size", None)
    rid = "hsnap-replay"
    pieces = []
    for ids in [list(prompt[surr0:]) + [outputs[0]]] + [[t] for t in outputs[1:]]:
        msg = SimpleNamespace(rids=[rid], decoded_texts=[""], decode_ids=[ids], read_offsets=[read0 - surr0], finished_reasons=[None],
                              no_stop_trim=[False], skip_special_tokens=[skip_special_tokens],
                              spaces_between_special_tokens=[spaces_between_special_tokens])
        pieces.append(d._decode_batch_token_id_output(msg)[0])
    s = d.decode_status[rid]
    return HandoffText("".join(pieces), surr0 + s.surr_offset, surr0 + s.read_offset, s.sent_offset - s.decoded_text_len)


def _serving_disables_batch_decode() -> bool:
    try:
        from sglang.srt.runtime_context import get_serving

        return bool(get_serving().disable_tokenizer_batch_decode)
    except Exception:  # noqa: BLE001 - outside a server (a library call, a test): SGLang's default
        return False


def replay_info(tokenizer, info: dict) -> HandoffText:
    """:func:`replay` of a snapshot's request (``req.read_resume_info``'s dict)."""
    sp = info["sampling"]
    return replay(tokenizer, info["prompt_ids"], info["output_ids"], skip_special_tokens=bool(sp.get("skip_special_tokens", True)),
                  spaces_between_special_tokens=bool(sp.get("spaces_between_special_tokens", True)))


def around_decode_batch_token_id_output(original, detokenizer, recv_obj, *args, **kwargs):
    """AROUND ``DetokenizerManager._decode_batch_token_id_output`` (the source's detokenizer process): a request
    whose stream ends because it was exported is decoded as a streaming step, so its client's text ends where an
    uninterrupted stream's was (no U+FFFD for a character the next token completes); its state is then dropped, as
    SGLang drops a finished request's."""
    reasons = recv_obj.finished_reasons
    try:
        exported = [i for i, r in enumerate(reasons) if isinstance(r, dict) and r.get("type") == HAND_OFF]
    except Exception:  # noqa: BLE001 - hsnap may fail, the detokenizer may not
        exported = []
    if not exported:
        return original(detokenizer, recv_obj, *args, **kwargs)
    saved = {i: reasons[i] for i in exported}
    for i in exported:
        reasons[i] = None
    try:
        return original(detokenizer, recv_obj, *args, **kwargs)
    finally:
        for i, reason in saved.items():
            reasons[i] = reason
            detokenizer.decode_status.pop(recv_obj.rids[i], None)


def around_handle_batch_output(original, tm, recv_obj, *args, **kwargs):
    """AROUND ``TokenizerManager._handle_batch_output`` (the target's HTTP process): the first output of a resumed
    request loses the characters its client already had as pending text (:class:`HandoffText`.pending)."""
    fe = getattr(tm, "_hsnap", None)
    skips = getattr(fe, "text_skip", None)
    if skips:
        try:
            drop_pending(skips, recv_obj)
        except Exception:  # noqa: BLE001 - hsnap may fail, the server may not
            logger.exception("hsnap: trimming a resumed request's first output")
    return original(tm, recv_obj, *args, **kwargs)


def drop_pending(skips: dict[str, int], recv_obj) -> None:
    """Drop ``skips[rid]`` characters from the start of ``rid``'s text in this output batch — its first since the
    resume, whatever it holds (an uninterrupted detokenizer skips them in that message alone) — and forget ``rid``."""
    strs = getattr(recv_obj, "output_strs", None)
    if strs is None:
        return
    for i, rid in enumerate(recv_obj.rids):
        n = skips.pop(rid, 0)
        if n and strs[i] is not None:
            strs[i] = strs[i][n:]


def anchor_detokenizer(req, window: list[int] | None) -> None:
    """A fresh detokenizer (the target's) learns a request at its first output message: ``decode_ids`` from
    ``send_decode_id_offset`` on, the first ``read_offset - surr_offset`` of them as context only.  Give it the window
    an uninterrupted detokenizer has after the committed tokens (``window`` = [surr, read] as positions in prompt +
    output ids, :func:`replay`), so that it decodes the same ids at every later step; without one (an
    older HTTP process), SGLang's first-window number of last tokens as context."""
    from sglang.srt.managers.schedule_batch import INIT_INCREMENTAL_DETOKENIZATION_OFFSET

    history = list(req.origin_input_ids_unpadded) + list(req.output_ids)
    prompt = len(req.origin_input_ids_unpadded)
    if window is not None and len(window) == 2 and 0 <= int(window[0]) <= int(window[1]) <= len(history):
        surr, read = int(window[0]), int(window[1])
    else:
        n = max(1, min(INIT_INCREMENTAL_DETOKENIZATION_OFFSET, prompt, len(history)))
        surr, read = len(history) - n, len(history)
    req.surr_and_decode_ids = history[surr:]
    req.cur_decode_ids_len = len(req.output_ids)
    req.surr_offset, req.read_offset = surr, read  # SGLang sends read - surr as the context length (see sglang_form)
    req.send_decode_id_offset = 0
    req.send_token_offset = len(req.output_ids)  # the client has every output token up to the snapshot
    req.send_output_token_logprobs_offset = len(req.output_ids)
    req.decoded_text = ""


def sglang_form(req) -> dict:
    """The detokenizer fields of ``req`` as SGLang itself holds them: for a request :func:`anchor_detokenizer`
    anchored (its offsets are not SGLang's first window in the prompt), those of a request never handed off, every
    id sent so far — what its snapshot records, in the ranges a record's reader checks, since every resume anchors
    anew; for any other request, nothing to change ({})."""
    prompt, outputs = len(req.origin_input_ids_unpadded), len(req.output_ids)
    surr, read = initial_window(prompt)
    if req.surr_offset is None or req.read_offset is None or (req.surr_offset, req.read_offset) == (surr, read):
        return {}
    return {"surr_offset": surr, "read_offset": read, "cur_decode_ids_len": outputs,
            "send_decode_id_offset": read - surr + min(int(req.send_token_offset), outputs), "decoded_text": ""}


__all__ = ["HandoffText", "anchor_detokenizer", "sglang_form", "initial_window", "replay", "replay_info", "around_decode_batch_token_id_output",
           "around_handle_batch_output", "drop_pending"]

"""The text of a resumed request, event by event, against an uninterrupted stream: SGLang's own detokenizer
algorithm (``DetokenizerManager._decode_batch_token_id_output``) in three roles — the uninterrupted reference, the
source whose stream ends with the export, the fresh target — with hsnap's hooks (hsnap_sglang.detokenize) where the
server runs them, over random byte-level BPE ids (characters split across tokens, U+FFFD-worthy byte runs) paused
after every token.  No server: the messages are built as SGLang's scheduler builds them."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from hsnap_io.sglang_env import import_sglang, sglang_available  # noqa: E402

if not sglang_available():
    pytest.skip("SGLang is not installed (scripts/bootstrap installs it)", allow_module_level=True)
import_sglang()

from sglang.srt.managers.detokenizer_manager import DetokenizerManager  # noqa: E402

from hsnap_sglang import client, detokenize  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import PreTrainedTokenizerFast

    from hsnap_sglang.tiny import build_tokenizer

    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(512))


def fresh(tokenizer) -> DetokenizerManager:
    d = DetokenizerManager.__new__(DetokenizerManager)
    d.tokenizer, d.decode_status, d.disable_tokenizer_batch_decode = tokenizer, {}, False
    d.is_tool_call_parser_gpt_oss, d.tool_close_token_ids = False, ()
    d.vocab_size = len(tokenizer)
    return d


def message(ids, read: int, finished=None):
    return SimpleNamespace(rids=["r"], decoded_texts=[""], decode_ids=[list(ids)], read_offsets=[read], finished_reasons=[finished],
                           no_stop_trim=[False], skip_special_tokens=[True], spaces_between_special_tokens=[True])


class Req:
    """The fields of SGLang's ``Req`` its output streamer reads for the detokenizer (init_incremental_detokenize)."""

    def __init__(self, prompt, outputs):
        self.origin_input_ids_unpadded, self.output_ids = list(prompt), list(outputs)
        self.surr_offset = self.read_offset = None
        self.send_decode_id_offset = 0

    def next_message(self, finished=None):
        from sglang.srt.managers.schedule_batch import Req as SGLangReq

        self.output_ids_through_stop = self.output_ids
        ids, read = SGLangReq.init_incremental_detokenize(self)  # SGLang's own code on these fields
        out = message(ids[self.send_decode_id_offset:], read, finished)
        self.send_decode_id_offset = len(ids)
        return out


def stream(d, req: Req, outputs, text: str, *, hook=None, skips=None, finish=None) -> list[str]:
    """Feed ``outputs`` one per message (the last with ``finish``); the client's text after each."""
    texts = []
    for j, t in enumerate(outputs):
        req.output_ids.append(t)
        msg = req.next_message(finish if j == len(outputs) - 1 else None)
        if hook is not None:
            strs = hook(lambda det, m: det._decode_batch_token_id_output(m), d, msg)
        else:
            strs = d._decode_batch_token_id_output(msg)
        out = SimpleNamespace(rids=["r"], output_strs=list(strs))
        if skips is not None:
            detokenize.drop_pending(skips, out)
        text += out.output_strs[0]
        texts.append(text)
    return texts


def handed_off(tokenizer, prompt, outputs, k: int) -> tuple[list[str], list[str]]:
    """The client's text through the source (k outputs, the last message ending the stream with the export) and
    then through the target."""
    export = {"type": client.HAND_OFF, "path": "x.hsnap"}
    src = stream(fresh(tokenizer), Req(prompt, []), outputs[:k], "", hook=detokenize.around_decode_batch_token_id_output, finish=export)
    handoff = detokenize.replay(tokenizer, prompt, outputs[:k])
    req = Req(prompt, outputs[:k])
    detokenize.anchor_detokenizer(req, [handoff.surr, handoff.read])
    skips = {"r": handoff.pending} if handoff.pending else {}
    tgt = stream(fresh(tokenizer), req, outputs[k:], handoff.text, skips=skips, finish={"type": "length", "length": len(outputs)})
    assert handoff.text == src[-1]  # what the target seeds the client's state with is what the source sent
    return src, tgt


def test_every_pause_point_continues_the_uninterrupted_text_event_by_event(tokenizer):
    rng = random.Random(7)
    cases = 0
    for _ in range(60):
        prompt = [rng.randrange(3, 512) for _ in range(rng.randrange(1, 12))]
        outputs = [rng.randrange(3, 512) for _ in range(rng.randrange(2, 24))]
        ref = stream(fresh(tokenizer), Req(prompt, []), outputs, "", finish={"type": "length", "length": len(outputs)})
        for k in range(1, len(outputs)):
            src, tgt = handed_off(tokenizer, prompt, outputs, k)
            assert src + tgt == ref, (prompt, outputs, k)
            cases += 1
    assert cases > 300


@pytest.fixture(scope="module")
def accents():
    """A byte-level BPE whose one merge is " " + the lead byte of "é"/"è"/"ê"/"ë" (real vocabularies have many such
    tokens): a token that ends inside a character after a space, so a paused stream holds pending text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator([" é è ê ë"], trainer=trainers.BpeTrainer(vocab_size=len(alphabet) + 1, initial_alphabet=alphabet,
                                                                        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_pending_text_at_the_pause_is_sent_once(accents):
    v = accents.get_vocab()
    assert "ĠÃ" in v
    alphabet = [v[t] for t in ("ĠÃ", "Ã", "©", "¨", "a", "Ġ", "b")]
    rng = random.Random(3)
    pending = 0
    for _ in range(150):
        prompt = [rng.choice(alphabet) for _ in range(rng.randrange(1, 6))]
        outputs = [rng.choice(alphabet) for _ in range(rng.randrange(2, 14))]
        ref = stream(fresh(accents), Req(prompt, []), outputs, "", finish={"type": "length", "length": len(outputs)})
        for k in range(1, len(outputs)):
            pending += detokenize.replay(accents, prompt, outputs[:k]).pending > 0
            src, tgt = handed_off(accents, prompt, outputs, k)
            assert src + tgt == ref, (prompt, outputs, k)
    assert pending > 50  # the case this test is for happened


def test_a_character_split_by_the_pause_reaches_the_client_once_and_whole(tokenizer):
    """The pause falls between the two byte tokens of one character: the source's last event has no U+FFFD, the
    target's first event completes the character."""
    ids = tokenizer.encode("ab", add_special_tokens=False)
    vocab = tokenizer.get_vocab()
    first, second = vocab.get("Ã"), vocab.get("©")  # byte-level spellings of 0xC3 and 0xA9: "é" in two tokens
    if first is None or second is None:
        pytest.skip("the tiny tokenizer has no single-byte tokens for 0xC3 / 0xA9")
    outputs = [*ids, first, second, *ids]
    src, tgt = handed_off(tokenizer, ids, outputs, len(ids) + 1)
    assert "\ufffd" not in src[-1] and tgt[-1] == src[-1] + "é" + "ab"


def test_without_the_hooks_the_split_character_is_lost(tokenizer):
    """What the hooks fix (the control): SGLang's finishing flush sends U+FFFD and a target anchored on the last
    tokens never sends the character."""
    ids = tokenizer.encode("ab", add_special_tokens=False)
    vocab = tokenizer.get_vocab()
    first, second = vocab.get("Ã"), vocab.get("©")
    if first is None or second is None:
        pytest.skip("the tiny tokenizer has no single-byte tokens for 0xC3 / 0xA9")
    src = stream(fresh(tokenizer), Req(ids, []), [*ids, first], "", finish={"type": client.HAND_OFF})
    assert src[-1].endswith("\ufffd")


def test_replay_without_a_tokenizer_is_an_empty_text_at_sglangs_first_window():
    h = detokenize.replay(None, list(range(3, 12)), [5, 6])
    assert (h.text, h.surr, h.read, h.pending) == ("", 4, 9, 0)


def test_an_out_of_range_window_falls_back_to_the_last_tokens():
    req = Req([3, 4, 5, 6, 7, 8], [9, 10])
    detokenize.anchor_detokenizer(req, [2, 99])
    assert req.surr_and_decode_ids == [6, 7, 8, 9, 10] and req.read_offset - req.surr_offset == 5


def test_an_anchored_request_records_sglangs_own_detokenizer_fields():
    """A resumed request's window lies past its prompt; its snapshot records SGLang's first window instead (every resume
    anchors anew), within the ranges a record's reader checks; a request never handed off records its own."""
    req = Req(list(range(3, 9)), [20, 21, 22])
    req.send_token_offset = 3
    assert detokenize.sglang_form(req) == {}  # never streamed: nothing set, nothing to change
    req.next_message()
    assert detokenize.sglang_form(req) == {}  # SGLang's own first window
    detokenize.anchor_detokenizer(req, [7, 9])
    form = detokenize.sglang_form(req)
    assert form == {"surr_offset": 1, "read_offset": 6, "cur_decode_ids_len": 3, "send_decode_id_offset": 8, "decoded_text": ""}
    assert form["send_decode_id_offset"] <= len(req.origin_input_ids_unpadded) - form["surr_offset"] + form["cur_decode_ids_len"]

"""Optional token text: a ``tokenizer.json`` read with the ``tokenizers`` library,
offline only (a file, a directory holding one, or a Hugging Face repo id already
in the local cache). Never imports torch or transformers.

Without ``--tokenizer`` the model path a snapshot records is tried when it is a local
file or directory (not the cache: that import would cost every first frame), and the
Request tab says where its token text comes from, or how to get some."""

from __future__ import annotations

import os
from typing import Callable

Decoder = Callable[[int], str]


class TokenizerUnavailable(Exception):
    pass


def _tokenizer_file(spec: str) -> str:
    if os.path.isfile(spec):
        return spec
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "tokenizer.json")):
        return os.path.join(spec, "tokenizer.json")
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        raise TokenizerUnavailable(f"{spec}: not a tokenizer.json file or directory") from None
    try:
        found = try_to_load_from_cache(spec, "tokenizer.json")
    except Exception:  # HFValidationError for a path that is not a repo id (/nonexistent)
        found = None
    if isinstance(found, str):
        return found
    raise TokenizerUnavailable(f"{spec}: no such tokenizer.json file or directory, and not a repo id in the local "
                               "Hugging Face cache (offline)")


def load_decoder(spec: str) -> Decoder:
    """A function token id -> text, or :class:`TokenizerUnavailable`."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizerUnavailable("the 'tokenizers' package is not installed") from None
    path = _tokenizer_file(spec)
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises its own Exception type
        raise TokenizerUnavailable(f"{spec}: {e}") from None

    def decode(token_id: int) -> str:
        return tok.decode([int(token_id)], skip_special_tokens=False)

    return decode


def recorded_model_decoder(model_id: str) -> tuple[Decoder | None, str]:
    """(decoder, what the Request tab says about token text) for a viewer given no
    ``--tokenizer``: the tokenizer of the model path the snapshot records when that path
    exists here and holds one, else None and a hint naming the flag."""
    if model_id and os.path.exists(model_id):
        try:
            return load_decoder(model_id), f"from the model path this snapshot records ({model_id})"
        except TokenizerUnavailable as e:
            return None, f"none: {e}; give --tokenizer (a tokenizer.json, its directory or a cached repo id)"
    example = f", e.g. {model_id}" if model_id else ""
    return None, f"none: give --tokenizer (a tokenizer.json, its directory or a cached repo id{example})"

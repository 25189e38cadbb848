"""What the zygote (:mod:`hsnap_testing.zygote`) imports once for all its children: torch, SGLang's memory-pool
modules (through hsnap's CPU-safe import), hsnap's library packages, and what the migration driver's children use
(transformers' tokenizer, xgrammar's backend, hsnap's ``Req`` edge)."""

from __future__ import annotations

import torch  # noqa: F401
import torch.distributed  # noqa: F401

import hsnap_format  # noqa: F401
import hsnap_io  # noqa: F401
from hsnap_io.sglang_env import import_sglang
from hsnap_testing import pools  # noqa: F401

import_sglang()

from hsnap_testing import migration, model  # noqa: E402, F401
from hsnap_sglang import req  # noqa: E402, F401
from sglang.srt.constrained import xgrammar_backend  # noqa: E402, F401
from transformers import PreTrainedTokenizerFast  # noqa: E402, F401

"""A tiny random-weight hybrid model directory that SGLang and transformers both load, built locally (no hub).

``build_model_dir(path)`` writes ``config.json`` + ``model.safetensors`` (transformers' ``from_config`` with a
fixed seed; the tiny geometry of :func:`tiny_config`: 4 layers, GDN + full attention every
2nd layer, with a 40960-token context; Qwen3-Next and Qwen3.5-MoE with a small MoE, Qwen3.5 dense; both Qwen3.5
with their constant-initialised parameters perturbed) + ``generation_config.json`` + a byte-level BPE tokenizer trained here with
``tokenizers`` on a fixed, generated corpus (``tokenizer.json``, ``tokenizer_config.json``) + ``hsnap_tiny.json``
(the recipe and a digest of every file).  The same recipe gives the same bytes; an existing directory with the
same recipe is reused.

    python -m hsnap_sglang.tiny DIR [--arch qwen3_next|qwen3_5|qwen3_5_moe] [--seed 0]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["ARCHS", "RECIPE_FILE", "SPECIAL_TOKENS", "build_model_dir", "build_tokenizer", "corpus", "load_reference_model", "tiny_config"]

ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
RECIPE_FILE = "hsnap_tiny.json"
RECIPE_VERSION = 1
MAX_POSITIONS = 40960  # room for the 32k-token measurements; no weight depends on it
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_ARCHITECTURES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = (
    "the a an of to in on for with from by about over under after before between into through during without "
    "model request state token cache layer attention memory slot server client stream decode prefill snapshot "
    "resume pause export import page block prefix history position output input value key query head weight "
    "hybrid linear recurrent convolution gate norm expert router batch queue scheduler worker process file "
    "write read verify digest bytes manifest rank shard tensor pool allocator free busy ready done start stop "
    "river mountain garden window morning evening winter summer music paper letter story number question answer "
    "quick brown fox jumps lazy dog small large fast slow bright quiet warm cold green blue red white black old "
    "is are was were be has have had do does did can could will would should may might must not and or but so "
    "one two three four five six seven eight nine ten first second last next every each some many few more"
).split()


# The tiny configuration (see shared/research/continuation-on-cpu.md).  linear_key_head_dim (16) differs from
# linear_value_head_dim (32) so that the Dk / Dv axes of the recurrent state cannot be confused silently.
_TINY_COMMON: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    full_attention_interval=2,
    max_position_embeddings=512,
)
_TINY_MOE: dict[str, Any] = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
)


def tiny_config(arch: str = "qwen3_5", *, attn_implementation: str = "eager", **overrides: Any):
    """The tiny transformers config for ``arch`` (``"qwen3_5"`` or ``"qwen3_next"``)."""
    kw = dict(_TINY_COMMON)
    if arch == "qwen3_5":
        from transformers.models.qwen3_5 import Qwen3_5TextConfig as cfg_cls
    elif arch == "qwen3_next":
        from transformers.models.qwen3_next import Qwen3NextConfig as cfg_cls

        kw.update(_TINY_MOE)
    else:
        raise ValueError(f"unknown arch {arch!r}; expected 'qwen3_5' or 'qwen3_next'")
    kw.update(overrides)
    cfg = cfg_cls(**kw)
    # Pin the attention implementation: the same kernels must run in the reference and in a resumed process.
    cfg._attn_implementation = attn_implementation
    return cfg


def corpus(seed: int = 0, sentences: int = 3000) -> list[str]:
    """A fixed English-like training corpus (seeded word salad, digits and punctuation)."""
    rng = random.Random(seed)
    lines = []
    for i in range(sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if i % 7 == 0:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        text = " ".join(words)
        lines.append(text[0].upper() + text[1:] + rng.choice(".!?,;:") )
    return lines


def build_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``vocab_size`` entries (special tokens included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    return tok


def _moe_config(**overrides):
    """Qwen3.5-MoE (the family of the project's reference model, Qwen3.5-35B-A3B): the tiny dense Qwen3.5 with the
    tiny Qwen3-Next's experts in place of its MLP."""
    import inspect

    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    dense, moe = tiny_config("qwen3_5", **overrides).to_dict(), tiny_config("qwen3_next")
    accepted = set(inspect.signature(Qwen3_5MoeTextConfig.__init__).parameters)
    kw = {k: v for k, v in dense.items() if k in accepted}
    kw.update({k: getattr(moe, k) for k in _MOE_FIELDS})
    cfg = Qwen3_5MoeTextConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def _config(arch: str):
    if arch == "qwen3_5_moe":
        cfg = _moe_config(max_position_embeddings=MAX_POSITIONS)
    else:
        cfg = tiny_config(arch, max_position_embeddings=MAX_POSITIONS)
    cfg.architectures = [_ARCHITECTURES[arch]]
    cfg.bos_token_id = None
    cfg.eos_token_id = 0  # <|endoftext|>
    cfg.pad_token_id = 0
    cfg.tie_word_embeddings = False
    return cfg


def _add_sglang_config_keys(config_json: Path, cfg) -> None:
    """transformers 5.x saves ``layer_types`` only; SGLang 0.5.23's Qwen3-Next config derives the layer kinds from
    ``full_attention_interval``: write it too (checked consistent with ``layer_types``)."""
    data = json.loads(config_json.read_text())
    interval = list(data["layer_types"]).index("full_attention") + 1
    expected = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(cfg.num_hidden_layers)]
    if list(data["layer_types"]) != expected:
        raise ValueError(f"{config_json}: layer_types {data['layer_types']} do not follow full_attention_interval={interval}")
    data["full_attention_interval"] = interval
    config_json.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _file_digests(path: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.iterdir())
        if p.is_file() and p.name != RECIPE_FILE
    }


# arch -> std of the noise added to parameters that transformers initialises to a constant (norm weights, dt_bias),
# so that a comparison against transformers sees every parameter (a zero Gemma-style norm weight would hide a
# swapped q/k norm or a missing "1 +").  Qwen3-Next's recipe predates it and keeps its bytes.
CONSTANT_PARAM_NOISE = {"qwen3_5": 0.1, "qwen3_5_moe": 0.1}


def _recipe(arch: str, seed: int) -> dict:
    import tokenizers
    import torch
    import transformers

    recipe = {
        "recipe_version": RECIPE_VERSION, "arch": arch, "seed": seed, "weights_dtype": "float32",
        "torch": torch.__version__.split("+")[0], "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }
    if arch in CONSTANT_PARAM_NOISE:
        recipe["constant_param_noise"] = CONSTANT_PARAM_NOISE[arch]
    return recipe


def _perturb_constant_params(model, std: float, seed: int) -> list[str]:
    """Add N(0, std) noise (seeded) to every parameter whose elements are all equal; returns their names."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    names = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.numel() > 1 and bool((param == param.reshape(-1)[0]).all()):
                param.add_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * std)
                names.append(name)
    return names


def _existing(path: Path, recipe: dict) -> bool:
    try:
        meta = json.loads((path / RECIPE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("recipe") == recipe and meta.get("files") == _file_digests(path)


def build_model_dir(path: str | os.PathLike, *, arch: str = "qwen3_next", seed: int = 0) -> Path:
    """Build (or reuse) the tiny model directory at ``path``; returns it.

    Written in a temporary sibling and renamed into place, so ``path`` is either complete or absent.  An existing
    directory is reused only when its recorded recipe and file digests match; any other content is an error.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {ARCHS}, found {arch!r}")
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    recipe = _recipe(arch, seed)
    if path.exists():
        if _existing(path, recipe):
            return path
        raise FileExistsError(f"{path}: exists and is not a tiny model built with recipe {recipe}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        cfg = _config(arch)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        if arch in CONSTANT_PARAM_NOISE:
            _perturb_constant_params(model, CONSTANT_PARAM_NOISE[arch], seed + 1)
        model.eval()
        model.generation_config.eos_token_id = cfg.eos_token_id
        model.generation_config.pad_token_id = cfg.pad_token_id
        model.generation_config.bos_token_id = None
        model.save_pretrained(tmp, safe_serialization=True)
        _add_sglang_config_keys(tmp / "config.json", cfg)

        fast = PreTrainedTokenizerFast(
            tokenizer_object=build_tokenizer(cfg.vocab_size, seed),
            eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[0], unk_token=None,
            additional_special_tokens=list(SPECIAL_TOKENS[1:]), chat_template=_CHAT_TEMPLATE,
            model_max_length=cfg.max_position_embeddings,
        )
        fast.save_pretrained(tmp)
        (tmp / RECIPE_FILE).write_text(json.dumps({"recipe": recipe, "files": _file_digests(tmp)}, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def load_reference_model(path: str | os.PathLike, dtype=None):
    """transformers' own (pure-torch) model on the directory's weights, eval mode, eager attention."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, attn_implementation="eager")
    return model.eval().requires_grad_(False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hsnap_sglang.tiny", description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("--arch", choices=ARCHS, default="qwen3_next")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(build_model_dir(a.path, arch=a.arch, seed=a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

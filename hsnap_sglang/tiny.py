"""A tiny random-weight hybrid model directory that SGLang and transformers both load, built locally (no hub).

``build_model_dir(path)`` writes ``config.json`` + ``model.safetensors`` (transformers' ``from_config`` with a
fixed seed; the tiny geometry of :func:`tiny_config`: 4 layers, GDN + full attention every
2nd layer, with a 40960-token context; Qwen3-Next and Qwen3.5-MoE with a small MoE, Qwen3.5 dense; both Qwen3.5
with their constant-initialised parameters perturbed) + ``generation_config.json`` + a byte-level BPE tokenizer trained here with
``tokenizers`` on a fixed, generated corpus (``tokenizer.json``, ``tokenizer_config.json``) + ``hsnap_tiny.json``
(the recipe and a digest of every file).  The same recipe gives the same bytes; an existing directory with the
same recipe is reused.

    python -m hsnap_sglang.tiny DIR [--arch qwen3_next|qwen3_5|qwen3_5_moe|nemotron_h|falcon_h1|granitemoehybrid|lfm2] [--seed 0]
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

ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h", "falcon_h1", "granitemoehybrid", "lfm2")
MAMBA2_ARCHS = ("nemotron_h", "falcon_h1", "granitemoehybrid")  # Mamba2 (SSD) hybrids: MambaMixer2 in SGLang
RECIPE_FILE = "hsnap_tiny.json"
RECIPE_VERSION = 1
MAX_POSITIONS = 40960  # room for the 32k-token measurements; no weight depends on it
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_ARCHITECTURES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
                  "nemotron_h": "NemotronHForCausalLM", "falcon_h1": "FalconH1ForCausalLM",
                  "granitemoehybrid": "GraniteMoeHybridForCausalLM", "lfm2": "Lfm2ForCausalLM"}
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


# The tiny Mamba2 geometry: 8 SSM heads of 16 channels in 2 groups (n_groups < heads, so the group -> head
# broadcast is exercised), state size 32 (unlike the head dim, so the P / N axes of the state cannot be confused
# silently), conv kernel 4, and a chunk of 16 tokens so that the test prompts span several SSD chunks.
_TINY_MAMBA2: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
    mamba_num_heads=8,
    mamba_head_dim=16,
    ssm_state_size=32,
    n_groups=2,
    conv_kernel=4,
    chunk_size=16,
)
# NemotronH: Mamba2, attention, Mamba2, MLP ("M*M-" in NemotronH's pattern letters)
_NEMOTRON_H_LAYERS = ["linear_attention", "full_attention", "linear_attention", "mlp"]


def _nemotron_h_config(**overrides):
    from transformers.models.nemotron_h import NemotronHConfig

    kw = dict(_TINY_MAMBA2, layers_block_type=list(_NEMOTRON_H_LAYERS), mlp_hidden_act="relu2")
    kw.update(overrides)
    cfg = NemotronHConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def _falcon_h1_config(**overrides):
    """FalconH1: attention and Mamba2 side by side in every layer, then an MLP; 3 layers, with the muP multipliers
    away from 1 so that each is exercised.  ``mamba_norm_before_gate=False``: SGLang 0.5.23's ``Mixer2RMSNormGated``
    always gates before it normalises (it has no other mode); transformers follows the flag."""
    from transformers.models.falcon_h1 import FalconH1Config

    t = _TINY_MAMBA2
    kw = dict(
        vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
        num_hidden_layers=3, num_attention_heads=t["num_attention_heads"], num_key_value_heads=t["num_key_value_heads"],
        head_dim=t["head_dim"], mamba_d_ssm=t["mamba_num_heads"] * t["mamba_head_dim"], mamba_n_heads=t["mamba_num_heads"],
        mamba_d_head=t["mamba_head_dim"], mamba_n_groups=t["n_groups"], mamba_d_state=t["ssm_state_size"],
        mamba_d_conv=t["conv_kernel"], mamba_chunk_size=t["chunk_size"], mamba_rms_norm=True,
        mamba_norm_before_gate=False, lm_head_multiplier=0.5, embedding_multiplier=2.0, mlp_multipliers=[0.5, 2.0],
        key_multiplier=0.75, attention_out_multiplier=0.8, attention_in_multiplier=1.25,
        ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 2.0], ssm_in_multiplier=1.5, ssm_out_multiplier=0.6,
    )
    kw.update(overrides)
    cfg = FalconH1Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def _granitemoehybrid_config(**overrides):
    """GraniteMoeHybrid: Mamba2, attention (with rotary embeddings), Mamba2, each followed by a small MoE (4 experts,
    2 per token) and a shared expert, with Granite's multipliers away from 1.  One SSM group (n_groups = 1 < 8
    heads): transformers 5.19's ``GraniteMoeHybridRMSNormGated`` normalises over the whole SSM width while SGLang
    0.5.23's ``Mixer2RMSNormGated`` normalises per group, so the two models agree only for one group (as the
    published Granite 4.0 checkpoints have); FalconH1 carries the two-group geometry."""
    from transformers.models.granitemoehybrid import GraniteMoeHybridConfig

    t = _TINY_MAMBA2
    kw = dict(
        vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
        num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], num_attention_heads=t["num_attention_heads"],
        num_key_value_heads=t["num_key_value_heads"], mamba_n_heads=t["mamba_num_heads"], mamba_d_head=t["mamba_head_dim"],
        mamba_n_groups=1, mamba_d_state=t["ssm_state_size"], mamba_d_conv=t["conv_kernel"],
        mamba_chunk_size=t["chunk_size"], mamba_expand=t["mamba_num_heads"] * t["mamba_head_dim"] // t["hidden_size"],
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64, position_embedding_type="rope",
        embedding_multiplier=2.0, logits_scaling=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
    )
    kw.update(overrides)
    cfg = GraniteMoeHybridConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def _lfm2_config(**overrides):
    """LFM2 (Liquid's short-conv hybrid): short conv, attention, short conv, short conv, each followed by a SwiGLU
    MLP.  The gated depthwise conv has a 3-token kernel (``conv_L_cache``: a conv state of 2 tokens per layer and no
    recurrent state).  ``block_auto_adjust_ff_dim=False`` keeps the MLP width at ``intermediate_size`` in both."""
    from transformers.models.lfm2 import Lfm2Config

    t = _TINY_MAMBA2
    kw = dict(
        vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
        num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "conv"],
        num_attention_heads=t["num_attention_heads"], num_key_value_heads=t["num_key_value_heads"], conv_L_cache=3,
        block_auto_adjust_ff_dim=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    kw.update(overrides)
    cfg = Lfm2Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


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
    elif arch == "nemotron_h":
        cfg = _nemotron_h_config(max_position_embeddings=MAX_POSITIONS)
    elif arch == "falcon_h1":
        cfg = _falcon_h1_config(max_position_embeddings=MAX_POSITIONS)
    elif arch == "granitemoehybrid":
        cfg = _granitemoehybrid_config(max_position_embeddings=MAX_POSITIONS)
    elif arch == "lfm2":
        cfg = _lfm2_config(max_position_embeddings=MAX_POSITIONS)
    else:
        cfg = tiny_config(arch, max_position_embeddings=MAX_POSITIONS)
    cfg.architectures = [_ARCHITECTURES[arch]]
    cfg.bos_token_id = None
    cfg.eos_token_id = 0  # <|endoftext|>
    cfg.pad_token_id = 0
    cfg.tie_word_embeddings = False
    return cfg


def _add_sglang_config_keys(config_json: Path, cfg, arch: str = "qwen3_next") -> None:
    """transformers 5.x saves ``layer_types`` only; SGLang 0.5.23's Qwen3-Next config derives the layer kinds from
    ``full_attention_interval``: write it too (checked consistent with ``layer_types``).  For the Mamba2 hybrids see
    :func:`_mamba2_sglang_keys`.  LFM2: SGLang's config class subclasses transformers' own and reads the same keys."""
    if arch == "lfm2":
        return
    data = json.loads(config_json.read_text())
    if arch in MAMBA2_ARCHS:
        _mamba2_sglang_keys(data, cfg, arch)
        config_json.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        return
    interval = list(data["layer_types"]).index("full_attention") + 1
    expected = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(cfg.num_hidden_layers)]
    if list(data["layer_types"]) != expected:
        raise ValueError(f"{config_json}: layer_types {data['layer_types']} do not follow full_attention_interval={interval}")
    data["full_attention_interval"] = interval
    config_json.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _mamba2_sglang_keys(data: dict, cfg, arch: str) -> None:
    """One config.json both read with the same geometry.  NemotronH: transformers 5.x writes
    ``layers_block_type`` with its new layer names (``linear_attention`` / ``full_attention``), which SGLang 0.5.23's
    ``NemotronHConfig`` refuses (it knows ``mamba`` / ``attention`` / ``mlp`` / ``moe``): the layers are written as
    ``hybrid_override_pattern`` instead, which both read (transformers converts it back to the same list), and the
    Mamba keys under SGLang's names too (``mamba_n_groups``, ``mamba_d_conv``, ``mamba_chunk_size``; transformers
    reads those as aliases of its own).  FalconH1: both read the same keys.  GraniteMoeHybrid: SGLang maps the new
    layer names itself, and reads the rotary base from ``rope_theta``."""
    if arch == "nemotron_h":
        data["hybrid_override_pattern"] = cfg.hybrid_override_pattern
        data.pop("layers_block_type", None)
        data["mtp_hybrid_override_pattern"] = cfg.mtp_hybrid_override_pattern
        data.pop("mtp_layers_block_type", None)
        data["mamba_n_groups"] = cfg.n_groups
        data["mamba_d_conv"] = cfg.conv_kernel
        data["mamba_chunk_size"] = cfg.chunk_size
    elif arch == "granitemoehybrid":
        data["rope_theta"] = cfg.rope_parameters["rope_theta"]  # SGLang's config reads rope_theta, not rope_parameters


def _file_digests(path: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.iterdir())
        if p.is_file() and p.name != RECIPE_FILE
    }


# arch -> std of the noise added to parameters that transformers initialises to a constant (norm weights, dt_bias),
# so that a comparison against transformers sees every parameter (a zero Gemma-style norm weight would hide a
# swapped q/k norm or a missing "1 +").  Qwen3-Next's recipe predates it and keeps its bytes.
CONSTANT_PARAM_NOISE = {"qwen3_5": 0.1, "qwen3_5_moe": 0.1, "nemotron_h": 0.1, "falcon_h1": 0.1, "granitemoehybrid": 0.1,
                        "lfm2": 0.1}


def _recipe(arch: str, seed: int) -> dict:
    from importlib.metadata import version  # the installed versions, without importing the packages (seconds)

    recipe = {
        "recipe_version": RECIPE_VERSION, "arch": arch, "seed": seed, "weights_dtype": "float32",
        "torch": version("torch").split("+")[0], "transformers": version("transformers"),
        "tokenizers": version("tokenizers"),
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


def _align_dt_floor(cfg) -> None:
    """transformers' pure-torch Mamba2 clamps the discretised time step at ``time_step_min`` (``time_step_limit =
    (config.time_step_min, inf)`` in NemotronH's mixer); SGLang 0.5.23's ``MambaMixer2`` clamps it at 0
    (``dt_limit=(0.0, inf)``, hard-coded) and not at all in decode.  The weights' dt_bias are drawn from
    ``time_step_min`` (so some time steps fall below it): the saved config says 0 after the draw, so that both
    models compute the same function.  (FalconH1's mixer clamps at ``config.time_step_limit``, (0, inf).)"""
    cfg.time_step_min = 0.0


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
    path = Path(path)
    recipe = _recipe(arch, seed)
    if path.exists():
        if _existing(path, recipe):
            return path
        raise FileExistsError(f"{path}: exists and is not a tiny model built with recipe {recipe}")
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        cfg = _config(arch)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        if arch in CONSTANT_PARAM_NOISE:
            _perturb_constant_params(model, CONSTANT_PARAM_NOISE[arch], seed + 1)
        if arch == "nemotron_h":
            _align_dt_floor(model.config)
        model.eval()
        model.generation_config.eos_token_id = cfg.eos_token_id
        model.generation_config.pad_token_id = cfg.pad_token_id
        model.generation_config.bos_token_id = None
        model.save_pretrained(tmp, safe_serialization=True)
        _add_sglang_config_keys(tmp / "config.json", cfg, arch)

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

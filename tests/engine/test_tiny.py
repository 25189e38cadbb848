"""The tiny hybrid model directory (hsnap_sglang.tiny): built locally, the same bytes for the same recipe, reused
only when it is exactly what the recipe builds, loadable by transformers with a working tokenizer."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from hsnap_sglang.tiny import RECIPE_FILE, build_model_dir  # noqa: E402


def test_same_recipe_same_bytes_and_reuse(tmp_path):
    a = build_model_dir(tmp_path / "a")
    b = build_model_dir(tmp_path / "b")
    meta_a, meta_b = json.loads((a / RECIPE_FILE).read_text()), json.loads((b / RECIPE_FILE).read_text())
    assert meta_a == meta_b and "model.safetensors" in meta_a["files"] and "tokenizer.json" in meta_a["files"]
    assert build_model_dir(a) == a  # reused as is
    config = json.loads((a / "config.json").read_text())
    assert config["model_type"] == "qwen3_next" and config["full_attention_interval"] == 2
    assert config["layer_types"] == ["linear_attention", "full_attention"] * 2


def test_a_changed_directory_is_refused_not_reused(tmp_path):
    path = build_model_dir(tmp_path / "m")
    (path / "config.json").write_text((path / "config.json").read_text().replace('"hidden_size": 128', '"hidden_size": 64'))
    with pytest.raises(FileExistsError, match="not a tiny model built with recipe"):
        build_model_dir(path)
    with pytest.raises(FileExistsError):
        build_model_dir(tmp_path)  # any other existing content: refused too


def test_tokenizer_round_trips_and_fits_the_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    path = build_model_dir(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(path)
    text = "The quick brown fox jumps over the lazy dog 2026!"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text and max(ids) < 512 and len(tok) == 512
    assert tok.eos_token_id == 0


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_recipes_leave_no_parameter_constant(tmp_path, arch):
    # a Gemma-style norm weight of 0 (transformers' init) would let a swapped q/k norm or a missing "1 +" pass the
    # comparison against transformers (test_server_families.py): the recipe perturbs every constant parameter
    from safetensors.torch import load_file

    from hsnap_sglang.tiny import CONSTANT_PARAM_NOISE

    path = build_model_dir(tmp_path / arch, arch=arch)
    recipe = json.loads((path / RECIPE_FILE).read_text())["recipe"]
    assert recipe["arch"] == arch and recipe["constant_param_noise"] == CONSTANT_PARAM_NOISE[arch]
    weights = load_file(path / "model.safetensors")
    constant = [n for n, t in weights.items() if t.numel() > 1 and bool((t == t.reshape(-1)[0]).all())]
    assert constant == [] and any("q_norm" in n for n in weights) and any("dt_bias" in n for n in weights)

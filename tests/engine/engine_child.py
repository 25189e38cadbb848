"""Run by test_engine.py in a fresh process: ``sglang.Engine`` on hsnap's CPU platform, greedy generations, JSON out.

    python engine_child.py MODEL_DIR OUT_JSON
"""

import json
import os
import sys
import time

T0 = time.monotonic()
os.environ["HSNAP_SGLANG_CPU"] = "1"

from hsnap_sglang.cpu import activate  # noqa: E402

activate()  # before SGLang is imported (torch may already be: the finder goes in either way)

import sglang  # noqa: E402

from hsnap_sglang.serve import engine_kwargs, use_start_method  # noqa: E402

use_start_method("fork")  # as hsnap_sglang.serve: the scheduler starts from this process's imports, not a fresh interpreter

PROMPT_IDS = [54, 74, 71, 401, 503, 270, 464, 223, 76, 478, 318, 285, 320, 71, 307, 465, 431, 16] * 4
OTHERS = [PROMPT_IDS[::-1][:50], PROMPT_IDS[5:12]]
NEW = 16


def _tokens(out):
    pairs = out["meta_info"]["output_token_logprobs"]
    return [p[1] for p in pairs], [p[0] for p in pairs]


def main():
    model_dir, out_path = sys.argv[1], sys.argv[2]
    engine = sglang.Engine(**engine_kwargs(
        model_path=model_dir, disable_radix_cache=True, disable_overlap_schedule=True, skip_server_warmup=True,
        max_total_tokens=4096, max_mamba_cache_size=8, max_running_requests=4, grammar_backend="none",
        log_level="warning", random_seed=0,
    ))
    ready_s = time.monotonic() - T0
    sp = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    try:
        t = time.monotonic()
        first = engine.generate(input_ids=PROMPT_IDS, sampling_params=sp, return_logprob=True, top_logprobs_num=512)
        single_s = time.monotonic() - t
        second = engine.generate(input_ids=PROMPT_IDS, sampling_params=sp, return_logprob=True, top_logprobs_num=512)
        t = time.monotonic()
        batch = engine.generate(input_ids=[OTHERS[0], PROMPT_IDS, OTHERS[1]],
                                sampling_params=[dict(sp, max_new_tokens=NEW + 8), sp, dict(sp, max_new_tokens=NEW - 8)],
                                return_logprob=True)
        batch_s = time.monotonic() - t
    finally:
        engine.shutdown()
    result = {
        "ready_s": ready_s, "single_tok_per_s": NEW / single_s, "batch_tok_per_s": (3 * NEW) / batch_s,
        "runs": [_tokens(first), _tokens(second), _tokens(batch[1])],
        "top": first["meta_info"]["output_top_logprobs"], "prompt_ids": PROMPT_IDS,
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()

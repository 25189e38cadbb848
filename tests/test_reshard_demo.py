"""The re-sharded continuation (issue 12): the demo model's paused request exported as a TP 2
set — two rank files split the way a TP 2 engine holds the state — and restored at TP 1
continues exactly: tokens equal, max |Δlogprob| 0, no history position recomputed.
(In-process and short; ``hsnap demo --reshard 2:1`` runs the same in three processes.)"""

from __future__ import annotations

from types import SimpleNamespace

import hsnap_format as hf


def test_tp2_set_resumed_at_tp1_continues_exactly(tmp_path):
    from hsnap_io.demo import reshard_demo
    from hsnap_io.demo.children import Demo
    from hsnap_io.demo.run import PROMPT

    demo = Demo("qwen3_5", 0, 1)
    n, k = 20, 6
    ref = demo.dec.generate(PROMPT, n, temperature=0.0)
    args = SimpleNamespace(prompt=PROMPT, n=n, k=k, set=str(tmp_path / "req.tp2"), reshard_src=2)
    exp = reshard_demo.child_export(demo, args)
    with hf.open_snapshot(args.set) as s:
        assert s.manifest.tp_size == 2
        heads = [s.ranks[r].geometry.attention.heads for r in range(2)]
        assert heads == [1, 1]  # two KV heads, one per rank, as SGLang holds them at TP 2
        assert [s.ranks[r].geometry.sharding.conv[0].parts[2][0] for r in range(2)] == [64, 128]  # v channels
    res = reshard_demo.child_resume(demo, args)
    assert exp["token_ids"] == ref.token_ids[:k]
    assert res["token_ids"] == ref.token_ids
    assert max(abs(a - b) for a, b in zip(res["logprobs"], ref.logprobs)) == 0.0
    assert res["history_positions_recomputed"] == 0
    assert res["positions_forwarded"] == n - k
    assert res["source_ranks"] == [0, 1] and res["source_bytes_read"] == res["bytes_uploaded"]


def test_reshard_option_refuses_splits_the_model_cannot_make(tmp_path, capsys):
    from hsnap_io.demo.run import main

    assert main(["--reshard", "4:1", "--out", str(tmp_path / "x.hsnap")]) == 2
    assert "--reshard supports 2:1" in capsys.readouterr().err
    assert main(["--reshard", "two", "--out", str(tmp_path / "x.hsnap")]) == 2

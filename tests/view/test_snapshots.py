"""SVG snapshots (pytest-textual-snapshot) at a fixed size: no clock, no ETA, no
temp paths (fixtures are opened by relative name), no blinking cursor.
Regenerate with ``pytest tests/view --snapshot-update`` after reviewing the report."""

from __future__ import annotations

import os

from hsnap_view.app import make_app

SIZE = (120, 36)
CHAIN = os.path.join(os.path.dirname(__file__), "..", "..", "spec", "vectors", "chain-delta-2.hsnap")


async def _settle(pilot) -> None:
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


def test_corrupted_snapshot_digests(in_fixtures, snap_compare):
    """Digest scan finished: one MISMATCH, marked in the tree and the table."""

    async def run_before(pilot):
        await _settle(pilot)
        await pilot.press("3")
        await _settle(pilot)

    assert snap_compare(make_app("hybrid-corrupt.hsnap"), terminal_size=SIZE, run_before=run_before)


def test_section_detail_bf16(in_fixtures, snap_compare):
    """Stats, sample and hex view of a bf16 attention K section."""

    async def run_before(pilot):
        await _settle(pilot)
        pilot.app.screen.select_section("0:attn.2.k")
        await _settle(pilot)

    assert snap_compare(make_app("hybrid.hsnap"), terminal_size=SIZE, run_before=run_before)


def test_diff_mode(in_fixtures, snap_compare):
    """hsnap-view A B: per-section status, max diffs and first differing element."""
    assert snap_compare(make_app("hybrid.hsnap", "hybrid-b.hsnap", verify_on_open=False), terminal_size=SIZE, run_before=_settle)


def test_norm_heatmap_shows_a_zeroed_layer(in_fixtures, snap_compare):
    """Map tab of zeroed.hsnap: mamba.3.temporal is all zero (red 0 cells, ALL ZERO) and
    token 7 of attn.2.v is zero (one red 0 in an otherwise coloured line)."""

    from hsnap_view.widgets.norm_map import NormMapView
    from view_fixtures import ZEROED_ROW, ZEROED_SECTION

    async def run_before(pilot):
        await _settle(pilot)
        await pilot.press("7")
        await _settle(pilot)
        view = pilot.app.screen.query_one(NormMapView)
        rows = {r.name: (g, i) for g in view.groups for i, r in enumerate(view.groups[g].rows)}
        zeroed = view.row_text(*rows[ZEROED_SECTION])
        assert "ALL ZERO" in zeroed and zeroed.count("0") >= 2
        stale = view.row_text(*rows[ZEROED_ROW[0]])
        assert "1 zero" in stale and "ALL ZERO" not in stale
        assert "ZERO" not in view.row_text(*rows["mamba.1.temporal"])

    assert snap_compare(make_app("zeroed.hsnap", verify_on_open=False), terminal_size=SIZE, run_before=run_before)


def test_chain_at_160x48(snap_compare):
    """A delta, verified: the title says which link it is and the rows it holds, the tree
    lists the chain's links (each with its rows, all ✓), Geometry the positions of each
    attention section."""
    assert snap_compare(make_app(CHAIN), terminal_size=(160, 48), run_before=_settle)


def test_chain_at_80x24(snap_compare):
    """The same delta at 80x24: the title breaks between its parts, the Digests tab says
    every link of the chain is proved."""

    async def run_before(pilot):
        await _settle(pilot)
        await pilot.press("3")
        await _settle(pilot)

    assert snap_compare(make_app(CHAIN), terminal_size=(80, 24), run_before=run_before)

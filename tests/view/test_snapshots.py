"""SVG snapshots (pytest-textual-snapshot) at a fixed size: no clock, no ETA, no
temp paths (fixtures are opened by relative name), no blinking cursor.
Regenerate with ``pytest tests/view --snapshot-update`` after reviewing the report."""

from __future__ import annotations

from hsnap_view.app import make_app

SIZE = (120, 36)


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

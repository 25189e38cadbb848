"""hsnap-view on a delta: it opens, verifies, and shows its base."""

from __future__ import annotations

import os

import pytest

from hsnap_view.app import make_app
from hsnap_view.widgets.digest_panel import DigestPanel
from hsnap_view.widgets.identity_panel import identity_rows

SIZE = (130, 40)
VEC = os.path.join(os.path.dirname(__file__), "..", "..", "spec", "vectors")


@pytest.mark.parametrize("name,base", [("chain-delta-2.hsnap", "chain-delta-1.hsnap"), ("chain-tp2-delta-1", "chain-tp2-base")])
async def test_viewer_opens_a_delta_and_shows_its_base(name, base):
    app = make_app(os.path.join(VEC, name))
    async with app.run_test(size=SIZE) as pilot:
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.error is None and not app.warnings
        assert set(app.screen.query_one(DigestPanel).status.values()) == {"ok"}
        await pilot.press("4")  # the Identity tab
        await pilot.pause()
        rows = dict((k, str(v)) for k, v in identity_rows(app.document))
        assert rows["delta of"].startswith(f"{base} at position") and "delta" in rows["features"]

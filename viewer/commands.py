"""Command palette: jump to a layer or a section by typing part of its name."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.content import Content
from textual.markup import escape as escape_markup

from hsnap_format.tools.viewmodel import escape


class SectionCommands(Provider):
    """Hits are "layer 3 · attn.3.k (attention K)"; choosing one opens the section."""

    def _sections(self):
        doc = getattr(self.app, "document", None)
        return [] if doc is None else [(escape(doc.section_label(ref)), ref.key) for ref in doc.refs]

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for label, key in self._sections():
            score = matcher.match(label)
            if score > 0:
                yield Hit(score, matcher.highlight(escape_markup(label)), partial(self.app.jump_to, key), text=label, help="open this section")

    async def discover(self) -> Hits:
        for label, key in self._sections():
            yield DiscoveryHit(Content(label), partial(self.app.jump_to, key), text=label, help="open this section")

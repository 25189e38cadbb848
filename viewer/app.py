"""hsnap-view: the Textual app, its factory and its command line.

    hsnap-view PATH [OTHER] [--against REF] [--tokenizer TOK] [--atol X] [--rtol Y]

PATH (and OTHER, for diff mode) is a rank file or a snapshot directory. PATH alone may
also be a directory of snapshots — what a drain, a checkpointer or a migration writes —
which opens as a listing of its entries, each one opened from there. Snapshots
are read only through hsnap_format's public API, always with pread (a file cut
short under the viewer gives a message, never SIGBUS); no torch, no SGLang.

Every way out gives the terminal back: ``q``, Ctrl-C, SIGTERM, SIGHUP and SIGINT end
the app through Textual's own shutdown (which leaves the alternate screen), and an
error escaping it still resets the terminal before the one-line message.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Callable

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.message import Message
from textual.screen import Screen

from .commands import SectionCommands
from .compat import Reference, load_reference
from hsnap_format.errors import HsnapError
from hsnap_format.stores.s3.client import endpoint_shown
from hsnap_format.stores.s3.options import StorageOptions
from hsnap_format.stores import store_for
from hsnap_format.stores.entries import is_one_snapshot
from hsnap_format.tools.viewmodel import leftover_hint

from .listing import nothing_to_view
from .model import Document, display_name, try_open
from .screens.diff import DiffScreen
from .screens.directory import DirectoryScreen
from .screens.error import ErrorScreen
from .screens.help import HelpScreen
from .screens.loading import LoadingScreen
from .screens.main import MainScreen
from .text import describe_error
from .tokenizer import TokenizerUnavailable, load_decoder, recorded_model_decoder


@dataclass
class ViewConfig:
    path: str
    other: str | None = None
    against: str | None = None
    tokenizer: str | Callable[[int], str] | None = None
    page_size: int = 100
    atol: float = 0.0
    rtol: float = 0.0
    verify_on_open: bool = True


class HsnapViewApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "hsnap-view"
    COMMANDS = App.COMMANDS | {SectionCommands}
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("ctrl+c", "quit", "Quit", show=False),  # a viewer: Ctrl-C leaves, as users expect
        Binding("question_mark,f1", "help", "Help"),
    ]

    def __init__(self, config: ViewConfig) -> None:
        super().__init__()
        self.config = config
        self.document: Document | None = None
        self.other: Document | None = None
        self.directory: str | None = None  # a directory of snapshots: listed, its entries opened from there
        # documents left on the way back to the listing: closed when the app ends (a scan thread of the screen
        # left may still be reading them)
        self.left: list[Document] = []
        self.reference: Reference | None = None
        self.decoder: Callable[[int], str] | None = None
        self.error: tuple[str, BaseException] | None = None  # (display name, error): what stops the app
        self.warnings: list[str] = []  # shown as notifications once running
        self.tokenizer_error: str | None = None
        self.token_text_note: str | None = None  # where token text comes from, or how to get some (Request tab)
        # a snapshot on an object store can keep the app waiting on the network: it opens
        # after the first frame, behind a screen that says so (a local file opens here)
        self.opening = [p for p in (config.path, config.other) if p is not None and not store_for(p).local]
        if not self.opening:
            self._load()

    # -- loading (cheap: headers only; runs before the first frame)
    def _load(self) -> None:
        cfg = self.config
        if cfg.other is None and not is_one_snapshot(cfg.path):
            self._load_directory()
            return
        for attr, path in (("document", cfg.path), ("other", cfg.other)):
            if path is None:
                continue
            doc, err = try_open(path)
            if err is not None:
                self.error = (display_name(path), err)
                return
            setattr(self, attr, doc)
        if cfg.against is not None:
            self.reference = self._reference_for(self.document)
        elif self.other is not None:
            other = self.other.ranks.get(min(self.document.ranks), self.other.first)
            self.reference = Reference(self.other.label, other.identity, other.geometry)
        self._load_tokenizer()
        if not cfg.tokenizer and self.document is not None:
            self.decoder, self.token_text_note = recorded_model_decoder(self.document.first.identity.model_id)

    def _load_directory(self) -> None:
        """A directory of snapshots: anything to list? (headers only; the screen lists it verified)"""
        path = self.config.path
        try:
            nothing = nothing_to_view(path)
        except HsnapError as e:  # it cannot be listed: a store that fails, a directory not readable
            self.error = (display_name(path), e)
            return
        if nothing is not None:
            self.error = (display_name(path), nothing)
            return
        self.directory = path
        self._load_tokenizer()

    def _load_tokenizer(self) -> None:
        """The tokenizer asked for by name (once for every snapshot opened)."""
        tokenizer = self.config.tokenizer
        if callable(tokenizer):
            self.decoder = tokenizer
        elif tokenizer:
            try:
                self.decoder = load_decoder(tokenizer)
            except TokenizerUnavailable as e:
                self.tokenizer_error = str(e)
                self.warnings.append(f"no token text: {e}")

    def _reference_for(self, doc: Document, warnings: list[str] | None = None) -> Reference | None:
        """--against, for the lowest rank of ``doc`` (a failure to load it goes to ``warnings``)."""
        try:
            return load_reference(self.config.against, rank=min(doc.ranks))
        except Exception as e:  # a bad reference is a warning: the snapshot itself is fine
            (self.warnings if warnings is None else warnings).append(f"reference not loaded: {describe_error(e)}")
            return None

    def on_mount(self) -> None:
        if self.opening:
            try:
                options = StorageOptions()  # what the opens use: the environment's endpoint and timeouts
            except HsnapError as e:  # a bad HSNAP_S3_TIMEOUT: nothing to wait for
                self.opening, self.error = [], (display_name(self.config.path), e)
            else:
                self.push_screen(LoadingScreen([display_name(p) for p in self.opening], endpoint_shown(options), options.request_bound_s))
                threading.Thread(target=self._load_in_background, name="hsnap-view-open", daemon=True).start()
                return
        self._show()

    def _load_in_background(self) -> None:
        """The opens, off the event loop (a daemon thread: ``q`` while waiting quits at once)."""
        try:
            self._load()
        except Exception as e:  # noqa: BLE001 - a bad HSNAP_S3_TIMEOUT, a missing botocore: shown, not lost in a thread
            self.error = (display_name(self.config.path), e)
        if self.is_running:
            self.post_message(self.Opened())  # thread-safe: handled on the app's loop, in its context
        else:  # quit while waiting
            self._close_documents()

    class Opened(Message):
        """The background opens are done (``error`` or the documents are set)."""

    def on_hsnap_view_app_opened(self, message: "HsnapViewApp.Opened") -> None:
        self.opening = []
        while any(isinstance(s, LoadingScreen) for s in self.screen_stack):
            self.pop_screen()
        self._show()

    def _show(self) -> None:
        if self.error is not None:
            self.push_screen(ErrorScreen(*self.error))
            return
        if self.directory is not None and self.document is None:
            self.push_screen(DirectoryScreen(self.directory))
        else:
            self._show_document()
        self._show_warnings()

    def _show_document(self) -> None:
        self.push_screen(MainScreen(
            self.document, reference=self.reference, decoder=self.decoder, token_text_note=self.token_text_note,
            page_size=self.config.page_size, verify_on_open=self.config.verify_on_open, can_diff=self.other is not None,
            back_to=None if self.directory is None else display_name(self.directory),
        ))
        if self.other is not None:
            self.action_open_diff()

    def _show_warnings(self) -> None:
        for w in self.warnings:
            self.notify(w, severity="warning", markup=False)
        self.warnings = []

    # -- a directory's entries
    @work(thread=True, exclusive=True, group="open-entry")
    def open_entry(self, path: str) -> None:
        """An entry of the listing, opened off the event loop (its chain's headers, the reference, the tokenizer
        of the model it records: files to read)."""
        opened = self.EntryOpened(*try_open(path))
        if opened.doc is not None:
            if self.config.against is not None:
                opened.reference = self._reference_for(opened.doc, opened.warnings)
            if not self.config.tokenizer:
                opened.decoder, opened.token_text_note = recorded_model_decoder(opened.doc.first.identity.model_id)
        self.post_message(opened)  # thread-safe: the app takes it on its loop

    class EntryOpened(Message):
        """An entry opened (or ``err``), with what it opens with: the reference and the recorded model's tokenizer."""

        def __init__(self, doc: Document | None, err: HsnapError | None) -> None:
            super().__init__()
            self.doc, self.err = doc, err
            self.reference: Reference | None = None
            self.decoder: Callable[[int], str] | None = None
            self.token_text_note: str | None = None
            self.warnings: list[str] = []

    def on_hsnap_view_app_entry_opened(self, message: "HsnapViewApp.EntryOpened") -> None:
        listing = self.screen if isinstance(self.screen, DirectoryScreen) else None
        if listing is None:  # left meanwhile (a second enter, help): keep it until the end
            if message.doc is not None:
                self.left.append(message.doc)
            return
        listing.show_detail()
        if message.err is not None:
            self.notify(describe_error(message.err) + _hint(message.err), title="Cannot open", severity="error", markup=False)
            return
        self.document, self.reference = message.doc, message.reference
        if not self.config.tokenizer:
            self.decoder, self.token_text_note = message.decoder, message.token_text_note
        self.warnings += message.warnings
        self._show_document()
        self._show_warnings()

    def back_to_listing(self) -> None:
        """From an entry back to the directory's listing (its documents closed when the app ends)."""
        if not any(isinstance(s, DirectoryScreen) for s in self.screen_stack):
            return
        while not isinstance(self.screen, DirectoryScreen):
            self.pop_screen()
        self.left += [d for d in (self.document, self.other) if d is not None]
        self.document = self.other = self.reference = None
        if not self.config.tokenizer:
            self.decoder = self.token_text_note = None
        self.screen.show_detail()

    def on_unmount(self) -> None:
        self._close_documents()

    def _close_documents(self) -> None:
        for doc in (self.document, self.other, *self.left):
            if doc is not None:
                doc.close()

    # -- actions
    @property
    def main_screen(self) -> MainScreen | None:
        return next((s for s in self.screen_stack if isinstance(s, MainScreen)), None)

    def action_open_diff(self) -> None:
        if self.other is not None and not isinstance(self.screen, DiffScreen):
            self.push_screen(DiffScreen(self.document, self.other, atol=self.config.atol, rtol=self.config.rtol))

    def open_diff_with(self, path: str) -> None:
        """Diff mode against a snapshot chosen from inside the app (``d`` with one file open);
        one on an object store opens off the event loop, the app saying it waits."""
        if not store_for(path).local:
            try:
                bound = StorageOptions().request_bound_s
            except HsnapError as e:
                self.notify(describe_error(e), title="Cannot diff", severity="error", markup=False)
                return
            self.notify(f"opening {display_name(path)}: waiting for the store (at most {bound:.0f} s)", timeout=bound, markup=False)
            threading.Thread(target=lambda: self.post_message(self.DiffOpened(*try_open(path))), name="hsnap-view-open", daemon=True).start()
            return
        self._diff_with(*try_open(os.path.expanduser(path)))

    class DiffOpened(Message):
        def __init__(self, doc: Document | None, err: HsnapError | None) -> None:
            super().__init__()
            self.doc, self.err = doc, err

    def on_hsnap_view_app_diff_opened(self, message: "HsnapViewApp.DiffOpened") -> None:
        self.clear_notifications()
        self._diff_with(message.doc, message.err)

    def _diff_with(self, doc: Document | None, err: HsnapError | None) -> None:
        if err is not None:
            self.notify(describe_error(err) + _hint(err), title="Cannot diff", severity="error", markup=False)
            return
        if self.other is not None:
            self.other.close()
        self.other = doc
        main = self.main_screen
        if main is not None:
            main.can_diff = True
            main.refresh_bindings()
        self.action_open_diff()

    def open_section_at(self, key: str, index: tuple[int, ...] | None) -> None:
        """From the diff table: the section of A on the main screen, its grid at ``index``."""
        main = self.main_screen
        if main is None:
            return
        while self.screen is not main:
            self.pop_screen()
        main.select_section(key, cursor=index, mark=index)
        if index is not None:
            self.notify(f"first difference at {list(index)} (marked red)", timeout=4)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def jump_to(self, key: str) -> None:
        """Open a section on the main screen (from the command palette)."""
        main = self.main_screen
        if main is None:
            return
        while self.screen is not main:
            self.pop_screen()
        main.select_section(key)

    def get_system_commands(self, screen: Screen):
        yield from super().get_system_commands(screen)
        if isinstance(screen, MainScreen):
            yield SystemCommand("Verify digests", "Check every section against its stored digest, and a delta's chain or a "
                                "paged file's pages as hsnap verify does", screen.action_verify)
            if self.other is not None:
                yield SystemCommand("Diff", "Compare with the second snapshot", self.action_open_diff)


def make_app(path, other=None, *, against=None, tokenizer=None, page_size: int = 100,
             atol: float = 0.0, rtol: float = 0.0, verify_on_open: bool = True) -> HsnapViewApp:
    """Build the app (tests use this; ``main`` adds argument parsing)."""
    return HsnapViewApp(ViewConfig(
        path=str(path), other=None if other is None else str(other), against=None if against is None else str(against),
        tokenizer=tokenizer, page_size=page_size, atol=atol, rtol=rtol, verify_on_open=verify_on_open,
    ))


def _hint(e: BaseException) -> str:
    hint = leftover_hint(e)
    return f" ({hint})" if hint else ""


# what a terminal needs to be usable again if the app could not restore it itself:
# leave the alternate screen, show the cursor, stop mouse reporting, reset colours
TERMINAL_RESET = "\x1b[?1049l\x1b[?25h\x1b[?1000l\x1b[?1002l\x1b[?1003l\x1b[?1006l\x1b[?2004l\x1b[0m"
EXIT_SIGNALS = ("SIGTERM", "SIGHUP", "SIGINT")  # SIGINT from outside (kill -INT): 130, as the CLI


def _exit_on_signals(app: HsnapViewApp) -> dict:
    """SIGTERM/SIGHUP/SIGINT end the app through its own shutdown (exit status 128 + signal)."""
    previous = {}

    def handler(signum, frame):
        loop = app._loop  # the running app's loop; call_soon_threadsafe is safe from a signal handler
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(lambda: app.exit(return_code=128 + signum))
        else:  # not started or already stopping: leave the ordinary way
            raise SystemExit(128 + signum)

    for name in EXIT_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            try:
                previous[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread
                pass
    return previous


def _reset_terminal() -> None:
    """Textual normally restores the terminal itself (it draws on stderr); make sure of it."""
    for stream in (sys.__stderr__, sys.__stdout__):
        try:
            if stream is not None and stream.isatty():
                stream.write(TERMINAL_RESET)
                stream.flush()
                return
        except (OSError, ValueError):
            continue


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the app took the terminal (loading a big file)
        print("hsnap-view: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hsnap-view", description="Terminal viewer for hsnap request snapshots.",
                                epilog="Keys: ? in the app. Docs: README (Command line).")
    p.add_argument("path", help="a rank file or a snapshot directory")
    p.add_argument("other", nargs="?", help="a second snapshot: diff mode")
    p.add_argument("--against", metavar="REF", help="check compatibility against a snapshot or an identity .json file")
    p.add_argument("--tokenizer", metavar="TOK", help="tokenizer.json, its directory, or a cached HF repo id (offline)")
    p.add_argument("--page-size", type=int, default=100, help="token history rows per page (default 100)")
    p.add_argument("--atol", type=float, default=0.0, help="diff: absolute tolerance")
    p.add_argument("--rtol", type=float, default=0.0, help="diff: relative tolerance")
    p.add_argument("--no-verify", action="store_true", help="do not start digest verification on open")
    args = p.parse_args(argv)
    app = make_app(args.path, args.other, against=args.against, tokenizer=args.tokenizer, page_size=max(1, args.page_size),
                   atol=args.atol, rtol=args.rtol, verify_on_open=not args.no_verify)
    if app.error is not None:
        print(f"hsnap-view: {describe_error(app.error[1])}{_hint(app.error[1])}", file=sys.stderr)
        return 2
    if app.tokenizer_error is not None:  # asked for by name: a typo is an error, not a silent fallback
        print(f"hsnap-view: --tokenizer: {app.tokenizer_error}", file=sys.stderr)
        return 2
    previous = _exit_on_signals(app)
    try:
        app.run()
    except BaseException:
        _reset_terminal()
        raise
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    if app.error is not None:  # an object-store snapshot that could not be opened (shown in the app too)
        print(f"hsnap-view: {describe_error(app.error[1])}{_hint(app.error[1])}", file=sys.stderr)
        return 2
    return app.return_code or 0  # a crash inside the app is a failure, not exit 0


if __name__ == "__main__":
    sys.exit(main())

"""hsnap-view: a terminal viewer for hsnap request snapshots (installed as ``hsnap_view``).

    hsnap-view snap.hsnap            # geometry, digests, stats, request history
    hsnap-view A B                   # diff mode

``make_app(path, other=None, ...)`` builds the Textual app. The viewer reads
snapshots only through hsnap_format; it never imports torch or SGLang.
"""

__all__ = ["make_app", "main"]


def __getattr__(name):  # keep `import hsnap_view` cheap: Textual loads on first use
    if name in __all__:
        from . import app

        return getattr(app, name)
    raise AttributeError(name)

"""Where a client of the ``/hsnap/*`` routes may make the server read and write: beneath one snapshot root, and
beneath the object-store prefixes the operator allowed.  Imports no SGLang.

The operator sets the root with ``python -m hsnap_sglang.serve --hsnap-root DIR`` or ``HSNAP_ROOT`` (inherited by
every process of the server) and the allowed URLs with ``--hsnap-allow-url s3://bucket/prefix`` (repeatable) or
``HSNAP_ALLOWED_URLS`` (comma-separated).  :func:`resolve` is called at the HTTP edge for every client-named path and
again by the scheduler where it opens or creates one (defence in depth):

* a relative path is relative to the root; an absolute one must lie beneath it (as configured, or its real path);
* a ``..`` component, a NUL or a name the file system cannot encode is refused outright (never normalised away);
* beneath the root every existing directory on the way is opened with ``O_NOFOLLOW`` relative to the one above it
  (``dir_fd``), so a symlink planted anywhere beneath the root is refused, not followed; directories created on the
  way are made relative to their parent's descriptor and reopened the same way; the last component is never a
  symlink either (the readers open files ``O_NOFOLLOW``; a writer never replaces an existing name);
* a path outside the root is refused before anything is opened or stat-ed: the answer does not depend on what, if
  anything, is there.

With no root configured every path is refused with a message naming the setting; with no allowed prefix every URL.
"""

from __future__ import annotations

import errno
import os
import stat

from hsnap_format.errors import HsnapError, Phrase

__all__ = ["ROOT_ENV", "ALLOWED_URLS_ENV", "ALLOWED_PEERS_ENV", "ConfinementError", "READ", "FILE", "DIR", "configured_root", "allowed_urls",
           "allowed_peers", "peer_origin", "resolve", "resolve_peer"]

ROOT_ENV = "HSNAP_ROOT"
ALLOWED_URLS_ENV = "HSNAP_ALLOWED_URLS"
ALLOWED_PEERS_ENV = "HSNAP_ALLOWED_PEERS"  # servers this one may call (a relayed migration's target), comma-separated

# what the client's path names: READ a snapshot, a set or a directory of them (nothing created); FILE a snapshot
# to be created (its directory must exist); DIR a directory hsnap writes into (created, with its parents, on demand)
READ, FILE, DIR = "read", "file", "dir"

_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NO_ROOT = Phrase(f"a snapshot root: start the server with --hsnap-root DIR or {ROOT_ENV}=DIR")
_NO_URLS = Phrase(f"an allowed object-store prefix: start the server with --hsnap-allow-url s3://bucket/prefix or {ALLOWED_URLS_ENV}")


class ConfinementError(HsnapError):
    """A client named a path or URL outside what the operator confined the plug-in to (or none is configured)."""


def configured_root(env=None) -> str | None:
    """The snapshot root as configured (absolute), or None."""
    root = (os.environ if env is None else env).get(ROOT_ENV, "")
    return os.path.abspath(root) if root else None


def allowed_urls(env=None) -> list[tuple[str, tuple[str, ...]]]:
    """The allowed prefixes as (bucket, key components); entries that are not plain ``s3://bucket[/prefix]`` are
    left out (they could only widen what is allowed by a trick)."""
    out = []
    for entry in (os.environ if env is None else env).get(ALLOWED_URLS_ENV, "").split(","):
        parsed = _split_url(entry.strip())
        if parsed is not None:
            out.append(parsed)
    return out


def _split_url(url: str) -> tuple[str, tuple[str, ...]] | None:
    """``s3://bucket/a/b`` -> ("bucket", ("a", "b")); None for anything else: another scheme, user info, an empty,
    ``.`` or ``..`` component, ``//``, a backslash or a control character (a prefix check on such a key means
    nothing: a store or a proxy may read it otherwise)."""
    if not url.startswith("s3://") or any(ord(c) < 0x20 or c in "\\\x7f" for c in url):
        return None
    bucket, _, key = url[len("s3://"):].partition("/")
    if not bucket or "@" in bucket or ":" in bucket:
        return None
    parts = tuple(key.rstrip("/").split("/")) if key.rstrip("/") else ()
    if any(p in ("", ".", "..") for p in parts):
        return None
    return bucket, parts


def _resolve_url(url: str, field: str, env) -> str:
    allowed = allowed_urls(env)
    if not allowed:
        raise ConfinementError(_shown(url), field, _NO_URLS, Phrase("none configured"))
    parsed = _split_url(url)
    if parsed is None:
        raise ConfinementError(_shown(url), field, Phrase("s3://bucket/key with no '.', '..' or empty component"), Phrase("another form"))
    bucket, parts = parsed
    if not any(bucket == b and parts[: len(p)] == p for b, p in allowed):
        raise ConfinementError(_shown(url), field, Phrase(f"a URL beneath an allowed prefix ({ALLOWED_URLS_ENV})"), Phrase("outside them"))
    return url


_NO_PEERS = Phrase(f"an allowed peer server: start the server with --hsnap-allow-peer http://host:port or {ALLOWED_PEERS_ENV}")


def peer_origin(url: str) -> str | None:
    """``http(s)://host[:port][/]`` as ``scheme://host:port`` (host lower-case, the default port written); None for
    anything else — user info, a path, a query or fragment, whitespace or a control character: a server URL names a
    server and nothing more."""
    from urllib.parse import urlsplit

    if not isinstance(url, str) or any(ord(c) <= 0x20 or c in "\\\x7f" for c in url):
        return None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host or "@" in parts.netloc or parts.path not in ("", "/") or "?" in url or "#" in url:
        return None
    port = port if port is not None else 443 if parts.scheme == "https" else 80
    return f"{parts.scheme}://{f'[{host}]' if ':' in host else host}:{port}"


def allowed_peers(env=None) -> list[str]:
    """The allowed peer servers as origins (:func:`peer_origin`); entries of another form are left out."""
    out = []
    for entry in (os.environ if env is None else env).get(ALLOWED_PEERS_ENV, "").split(","):
        origin = peer_origin(entry.strip()) if entry.strip() else None
        if origin is not None:
            out.append(origin)
    return out


def resolve_peer(url, field: str, env=None) -> str:
    """The origin of the server ``url`` names, if the operator allowed it (``--hsnap-allow-peer``), else
    ConfinementError (a typed 403): a client makes this server call only the servers its operator named."""
    allowed = allowed_peers(env)
    origin = peer_origin(url)
    shown = None if origin is None else f"peer {origin.split('://', 1)[1]}"  # not as a URL: errors mask those as store endpoints
    if not allowed:
        raise ConfinementError(shown, field, _NO_PEERS, Phrase("none configured"))
    if origin is None:
        raise ConfinementError(None, field, Phrase("http(s)://host:port (no user, path or query)"), Phrase("another form"))
    if origin not in allowed:
        raise ConfinementError(shown, field, Phrase(f"a peer server the operator allowed ({ALLOWED_PEERS_ENV})"), Phrase("not among them"))
    return origin


def _shown(url: str) -> str:
    """The URL as an error may show it: user info (a secret) never."""
    head, sep, rest = url.partition("://")
    return f"{head}://<redacted>" if "@" in rest.split("/", 1)[0] else url


def _components(path: str, field: str) -> list[str]:
    if "\x00" in path:
        raise ConfinementError(None, field, Phrase("a path without NUL"), Phrase("a NUL character"))
    try:
        os.fsencode(path)
    except UnicodeError:
        raise ConfinementError(None, field, Phrase("a path the file system can name"), Phrase("characters it cannot encode")) from None
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ConfinementError(path, field, Phrase("a path with no '..' component"), Phrase("'..'"))
    return parts


def _beneath(parts: list[str], root: str) -> list[str] | None:
    base = [p for p in root.split("/") if p]
    return parts[len(base):] if parts[: len(base)] == base else None


def resolve(path: str, field: str = "path", kind: str = READ, *, create: bool = False, env=None) -> str:
    """``path`` (a client's) as the absolute path beneath the snapshot root it names (an ``s3://`` URL: as it is,
    once it is beneath an allowed prefix), or :class:`ConfinementError`.  ``create`` (``kind`` DIR only): missing
    directories are made (mode 0700), each beneath its parent's descriptor, never through a symlink."""
    if not isinstance(path, str) or not path:
        raise ConfinementError(None, field, Phrase("a path or s3:// URL (string)"), Phrase(type(path).__name__))
    if "://" in path:
        return _resolve_url(path, field, env)
    root = configured_root(env)
    parts = _components(path, field)
    if root is None:
        raise ConfinementError(path, field, _NO_ROOT, Phrase("none configured"))
    real = os.path.realpath(root)
    rel = parts if not path.startswith("/") else next((r for r in (_beneath(parts, root), _beneath(parts, real)) if r is not None), None)
    if rel is None:
        raise ConfinementError(path, field, Phrase(f"a path beneath the snapshot root {root}"), Phrase("a path outside it"))
    try:
        fd = os.open(real, _DIR_OPEN)
    except OSError as e:
        raise ConfinementError(root, ROOT_ENV, Phrase("an existing directory (the snapshot root)"), Phrase(e.strerror or str(e))) from None
    try:
        _walk(fd, rel, path, field, kind, create)
    finally:
        os.close(fd)
    return os.path.join(real, *rel) if rel else real


def _walk(fd: int, rel: list[str], path: str, field: str, kind: str, create: bool) -> None:
    """Open each directory of ``rel`` beneath ``fd`` without following a symlink (making it when ``create`` and
    missing); the last component is checked by lstat only (it may be a file, or not exist yet)."""
    dirs = rel if kind == DIR else rel[:-1]
    opened: list[int] = []
    try:
        for i, name in enumerate(dirs):
            try:
                nxt = os.open(name, _DIR_OPEN, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    return  # nothing further exists: the caller's open reports the missing path
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass  # made meanwhile: opened below, no-follow, like any other
                nxt = _open_dir(name, fd, rel, i, path, field)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                    raise _link_error(path, field, rel, i, fd, name) from None
                raise ConfinementError(path, field, Phrase("a directory hsnap can open"), Phrase(e.strerror or str(e))) from None
            opened.append(nxt)
            fd = nxt
        if kind != DIR and rel:
            try:
                st = os.stat(rel[-1], dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return
            except OSError as e:
                raise ConfinementError(path, field, Phrase("a name hsnap can look up"), Phrase(e.strerror or str(e))) from None
            if stat.S_ISLNK(st.st_mode):
                raise ConfinementError(path, field, Phrase("no symlink beneath the snapshot root (hsnap never follows one)"),
                                       Phrase(f"{'/'.join(rel)} is a symlink"))
    finally:
        for f in opened:
            os.close(f)


def _open_dir(name: str, fd: int, rel: list[str], i: int, path: str, field: str) -> int:
    try:
        return os.open(name, _DIR_OPEN, dir_fd=fd)
    except OSError:
        raise _link_error(path, field, rel, i, fd, name) from None


def _link_error(path: str, field: str, rel: list[str], i: int, fd: int, name: str) -> ConfinementError:
    try:
        what = "a symlink" if stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode) else "not a directory"
    except OSError:
        what = "not a directory"
    return ConfinementError(path, field, Phrase("directories beneath the snapshot root, no symlink (hsnap never follows one)"),
                            Phrase(f"{'/'.join(rel[: i + 1])} is {what}"))

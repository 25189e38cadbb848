"""An error about a file a caller named never repeats that file's bytes (a server's /hsnap/resume would otherwise be a
file-reading oracle): it says what the bytes are not, and how many."""

from __future__ import annotations

import json

import pytest

from hsnap_format import open_snapshot
from hsnap_format.tools.cli import main as hsnap
from hsnap_format.errors import BadMagicError, MalformedManifestError
from hsnap_format.manifest import decode_manifest
from hsnap_format.spec import MAGIC, PENDING_MAGIC
from hsnap_format.tools.viewmodel import salvageable
from hsnap_sglang.errors import error_dict

SECRET = b"zqroot:x:0:0:Wv7/qq:/bin/zsh\nSECRET_TOKEN=hunter2\n"


def _leaks(text: str, data: bytes) -> bool:
    """Any 6 consecutive bytes of ``data`` in ``text`` (as they are, or as Python would show them)."""
    shown = text + repr(text)
    return any(w.decode("latin-1") in shown or repr(w)[2:-1] in shown for w in (data[i:i + 6] for i in range(len(data) - 5)))


@pytest.mark.parametrize("data", [SECRET, b"\x7fELF\x02\x01\x01\x00" + bytes(64), MAGIC[:1] + b"\r\n" + MAGIC[3:] + bytes(64)])
def test_bad_magic_names_no_byte_of_the_file(tmp_path, data):
    f = tmp_path / "passwd"
    f.write_bytes(data)
    with pytest.raises(BadMagicError) as e:
        open_snapshot(str(f))
    answer = json.dumps(error_dict(e.value))
    assert "not the hsnap magic" in str(e.value) and "8 bytes" in str(e.value)
    assert not _leaks(str(e.value), data[:8]) and not _leaks(answer, data[:8]), answer


def test_pending_magic_is_still_told_apart_without_its_bytes(tmp_path):
    f = tmp_path / "x.hsnap"
    f.write_bytes(PENDING_MAGIC + bytes(4096))
    with pytest.raises(BadMagicError, match="unfinished write") as e:
        open_snapshot(str(f))
    assert salvageable(e.value) and not _leaks(str(e.value), PENDING_MAGIC)


def test_manifest_digest_line_is_not_echoed(tmp_path):
    data = b'{"a": 1}\n' + SECRET.splitlines()[0] + b"\n"
    with pytest.raises(MalformedManifestError) as e:
        decode_manifest(data, str(tmp_path / "manifest.json"))
    assert not _leaks(str(e.value), SECRET.splitlines()[0])


def test_cli_says_what_the_file_is_not_on_one_line(tmp_path, capsys):
    f = tmp_path / "passwd"
    f.write_bytes(SECRET)
    assert hsnap(["info", str(f)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "BadMagicError" in err and "not the hsnap magic" in err and "zqroot" not in err

"""What a hostile writer can put where the plug-in reads small JSON: a migration container's ``refused.json`` and
``abandoned.json``, an HTTP body.  Every such input is a typed refusal naming file and field (never RecursionError,
UnicodeDecodeError or a value read whole past its cap), and an error answer echoes a bounded part of what it names."""

from __future__ import annotations

import json

import pytest

import hsnap_format as hf
from hsnap_format.controljson import loads_bounded, read_control
from hsnap_format.stores import store_for

HOSTILE_FILES = {
    "deep-8000": b"[" * 8000,
    "deep-100k-objects": b'{"a":' * 100_000,
    "not-utf8": b'{"reason": "\xff\xfe"}',
    "nan": b'{"type": NaN}',
    "infinity": b"[Infinity]",
    "truncated": b'{"type": "X", "reason": ',
    "huge": b'{"reason": "' + b"x" * 100_000 + b'"}',
}


@pytest.mark.parametrize("name", sorted(HOSTILE_FILES))
def test_bounded_json_reader_refuses_hostile_control_files_by_name(tmp_path, name):
    path = tmp_path / "refused.json"
    path.write_bytes(HOSTILE_FILES[name])
    with pytest.raises(hf.MalformedError) as info:
        read_control(store_for(str(path)), str(path), "marker")
    assert info.value.path == str(path) and info.value.field in ("marker", "length")
    assert info.value.expected is not None and info.value.found is not None


def test_bounded_json_reader_reads_a_marker_and_caps_its_nesting():
    assert loads_bounded(b'{"type": "CapacityError", "reason": "full"}', "m") == {"type": "CapacityError", "reason": "full"}
    assert loads_bounded(b"[" * 16 + b"]" * 16, "m") is not None
    with pytest.raises(hf.MalformedError, match="nested at most 16 deep"):
        loads_bounded(b"[" * 17 + b"]" * 17, "m")
    with pytest.raises(hf.MalformedError):  # a name the OS refuses is typed too
        read_control(store_for("/tmp"), "/tmp/a\x00b", "marker")


def test_marker_reason_of_a_hostile_marker_is_a_line_not_an_exception(tmp_path):
    from hsnap_io.migrate import marker_reason

    for name, data in HOSTILE_FILES.items():
        path = tmp_path / f"{name}.json"
        path.write_bytes(data)
        said = marker_reason(store_for(str(path)), str(path))
        assert said.startswith("(unreadable") and "\n" not in said and len(said) < 400, (name, said)


def _source_and_target(tmp_path):
    pytest.importorskip("torch")
    import chain_cases as cc
    import io_cases as ic

    from hsnap_io.migrate import MigrationSource, MigrationTarget

    ps, req = cc.source("hybrid_linear")
    src = MigrationSource(tmp_path / "mig", req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                          identity=ic.identity())
    src.precopy(req.req_pool_idx, cc.record(cc.POSITIONS[0]))
    t = ic.target("hybrid_linear", 1)
    tgt = MigrationTarget(req_to_token_pool=t.req_to_token_pool, token_to_kv_pool_allocator=t.token_to_kv_pool_allocator,
                          identity=ic.identity())
    return src, tgt


@pytest.mark.parametrize("name", ["deep-8000", "not-utf8", "huge"])
def test_source_caught_up_on_a_hostile_refused_json_is_a_typed_migration_error(tmp_path, name):
    from hsnap_io.migrate import REFUSED_NAME, MigrationError

    src, _ = _source_and_target(tmp_path)
    (tmp_path / "mig" / REFUSED_NAME).write_bytes(HOSTILE_FILES[name])
    with pytest.raises(MigrationError) as info:
        src.caught_up()
    assert info.value.path.endswith(REFUSED_NAME) and "unreadable" in str(info.value)


@pytest.mark.parametrize("name", ["deep-8000", "not-utf8", "huge"])
def test_target_step_on_a_hostile_abandoned_json_is_a_typed_migration_error(tmp_path, name):
    from hsnap_io.migrate import ABANDONED_NAME, MigrationError

    src, tgt = _source_and_target(tmp_path)
    assert tgt.step(tmp_path / "mig") is not None
    (tmp_path / "mig" / ABANDONED_NAME).write_bytes(HOSTILE_FILES[name])
    with pytest.raises(MigrationError) as info:
        tgt.step(tmp_path / "mig")
    assert info.value.field == ABANDONED_NAME and "unreadable" in str(info.value)
    tgt.release()


def test_error_answers_echo_a_capped_part_of_what_they_name():
    from hsnap_sglang.errors import ECHO_CHARS, BadRequestError, UnknownRequestError, error_dict

    huge = "r" * 10_000_000
    for e in (BadRequestError("request body", "rid", hf.errors.Phrase("a request id"), huge),
              UnknownRequestError(huge, "rid", hf.errors.Phrase("a request"), [huge] * 1000)):
        d = error_dict(e)
        size = len(json.dumps(d))
        assert size < 20_000, size
        assert "10000000 chars" in json.dumps(d)
    assert error_dict(BadRequestError("request body", "rid", "x", "short"))["found"] == "short"
    assert len(error_dict(BadRequestError("request body", "rid", "x", "y" * (ECHO_CHARS + 1)))["found"]) < ECHO_CHARS + 30


def test_error_answers_never_name_the_object_store_endpoint():
    from hsnap_format.stores.s3.client import RemoteIOError
    from hsnap_sglang.errors import error_dict

    d = error_dict(RemoteIOError("s3://bucket/a.hsnap", "get at http://10.1.2.3:8333/store", OSError(5, "SlowDown (HTTP 503)")))
    text = json.dumps(d)
    assert "10.1.2.3" not in text and "8333" not in text
    assert d["path"] == "s3://bucket/a.hsnap" and d["status"] == 502


def test_scheduler_handler_that_raises_answers_its_message_typed_and_returns():
    from types import SimpleNamespace

    from hsnap_sglang.containment import contained_handler

    answers = []

    def handler(msg):
        raise ValueError("embedded null byte")  # what os.makedirs raises on a NUL in a path

    wrapped = contained_handler(lambda msg, **kw: answers.append((msg, kw)), "drain", handler)
    msg = SimpleNamespace(op_id="1", dir="/tmp/x\x00y")
    assert wrapped(msg) is None
    (got, kw), = answers
    assert got is msg and kw["ok"] is False
    assert kw["error"]["type"] == "PluginError" and kw["error"]["status"] == 500 and "ValueError" in kw["error"]["message"]


def test_hook_body_that_raises_is_logged_and_gives_its_default():
    from hsnap_sglang.containment import guarded

    assert guarded("counting forwards", lambda: [][1], default=[]) == []  # noqa: PLE0643 (the hook body must raise)
    assert guarded("counting forwards", lambda x: x + 1, 1) == 2


@pytest.mark.parametrize("value, why", [("a\x00b", "NUL"), ("x\ud800", "surrogate"), ("y" * 5000, "characters"), (7, "string"), ("", "string")])
def test_path_validator_refuses_what_no_file_name_can_hold(value, why):
    from hsnap_sglang.containment import check_path
    from hsnap_sglang.errors import BadRequestError

    with pytest.raises(BadRequestError) as info:
        check_path("dir", value)
    assert info.value.field == "dir" and why in str(info.value)
    assert check_path("dir", "fz/ok.hsnap") == "fz/ok.hsnap"


def test_route_that_raises_answers_typed_json_not_a_bare_500():
    import asyncio

    from hsnap_sglang.containment import contained_route
    from hsnap_sglang.errors import BadRequestError

    @contained_route("export", lambda error: error)
    async def route(kind):
        raise {"key": KeyError("x"), "bad": BadRequestError("request body", "rid", "a rid", 7)}[kind]

    assert asyncio.run(route("key"))["type"] == "PluginError"
    bad = asyncio.run(route("bad"))
    assert bad["type"] == "BadRequestError" and bad["status"] == 400 and bad["field"] == "rid"


def test_server_plugin_reads_no_test_seam_from_its_environment():
    """The link writer's hold (a test seam) is installed by tests/engine/linkgate, never read by production code."""
    import re
    from pathlib import Path

    import hsnap_sglang

    for path in Path(hsnap_sglang.__file__).parent.rglob("*.py"):
        for name in re.findall(r"""environ(?:\.get)?\(?\[?\s*["']([A-Z0-9_]+)["']""", path.read_text()):
            assert "TEST" not in name, (path.name, name)


@pytest.mark.parametrize("name", ["x\x00y", "x\ud800y"])
def test_local_store_makedirs_of_an_unnameable_path_is_typed(tmp_path, name):
    with pytest.raises(hf.HsnapError) as info:
        store_for(str(tmp_path)).makedirs(str(tmp_path / name))
    assert info.value.field == "mkdir"


def test_a_directory_refusal_keeps_its_own_type():
    """What a drain or a migration raises while it looks at or makes its directory: a refusal keeps its type (a
    SnapshotExistsError is an OSError too, and was answered as a plain 400 HsnapError: now its own 409), an OS error
    is the directory's, anything else a PluginError."""
    from hsnap_format import HsnapError, SnapshotExistsError
    from hsnap_sglang.containment import typed_in_dir
    from hsnap_sglang.errors import PluginError, error_dict

    exists = SnapshotExistsError("/s/mig/link-0000.hsnap", "dir", "a container no migration has used", "a link exists")
    assert typed_in_dir(exists, "migrate", "/s/mig") is exists and error_dict(exists)["status"] == 409
    denied = typed_in_dir(PermissionError(13, "Permission denied"), "drain", "/s/d")
    assert type(denied) is HsnapError and denied.field == "dir" and "Permission denied" in str(denied)
    assert isinstance(typed_in_dir(ValueError("x"), "drain", "/s/d"), PluginError)

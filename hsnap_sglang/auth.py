"""Who may call the ``/hsnap/*`` routes.  Imports no SGLang.

They are admin operations (an export reads any client's request, a drain ends every stream): the routes carry
SGLang's own ``AuthLevel.ADMIN_OPTIONAL`` mark, so SGLang's API-key middleware asks for ``--admin-api-key`` when one
is set and for ``--api-key`` when only that is (a user key never unlocks them while an admin key exists).  With
neither key SGLang checks nothing: the plug-in then refuses to start unless the server listens on loopback only, or
the operator accepts it explicitly (``--hsnap-allow-unauthenticated``, ``HSNAP_ALLOW_UNAUTHENTICATED=1``).
"""

from __future__ import annotations

import ipaddress
import os

__all__ = ["ALLOW_UNAUTHENTICATED_ENV", "is_loopback", "exposure_refusal"]

ALLOW_UNAUTHENTICATED_ENV = "HSNAP_ALLOW_UNAUTHENTICATED"


def is_loopback(host) -> bool:
    """Whether ``host`` (SGLang's ``--host``) binds loopback only.  A name other than ``localhost`` is not trusted to
    (it may resolve elsewhere); ``0.0.0.0``, ``::`` and an empty host bind every interface."""
    if not isinstance(host, str) or not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_refusal(host, api_key, admin_api_key, *, tokenizer_workers: int = 1, env=None) -> str | None:
    """Why the plug-in may not start in this server (one line for the operator), or None.  SGLang enforces keys in
    single-tokenizer mode only: with several tokenizer workers a key protects nothing here."""
    env = os.environ if env is None else env
    keyed = bool(api_key or admin_api_key) and (tokenizer_workers or 1) <= 1
    if keyed or is_loopback(host) or env.get(ALLOW_UNAUTHENTICATED_ENV) == "1":
        return None
    return (f"hsnap: refusing to enable the plug-in: the server listens on {host!r} (not loopback only) and no key guards its "
            "/hsnap routes (admin operations: they export, read and end any client's request). Set --admin-api-key (or "
            "--api-key; one tokenizer worker), listen on 127.0.0.1, or accept it with --hsnap-allow-unauthenticated "
            f"({ALLOW_UNAUTHENTICATED_ENV}=1).")

"""Validators of the settings that name places: URLs and bind addresses (used by settings.py).

Each raises ``ValueError`` with the problem in a few words; pydantic turns it into the one-line
:class:`~spotguard_daemon.core.settings.SettingsError` naming the setting.
"""

from __future__ import annotations

import difflib
import ipaddress
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator
from spotguard.storage.fresh_node import NO_STORE

__all__ = ["HttpEndpoint", "StoreUrl", "http_url", "is_loopback", "store_url", "NO_STORE",
           "STORE_SCHEMES"]


def http_url(value: str | None) -> str | None:
    """An ``http://`` or ``https://`` URL with a host: anything else would fail at the first request."""
    if value is None:
        return value
    try:
        parts = urlsplit(value)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
        plain = not (parts.query or parts.fragment or "@" in parts.netloc)
    except ValueError:
        ok = plain = False
    if not ok:
        raise ValueError("must be an http:// or https:// URL with a host, like http://169.254.169.254")
    if not plain:
        raise ValueError("must be a plain http(s)://host[:port][/path] URL: no credentials, no query")
    return value


HttpEndpoint = Annotated[str, AfterValidator(http_url)]

STORE_SCHEMES = ("file://", "s3://", "gs://", "az://", "https://<account>.blob.core.windows.net/")


def store_url(value: str | None) -> str | None:
    """A store URL that :func:`spotguard.storage.open_store` accepts (checked here, without the
    SDKs), or ``none`` (any case; returned as ``none``): no durable store at all."""
    if value is None:
        return value
    if value.strip().lower() == NO_STORE:
        return NO_STORE
    parts = urlsplit(value)
    if parts.scheme == "file" or (not parts.scheme and value.startswith("/")):
        return value
    azure_https = parts.scheme == "https" and (parts.hostname or "").endswith(".blob.core.windows.net")
    if parts.scheme not in ("s3", "gs", "az") and not azure_https:
        close = difflib.get_close_matches(value.lower(), [NO_STORE])
        hint = " (did you mean none?)" if close else ""
        raise ValueError(f"unsupported store URL{hint}: use {', '.join(STORE_SCHEMES)} "
                         "or none (no store)")
    if not (parts.path.strip("/") if azure_https else parts.hostname):
        raise ValueError("the store URL names no bucket or container")
    if "@" in parts.netloc:
        raise ValueError("credentials do not belong in the store URL; the SDK's credential chain is used")
    return value


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, ``[v6]`` or a name) is this machine only: ``localhost`` or a
    loopback address. ``0.0.0.0``, ``*``, ``[::]`` and every other name are not."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


StoreUrl = Annotated[str | None, AfterValidator(store_url)]

"""Secrets out of everything the daemon shows: one place that knows what a secret looks like.

Used by ``--print-config`` (:func:`spotguard_daemon.core.settings.redacted`), the invalid-setting errors,
the status reply's store URL and, through a logging filter (:mod:`spotguard_daemon.core.logs`), every log
line at every level. What it hides:

- a URL's password (``https://user:pass@host`` -> ``https://user:***@host``) and the value of every
  query parameter (``?token=``, ``?sig=``, SAS tokens: a store or webhook URL needs none to be read);
- ``key=value`` pairs whose key names a credential (``AccountKey=``, ``SharedAccessSignature=``,
  ``password=``, ``secret=``, ``token=``, ``sig=``), as in an Azure connection string;
- the exact values registered with :func:`register`: the settings' ``SecretStr`` fields and the
  cloud credentials in the environment (``AWS_SECRET_ACCESS_KEY`` and friends).

Redaction is for display; the settings themselves keep the real values. Exceptions: none.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable
from urllib.parse import urlsplit, urlunsplit

__all__ = ["MASK", "redact_url", "redact_text", "redact_data", "register", "register_environment",
           "register_url"]

MASK = "***"
ENVIRONMENT_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                       "AZURE_STORAGE_KEY", "AZURE_STORAGE_CONNECTION_STRING", "AZURE_CLIENT_SECRET",
                       "AZURE_STORAGE_SAS_TOKEN", "GOOGLE_OAUTH_ACCESS_TOKEN")
"""Environment variables whose values are credentials the SDKs read."""

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
_SECRET_WORDS = (r"account_?key|shared_?access_?signature|password|passwd|secret|token|sig|signature|"
                 r"credential|api_?key|access_?key|auth")
_SECRET_KEY = re.compile(rf"(?i)({_SECRET_WORDS})")
_PAIR = re.compile(rf"(?i)\b({_SECRET_WORDS})(\s*[=:]\s*)([^;&\s'\",]+)")
_known: set[str] = set()


def register(values: Iterable[str | None]) -> None:
    """Remember exact secret values (at least 4 characters) to be masked wherever they appear."""
    _known.update(v for v in values if v and len(v) >= 4)


def register_url(url: str | None) -> None:
    """Register a URL's password and query values, so they are masked even where the URL was cut
    apart (a bucket name in an SDK's error message, a host in a connection error)."""
    if not url:
        return
    try:
        parts = urlsplit(url)
        pairs = [p.split("=", 1) for p in parts.query.split("&") if "=" in p]
        register([parts.password, *(v for k, v in pairs if _SECRET_KEY.search(k))])
    except ValueError:
        register([url])


def register_environment(environ: dict[str, str] | None = None) -> None:
    """Register the cloud credentials found in the environment (see :data:`ENVIRONMENT_SECRETS`)."""
    env = os.environ if environ is None else environ
    register(env.get(name) for name in ENVIRONMENT_SECRETS)


def redact_url(url: str) -> str:
    """``url`` without its password and query values; text that is no URL comes back unchanged."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            user, _, host = netloc.rpartition("@")
            netloc = f"{user.split(':', 1)[0]}:{MASK}@{host}" if ":" in user else f"{MASK}@{host}"
        query = "&".join(f"{p.split('=', 1)[0]}={MASK}" if "=" in p else p
                         for p in parts.query.split("&")) if parts.query else ""
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return MASK


def redact_text(text: str) -> str:
    """``text`` with every URL, credential pair and registered secret value masked."""
    for value in sorted(_known, key=len, reverse=True):
        if value in text:
            text = text.replace(value, MASK)
    text = _URL.sub(lambda m: redact_url(m.group(0)), text)
    return _PAIR.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)


def redact_data(value: Any) -> Any:
    """A copy of JSON-like data with every string passed through :func:`redact_text`."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: redact_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_data(v) for v in value]
    return value

"""Building a store from its URL: the scheme names the backend.

The registry sits above the backends (each imports :mod:`.base`, never this module), so that
:mod:`.base` imports none of them. A backend, and its cloud SDK, is imported only when a URL names
it, so importing :mod:`spotguard.storage` stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from spotguard.storage.base import Store, StoreOptions

__all__ = ["open_store"]


def _split_bucket(rest: str) -> tuple[str, str]:
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError("the URL names no bucket or container")
    return bucket, prefix.strip("/")


def open_store(url: str, options: Any = None) -> Store:
    """The store for ``url``: ``file:///dir``, ``s3://bucket/prefix``, ``gs://bucket/prefix``,
    ``az://container/prefix`` or ``https://<account>.blob.core.windows.net/<container>/prefix``.

    ``options`` is a :class:`StoreOptions` or any settings-like object with the same field names.
    Nothing is contacted here; call ``check()`` for that. Raises :class:`ValueError` for a bad URL."""
    opts = StoreOptions.of(options)
    parts = urlsplit(url)
    if parts.scheme == "file" or (not parts.scheme and url.startswith("/")):
        from spotguard.storage.file import FileStore

        return FileStore(Path(unquote(parts.path or url)))
    if parts.scheme == "s3":
        from spotguard.storage.s3 import S3Store

        return S3Store(*_split_bucket(parts.netloc + parts.path), options=opts)
    if parts.scheme == "gs":
        from spotguard.storage.gcs import GcsStore

        return GcsStore(*_split_bucket(parts.netloc + parts.path), options=opts)
    if parts.scheme == "az" or (parts.scheme == "https" and parts.netloc.endswith(".blob.core.windows.net")):
        from spotguard.storage.azure import AzureStore

        if parts.scheme == "https":
            opts = StoreOptions(**{**opts.__dict__, "azure_account": parts.netloc.split(".")[0]})
            return AzureStore(*_split_bucket(parts.path.lstrip("/")), options=opts)
        return AzureStore(*_split_bucket(parts.netloc + parts.path), options=opts)
    raise ValueError(f"unsupported store URL {url!r}: use file://, s3://, gs://, az:// or https://<account>.blob.core.windows.net/")

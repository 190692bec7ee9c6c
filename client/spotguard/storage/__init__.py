"""Durable checkpoint storage: object stores behind one small protocol, and the commit protocol.

``open_store(url, options)`` gives a :class:`Store` for ``file://``, ``s3://``, ``gs://`` or
``az://``; :class:`Durable` uploads, lists, verifies, restores and prunes checkpoints in it. Cloud SDKs
are imported only when their backend is opened, so importing this package is cheap.
"""

from spotguard.storage._local import ManifestError
from spotguard.storage.base import (
    CredentialsError,
    IntegrityError,
    Interrupted,
    NotFound,
    Store,
    StoreError,
    StoreOptions,
    TransientError,
)
from spotguard.storage.durable import Durable, DurableInfo, PruneReport
from spotguard.storage.fresh_node import restore_newer, store_from_env
from spotguard.storage.registry import open_store

__all__ = [
    "CredentialsError",
    "Durable",
    "DurableInfo",
    "IntegrityError",
    "Interrupted",
    "ManifestError",
    "NotFound",
    "PruneReport",
    "Store",
    "StoreError",
    "StoreOptions",
    "TransientError",
    "open_store",
    "restore_newer",
    "store_from_env",
]

"""The Store contract, run against every backend (a directory and three emulators)."""

from __future__ import annotations

import hashlib
import os

import pytest

from spotguard.storage import IntegrityError, NotFound, StoreError, StoreOptions, open_store


def test_put_get_list_delete_roundtrip(store, tmp_path):
    big = os.urandom(2 * 1024 * 1024 + 123)  # > part_size: multipart / chunked / block upload
    src = tmp_path / "src.bin"
    src.write_bytes(big)
    assert store.put_file("objects/sha256/aa", src, sha256=hashlib.sha256(big).hexdigest(), size=len(big)) == len(big)
    store.put_bytes("jobs/j/latest", b"step-0000000001\n")
    assert store.exists("objects/sha256/aa") and not store.exists("objects/sha256/bb")
    assert sorted(store.list("")) == ["jobs/j/latest", "objects/sha256/aa"]
    assert list(store.list("objects/")) == ["objects/sha256/aa"]
    store.get_file("objects/sha256/aa", tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == big
    assert store.get_bytes("jobs/j/latest") == b"step-0000000001\n"
    store.delete(["objects/sha256/aa", "never/existed"])
    assert list(store.list("")) == ["jobs/j/latest"]


def test_a_range_reads_those_bytes_and_no_more(store):
    """``get_range`` (a resharding load reads single DCP chunks): the bytes asked for, from the
    start, the middle and up to the end; a range past the end is an IntegrityError, never short data."""
    body = bytes(range(256)) * 40
    store.put_bytes("ranged/blob", body)
    for start, length in ((0, 1), (1000, 2345), (len(body) - 7, 7), (5, 0)):
        assert store.get_range("ranged/blob", start, length) == body[start:start + length]
    with pytest.raises(IntegrityError):
        store.get_range("ranged/blob", len(body) - 3, 10)
    with pytest.raises(NotFound):
        store.get_range("ranged/none", 0, 4)


def test_a_write_if_absent_writes_once_and_never_replaces(store):
    """``put_bytes_if_absent`` (one global-manifest write a step, issue 28 item 9): the first write
    lands, a second one is refused and leaves the first's bytes; a deleted key can be written again."""
    assert store.put_bytes_if_absent("once/key", b"first") is True
    assert store.put_bytes_if_absent("once/key", b"second") is False
    assert store.get_bytes("once/key") == b"first"
    store.delete(["once/key"])
    assert store.put_bytes_if_absent("once/key", b"third") is True and store.get_bytes("once/key") == b"third"


def test_overwrite_replaces_whole_object(store):
    store.put_bytes("k", b"first version, longer")
    store.put_bytes("k", b"second")
    assert store.get_bytes("k") == b"second"


def test_missing_key_raises_not_found(store, tmp_path):
    with pytest.raises(NotFound):
        store.get_bytes("absent")
    with pytest.raises(NotFound):
        store.get_file("absent", tmp_path / "out")


@pytest.mark.parametrize("key", ["/abs", "a/../b", "..", "a//b", "", "a\\b"])
def test_unsafe_keys_are_refused(store, key):
    with pytest.raises(ValueError):
        store.put_bytes(key, b"x")


def test_check_passes_on_a_good_store(store):
    store.check()


@pytest.mark.parametrize("backend", ["s3", "gcs", "azure"])
def test_check_names_a_missing_bucket_in_one_line(backend, new_bucket, request, azurite_conn):
    good = new_bucket(backend)
    url = good.url.replace("://sg-", "://missing-")
    emu = request.getfixturevalue({"s3": "moto", "gcs": "fake_gcs", "azure": "azurite"}[backend])
    opts = StoreOptions(endpoint_url=None if backend == "azure" else emu.url,
                        azure_connection_string=azurite_conn(emu.url) if backend == "azure" else None)
    with pytest.raises(NotFound) as info:
        open_store(url, opts).check()
    message = str(info.value)
    assert "\n" not in message and url in message and "does not exist" in message


def test_file_check_reports_an_unusable_root_in_one_line(tmp_path):
    (tmp_path / "plain-file").write_text("not a directory")
    with pytest.raises(StoreError) as info:
        open_store(f"file://{tmp_path}/plain-file/durable").check()
    assert str(info.value).startswith(f"storage file://{tmp_path}/plain-file/durable: ")
    assert "\n" not in str(info.value)


def test_file_store_is_private_and_leaves_no_tmp_files(tmp_path):
    store = open_store(f"file://{tmp_path}/b")
    store.put_bytes("a/b/c", b"data")
    assert (tmp_path / "b/a/b/c").stat().st_mode & 0o077 == 0
    assert (tmp_path / "b/a").stat().st_mode & 0o077 == 0
    assert [p.name for p in (tmp_path / "b/a/b").iterdir()] == ["c"]


def test_file_store_hides_and_cleans_crashed_puts(tmp_path):
    store = open_store(f"file://{tmp_path}/b")
    store.put_bytes("objects/x", b"ok")
    crashed = tmp_path / "b/objects/.tmp-y-123"
    crashed.write_bytes(b"half")
    os.utime(crashed, (1, 1))
    assert list(store.list("")) == ["objects/x"]
    assert store.clean_incomplete(60) == 1 and not crashed.exists()


@pytest.mark.parametrize("url, kind", [
    ("file:///tmp/x", "FileStore"), ("/tmp/x", "FileStore"), ("s3://b/p", "S3Store"),
    ("gs://b/p", "GcsStore"), ("az://c/p", "AzureStore"),
    ("https://acct.blob.core.windows.net/c/p", "AzureStore"),
])
def test_open_store_dispatches_on_scheme(url, kind, monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    options = StoreOptions(azure_account="acct")
    assert type(open_store(url, options)).__name__ == kind


def test_open_store_rejects_unknown_scheme():
    with pytest.raises(ValueError, match="unsupported store URL"):
        open_store("ftp://host/x")


def test_options_read_settings_like_objects_and_unwrap_secrets():
    from pydantic import SecretStr

    class Section:
        endpoint_url = "http://127.0.0.1:1"
        concurrency = 3
        azure_connection_string = SecretStr("AccountKey=secret")

    opts = StoreOptions.of(Section())
    assert (opts.endpoint_url, opts.concurrency, opts.azure_connection_string) == \
        ("http://127.0.0.1:1", 3, "AccountKey=secret")
    assert "secret" not in repr(opts)


def test_import_spotguard_storage_imports_no_cloud_sdk():
    import subprocess
    import sys

    code = ("import sys, spotguard, spotguard.storage; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('boto3','botocore','google','azure')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_surface_is_complete():
    import spotguard.storage as storage

    assert all(hasattr(storage, name) for name in storage.__all__)
    public = {n for n in dir(storage) if not n.startswith("_") and not isinstance(getattr(storage, n), type(storage))}
    assert public <= set(storage.__all__) | {"annotations"}

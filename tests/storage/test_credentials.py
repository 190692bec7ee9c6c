"""Refused or missing credentials are reported as CredentialsError, in one line, by ``check()``.

S3 and GCS run against a real local HTTP server that refuses everything (the emulators do not check
credentials); Azure against Azurite with a wrong account key, which Azurite does check."""

from __future__ import annotations

import base64
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from spotguard.storage import CredentialsError, StoreOptions, open_store


class _Refuse(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _refuse(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.startswith("/storage/"):
            body, kind = b'{"error": {"code": 403, "message": "Forbidden", "errors": []}}', "application/json"
        else:
            body, kind = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>", "application/xml"
        self.send_response(403)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(0 if self.command == "HEAD" else len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_PUT = do_POST = _refuse


@pytest.fixture
def refusing_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refuse)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_refused_credentials_are_one_clear_line(scheme, refusing_server, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    store = open_store(f"{scheme}://bucket/prefix", StoreOptions(endpoint_url=refusing_server, max_attempts=1))
    with pytest.raises(CredentialsError) as info:
        store.check()
    message = str(info.value)
    assert message.startswith(f"storage {scheme}://bucket/prefix") and "\n" not in message
    assert "wrong-secret-value" not in message


def test_missing_aws_credentials_are_named(refusing_server, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with pytest.raises(CredentialsError, match="no AWS credentials found"):
        open_store("s3://bucket", StoreOptions(endpoint_url=refusing_server)).check()


def test_azure_wrong_account_key_is_refused(azurite, azurite_conn):
    good = azurite_conn(azurite.url)
    right_key = good.split("AccountKey=")[1].split(";")[0]
    wrong = base64.b64encode(os.urandom(64)).decode()
    store = open_store("az://container/p", StoreOptions(azure_connection_string=good.replace(right_key, wrong),
                                                        max_attempts=1))
    with pytest.raises(CredentialsError) as info:
        store.check()
    message = str(info.value)
    assert message.startswith("storage az://container/p") and "\n" not in message
    assert wrong not in message and right_key not in message

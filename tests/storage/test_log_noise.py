"""Store faults say one line per cause (issue 21, "also seen"): a reply cut inside its header block
is an error of the request, not a 200 with an empty body nor urllib3's "Failed to parse headers"
with a traceback; and every translated error names the operation, the store and the cause.

A real TCP proxy (tcp_fault_proxy) cuts each reply after N bytes, N swept across the header block.
"""

from __future__ import annotations

import logging

import pytest

from spotguard.storage import StoreError, open_store
from spotguard.storage.base import transport_error

from tcp_fault_proxy import TcpFaultProxy
from test_transport_faults import EMULATOR, target

PAYLOAD = b"p" * 3000


@pytest.mark.parametrize("backend", ["s3", "gcs", "azure"])
def test_a_reply_cut_in_its_headers_is_an_error_in_one_line_never_empty_bytes(backend, request, new_bucket,
                                                                            caplog):
    direct = new_bucket(backend)
    direct.put_bytes("seed", PAYLOAD)
    emulator = request.getfixturevalue(EMULATOR[backend])
    outcomes = []
    with caplog.at_level(logging.DEBUG):
        for cut in (20, 60, 120, 200, 260, 330, 400, 600):
            with TcpFaultProxy(emulator.url, truncate_after=cut) as proxy:
                proxy.mode = "truncate"
                store = open_store(*target(direct, backend, proxy.url))
                try:
                    body = store.get_bytes("seed")
                except StoreError as exc:
                    outcomes.append((cut, str(exc)))
                    assert f"{store.url}: get seed: " in str(exc), exc
                    continue
                assert body == PAYLOAD, (cut, len(body))  # before: b"" for a cut inside the headers (S3)
                outcomes.append((cut, "whole"))
    print(backend, outcomes)
    assert any(o != "whole" for _, o in outcomes), "no reply was cut: the test proves nothing"
    noisy = [r for r in caplog.records if "Failed to parse headers" in r.getMessage()
             or (r.exc_info and r.name.startswith("urllib3"))]
    assert not noisy, [r.getMessage() for r in noisy]


def test_a_translated_error_carries_its_cause_never_a_bare_type():
    """Before: ``head objects/...: ValueError``, the message lost."""

    class Torn(ValueError):
        __module__ = "urllib3.response"

    assert str(transport_error("s3://b/p: head k", Torn("no content-length in a reply of 200"))) == \
        "s3://b/p: head k: Torn: no content-length in a reply of 200"
    assert str(transport_error("s3://b/p: head k", Torn())) == "s3://b/p: head k: Torn (no message)"
    signed = Torn("cannot read https://acct.blob.core.windows.net/c/k?sig=SECRET&se=2030 now")
    assert "SECRET" not in str(transport_error("az://c/p: get k", signed))

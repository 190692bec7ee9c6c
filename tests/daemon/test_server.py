"""Server: request/reply over a real ROUTER socket, error replies, PUB events and heartbeats."""

from __future__ import annotations

import asyncio
import json

import zmq
import zmq.asyncio
from spotguard.protocol import (
    Kind, Notice, NoticeEvent, Reply, StatusRequest, decode_event, decode_reply, encode,
)
from spotguard_daemon.core.server import Server

LIMIT = 4096


def make_server(sock_dir, handler=None, pending=lambda: ["n-1"]) -> Server:
    async def default(request):
        return Reply(ok=True, data={"type": request.type})

    return Server(pub_endpoint=f"ipc://{sock_dir}/run/events.sock",
                  request_endpoint=f"ipc://{sock_dir}/run/requests.sock", handler=handler or default,
                  pending_ids=pending, daemon_id="d1", max_message_bytes=LIMIT, heartbeat_interval=0.05)


def scenario(server: Server, body):
    """Run ``body(ctx)`` against the bound server with its loops running; return its result."""
    async def main():
        server.bind()
        tasks = [asyncio.create_task(server.serve()), asyncio.create_task(server.heartbeats())]
        ctx = zmq.asyncio.Context()
        try:
            return await asyncio.wait_for(body(ctx), 20)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            ctx.destroy(linger=0)
            server.close()
    return asyncio.run(main())


async def req(ctx, server, payload: bytes) -> Reply:
    sock = ctx.socket(zmq.REQ)
    sock.connect(server.request_endpoint)
    await sock.send(payload)
    reply = decode_reply(await asyncio.wait_for(sock.recv(), 5))
    sock.close(linger=0)
    return reply


def test_valid_request_reaches_the_handler_and_gets_its_reply(sock_dir):
    server = make_server(sock_dir)
    reply = scenario(server, lambda ctx: req(ctx, server, encode(StatusRequest())))
    assert reply.ok and reply.data == {"type": "status"}


def test_every_kind_of_bad_request_gets_an_error_reply_and_serving_goes_on(sock_dir):
    server = make_server(sock_dir)
    bad = {
        b"\xff\xfe": "not UTF-8 JSON",
        b"[1, 2": "not UTF-8 JSON",
        b'{"type": "bogus"}': "invalid message",
        b'{"type": "register", "pid": -4}': "register.pid",
        b'{"v": 2, "type": "status"}': "unsupported protocol version",
        b'{"type": "status", "extra": 1}': "extra",
        b" " * (LIMIT + 1): "exceeds the limit",
        b"[" * (LIMIT - 1): "nested too deeply",
    }

    async def body(ctx):
        replies = {payload: await req(ctx, server, payload) for payload in bad}
        return replies, await req(ctx, server, encode(StatusRequest()))

    replies, last = scenario(server, body)
    for payload, expected in bad.items():
        assert not replies[payload].ok and expected in replies[payload].error, (payload[:20], replies[payload])
    assert last.ok


def test_multi_frame_and_envelope_less_messages(sock_dir):
    server = make_server(sock_dir)

    async def body(ctx):
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(server.request_endpoint)
        await dealer.send_multipart([b"", encode(StatusRequest()), b"second"])
        multi = decode_reply((await asyncio.wait_for(dealer.recv_multipart(), 5))[-1])
        await dealer.send_multipart([b"no", b"delimiter"])  # dropped: no envelope to answer
        await dealer.send(encode(StatusRequest()))  # a bare DEALER frame is answered
        bare = decode_reply((await asyncio.wait_for(dealer.recv_multipart(), 5))[-1])
        dealer.close(linger=0)
        return multi, bare

    multi, bare = scenario(server, body)
    assert not multi.ok and "expected one JSON frame, got 2" in multi.error
    assert bare.ok


def test_a_handler_that_raises_gets_an_internal_error_reply(sock_dir):
    async def broken(request):
        raise RuntimeError("boom")

    server = make_server(sock_dir, handler=broken)
    reply = scenario(server, lambda ctx: req(ctx, server, encode(StatusRequest())))
    assert not reply.ok and reply.error.startswith("internal error")


def test_a_huge_message_is_cut_off_by_libzmq_and_others_are_still_served(sock_dir):
    server = make_server(sock_dir)

    async def body(ctx):
        huge = ctx.socket(zmq.DEALER)
        huge.connect(server.request_endpoint)
        await huge.send_multipart([b"", b"x" * (10 * LIMIT)])
        answered = await huge.poll(300)
        huge.close(linger=0)
        return answered, await req(ctx, server, encode(StatusRequest()))

    answered, reply = scenario(server, body)
    assert not answered and reply.ok


def test_pub_sends_topic_and_json_and_heartbeats_carry_pending_ids(sock_dir):
    server = make_server(sock_dir, pending=lambda: ["aws:terminate:x"])
    notice = Notice(id="n1", platform="aws", kind=Kind.TERMINATE)

    async def body(ctx):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(server.pub_endpoint)
        beats = []
        while len(beats) < 2:  # once heartbeats arrive, the subscription is live
            topic, data = await asyncio.wait_for(sub.recv_multipart(), 5)
            beats.append((topic, decode_event(data)))
        server.publish(NoticeEvent(notice=notice))
        while True:
            topic, data = await asyncio.wait_for(sub.recv_multipart(), 5)
            if topic == b"notice":
                sub.close(linger=0)
                return beats, json.loads(data)

    beats, event = scenario(server, body)
    assert {t for t, _ in beats} == {b"heartbeat"}
    assert beats[0][1].pending == ["aws:terminate:x"] and beats[1][1].seq > beats[0][1].seq
    assert beats[0][1].daemon_id == "d1"
    assert event["notice"]["id"] == "n1" and event["type"] == "notice"


def test_tcp_port_zero_reports_the_bound_port(sock_dir):
    async def handler(request):
        return Reply(ok=True)

    server = Server(pub_endpoint="tcp://127.0.0.1:0", request_endpoint="tcp://127.0.0.1:0",
                    handler=handler, pending_ids=list, daemon_id="d2")
    reply = scenario(server, lambda ctx: req(ctx, server, encode(StatusRequest())))
    assert reply.ok
    assert server.request_endpoint.startswith("tcp://127.0.0.1:") and not server.request_endpoint.endswith(":0")

"""AckedPublisher (the gateway's usage publishing): a batch goes out back to back and each message is
acknowledged on its own, against a real nats-server with JetStream."""

from __future__ import annotations

from nats.js.api import StreamConfig

from services.gateway.acked_publisher import AckedPublisher


async def test_each_message_of_a_batch_is_acked_on_its_own(nc) -> None:  # type: ignore[no-untyped-def]
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="T", subjects=["t.>"]))
    pub = AckedPublisher(nc)
    await pub.start()
    try:
        batch = [(f"t.{i % 3}", f"m{i}".encode(), {"Nats-Msg-Id": f"id-{i}"}) for i in range(300)]
        assert await pub.publish(batch, timeout_s=5.0) == [True] * 300
        assert (await js.stream_info("T")).state.messages == 300

        # a resend of what was stored (its ack lost) is taken again and dropped by the stream as a duplicate
        assert await pub.publish(batch[:10], timeout_s=5.0) == [True] * 10
        assert (await js.stream_info("T")).state.messages == 300

        # no stream takes this subject: not stored, said at once (no responders), not after the deadline
        mixed = [("t.ok", b"x", {"Nats-Msg-Id": "ok-1"}), ("nowhere.x", b"y", {"Nats-Msg-Id": "lost-1"})]
        assert await pub.publish(mixed, timeout_s=5.0) == [True, False]

        # the stream refuses (a message over its size limit): False, and the batch goes on
        await js.add_stream(StreamConfig(name="S", subjects=["small.>"], max_msg_size=16))
        assert await pub.publish([("small.a", b"z" * 100, {}), ("small.b", b"ok", {})], timeout_s=5.0) == [False, True]
    finally:
        await pub.stop()


async def test_a_closed_connection_stores_nothing_and_says_so(nats_server) -> None:  # type: ignore[no-untyped-def]
    from services.common.bus import connect

    client = await connect(nats_server.url, "acked-test")
    pub = AckedPublisher(client)
    await pub.start()
    await client.close()
    assert await pub.publish([("t.a", b"x", {})], timeout_s=0.5) == [False]
    await pub.stop()

"""The engine link (server/engine_host/wire.py, link.py): every message type round-trips through the
codec unchanged; a message that is foreign (another secret), unsigned, tampered with, sealed for
the other direction or not a message of its direction is refused, also on the real ipc sockets,
which live in a directory only this user can enter."""

from __future__ import annotations

import asyncio
import os
import secrets
import stat
import time

import msgspec
import pytest
import zmq
from waiting import wait_until

from kvcache.stats import KVCacheStats
from server.engine_host.link import FROM_ENGINE, EngineEnd, HttpEnd, address, private_dir
from server.engine_host.wire import (
    KEY_BYTES,
    TO_ENGINE,
    Abort,
    Add,
    EngineInfo,
    EngineState,
    LoadFailed,
    Probe,
    Ready,
    Release,
    Shutdown,
    Snapshot,
    SnapshotReply,
    StepOut,
    link_codec,
)
from server.telemetry.relay import EngineFigures, MetricsDelta, TransferFigures
from server.types import DisaggParams, GenerateRequest, LinkState, RequestOutput, SamplingParams
from transceiver.signed import Envelope, Rejected, SignedCodec, derive_key, mac

SECRET = secrets.token_bytes(KEY_BYTES)
DISAGG = DisaggParams(request_type="generation_only", ctx_request_id="ctx-1", ctx_endpoint="tcp://127.0.0.1:5",
                      ctx_epoch="e1", first_gen_tokens=(7,), prompt_token_ids=(1, 2, 3), ctx_cached_tokens=2,
                      first_text_streamed=True, cache_salt="salt", prior_output_tokens=1, response_id="cmpl-1",
                      report_tokens=True)
REQUEST = GenerateRequest("cmpl-1", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, top_k=3,
                                                               seed=4, stop=("x", "\n"), stop_token_ids=(9,),
                                                               min_tokens=1, ignore_eos=True),
                          disagg=DISAGG, cache_salt="salt", kv_retention_priority=80)
STATE = EngineState(
    idle=False, health_problem="stranded_pins: window 512: ...",
    links=LinkState(dead=("kv-sender",), peers={"tcp://127.0.0.1:5": "compatible"}, sender=("tcp://h:1", "e1")),
    figures=EngineFigures(KVCacheStats(prefix_query_tokens=5, evictions=1, blocks={(512, "primary", "free"): 30}),
                          {"waiting": 1, "running": 2}, 3,
                          [TransferFigures({"timeout": 1}, 2, 3, {"wait": 0.5})]))
OUTPUT = RequestOutput("cmpl-1", [5, 6], "hé", finished=True, finish_reason="stop", prompt_tokens=3,
                       completion_tokens=2, cached_tokens=1, error=None, error_code=500, disagg=DISAGG)
TO_ENGINE_MESSAGES = [Add(REQUEST), Abort("cmpl-1"), Release("ctx-1"), Probe(["tcp://a:1", "tcp://b:2"]),
                      Snapshot(7), Shutdown()]
FROM_ENGINE_MESSAGES = [
    Ready(EngineInfo("/models/tiny", 512, 1234, "tcp://127.0.0.1:9"), STATE),
    LoadFailed("RuntimeError: out of memory"),
    StepOut([OUTPUT, RequestOutput("cmpl-2", [], "", finished=False)],
            MetricsDelta({"ttft": [0.1], "tpot": [0.01, 0.02], "e2e": [1.0], "queue_time": [0.001]},
                         generation_tokens=3, prompt_tokens=4, transfers=[(1024, 0.5)]), STATE),
    StepOut([OUTPUT]),
    SnapshotReply(7, snapshot={"seq": 3, "hashes": ["ab"], "windows": {"512": {"primary": ["ab"]}}}),
    SnapshotReply(8, error="KeyError: 3"),
]


def sides(secret: bytes = SECRET) -> tuple[SignedCodec, SignedCodec]:
    """(HTTP side, engine side)"""
    return link_codec(secret, engine_side=False), link_codec(secret, engine_side=True)


@pytest.mark.parametrize("message", TO_ENGINE_MESSAGES, ids=lambda m: type(m).__name__)
def test_every_command_round_trips_http_to_engine(message):
    http, engine = sides()
    assert engine.open(*http.seal(message)) == ("", message)


@pytest.mark.parametrize("message", FROM_ENGINE_MESSAGES, ids=lambda m: type(m).__name__)
def test_every_engine_message_round_trips_engine_to_http(message):
    http, engine = sides()
    _, opened = http.open(*engine.seal(message))
    assert opened == message and type(opened) is type(message)


def test_a_generate_request_keeps_every_field():
    http, engine = sides()
    request = engine.open(*http.seal(Add(REQUEST)))[1].request
    assert request == REQUEST and request.disagg == DISAGG and request.arrival_time == REQUEST.arrival_time


def test_foreign_unsigned_tampered_and_misdirected_messages_are_refused():
    http, engine = sides()
    foreign, _ = sides(secrets.token_bytes(KEY_BYTES))
    header, tag = http.seal(Abort("x"))
    with pytest.raises(Rejected, match="bad_mac"):
        engine.open(*foreign.seal(Abort("x")))  # another server's secret
    with pytest.raises(Rejected, match="malformed"):
        engine.open(header, b"")  # unsigned
    with pytest.raises(Rejected, match="bad_mac"):
        engine.open(header.replace(b"x", b"y"), tag)  # tampered with
    with pytest.raises(Rejected, match="bad_mac"):
        engine.open(*engine.seal(StepOut([])))  # the engine's own message played back to it
    with pytest.raises(Rejected, match="bad_mac"):
        http.open(*http.seal(Abort("x")))


def test_a_signed_message_of_the_wrong_shape_is_refused():
    http, engine = sides()
    send_key = derive_key(SECRET, "engine-link", TO_ENGINE)
    for payload in (msgspec.msgpack.encode({"type": "Pickle", "x": 1}), b"\xc1", msgspec.msgpack.encode(StepOut([]))):
        header = msgspec.msgpack.encode(Envelope(1, "", 0, time.time(), msgspec.Raw(payload)))
        with pytest.raises(Rejected, match="undecodable"):
            engine.open(header, mac(send_key, header))


def test_a_short_secret_is_refused():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        link_codec(b"short", engine_side=True)


def test_the_real_sockets_carry_messages_and_drop_foreign_ones():
    directory = private_dir()
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700  # no other user can reach the ipc sockets
    http = HttpEnd(directory, SECRET)
    engine = EngineEnd(str(directory), SECRET)
    intruder = zmq.Context.instance().socket(zmq.PUSH)  # injects "outputs" into the HTTP process
    intruder.setsockopt(zmq.LINGER, 0)
    intruder.connect(address(directory, FROM_ENGINE))
    try:
        assert wait_until(lambda: http.send(Abort("cmpl-1")), 5, "the engine end connected")
        assert wait_until(lambda: engine.receive(0.1), 5, "the command") == [Abort("cmpl-1")]
        foreign, _ = sides(secrets.token_bytes(KEY_BYTES))
        intruder.send_multipart(foreign.seal(StepOut([RequestOutput("cmpl-1", [6], "forged", finished=True)])))
        intruder.send_multipart([b"not msgpack"])
        engine.send(StepOut([OUTPUT]))

        async def read_until_both_dropped() -> list:
            received = []
            while http.rejected < 2 or not received:
                received += await http.receive(5.0)
            return received

        assert asyncio.run(asyncio.wait_for(read_until_both_dropped(), 10)) == [StepOut([OUTPUT])]
    finally:
        intruder.close(linger=0)
        engine.close()
        http.close()
    assert not directory.exists()


def test_wake_ends_the_engine_ends_wait():
    directory = private_dir()
    http, engine = HttpEnd(directory, SECRET), EngineEnd(str(directory), SECRET)
    try:
        engine.wake()
        assert engine.receive(30.0) == []  # returns at once: nothing arrived, but it was woken
    finally:
        engine.close()
        http.close()

"""Wire protocol of the KV transceiver: config, message round trips, every rejection path, layouts."""

from __future__ import annotations

import time

import msgspec
import pytest

from server.config.schema import AUTH_TOKEN_ENV, ConfigError, server_config_from_dict
from transceiver.config import TransceiverConfig
from transceiver.sender.ipc_serve import MAX_IPC_SLOTS
from transceiver.signed import MAX_SKEW_S, Envelope, Rejected, ReplayGuard, SignedCodec, derive_key, mac
from transceiver.wire import (
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    TO_SENDER,
    Ack,
    Cancel,
    ChunkHeader,
    CudaIpcPool,
    Done,
    Failed,
    Hello,
    InstanceInfo,
    IpcChunk,
    IpcOffer,
    Layout,
    PeerIdentity,
    PullRequest,
    WindowLayout,
    WindowRange,
    layout_mismatch,
    link_codec,
)

TOKEN = b"k" * 32
K = "d.yaml: cache_transceiver_config."


def _layout(**changes) -> Layout:
    windows = [
        WindowLayout(window=64, layers=[0, 2], kv_heads=2, head_dim=16, dtype="bfloat16", slot_bytes=8192),
        WindowLayout(window=2048, layers=[1, 3], kv_heads=2, head_dim=16, dtype="bfloat16", slot_bytes=8192),
    ]
    base = dict(tokens_per_block=32, windows=windows, fingerprint="tiny-llama:abc")
    base.update(changes)
    return Layout(**base)


IDENTITY = PeerIdentity(hostname="node-1", boot_id="0b5c3c2e-7d1f-4e55-9a0e-1f2d3c4b5a69",
                        gpu_uuid="GPU-8d3f0c1e-2b4a-5c6d-7e8f-9a0b1c2d3e4f", pid=4242)
OFFER = IpcOffer(identity=IDENTITY, pools=[
    CudaIpcPool(window=w, num_slots=1000, device=0, handle=bytes(range(64)), storage_size_bytes=1000 * 8192,
                storage_offset_bytes=2 << 20, ref_counter_handle=b"/torch_4242_3781_0", ref_counter_offset=w,
                event_handle=b"\xff" * 64, event_sync_required=True) for w in (64, 2048)])

BODIES = [
    Hello(layout=_layout()),
    Hello(layout=_layout(), identity=IDENTITY),
    InstanceInfo(layout=_layout()),
    InstanceInfo(layout=_layout(), ipc=OFFER),
    PullRequest(pull_id=7, ctx_request_id="req-1", ctx_epoch="e1", ranges=[], via_ipc=True),
    IpcChunk(pull_id=7, window=2048, first=3, slots=[17, 4, 999, 0], checksum=2**64 - 1),
    PullRequest(pull_id=7, ctx_request_id="req-1", ctx_epoch="e1",
                ranges=[WindowRange(window=64, first=2, count=3),
                        WindowRange(window=2048, first=0, count=5)]),
    ChunkHeader(pull_id=7, window=64, first=2, count=3, nbytes=3 * 8192, checksum=2**64 - 1),
    Done(pull_id=7, total_bytes=24576, chunks=1),
    Ack(pull_id=7, ctx_request_id="req-1"),
    Cancel(ctx_request_id="req-1"),
    Cancel(ctx_request_id="req-1", pull_id=7, ctx_epoch="e1"),
    Failed(reason="timeout", detail="too slow", pull_id=7),
    Failed(reason="incompatible", detail="window sizes differ"),
]


@pytest.mark.parametrize("body", BODIES, ids=lambda b: type(b).__name__)
def test_every_message_round_trips(body) -> None:
    tx, rx = link_codec(TOKEN, "epoch-tx", sender=False), link_codec(TOKEN, "epoch-rx", sender=True)
    header, tag = tx.seal(body)
    assert len(tag) == 32
    assert rx.open(header, tag) == ("epoch-tx", body)


def test_the_largest_ipc_chunk_fits_in_a_header() -> None:
    body = IpcChunk(pull_id=2**63 - 1, window=2**31, first=2**31, slots=[2**63 - 1] * MAX_IPC_SLOTS,
                    checksum=2**64 - 1)  # 9 bytes per slot
    header, tag = link_codec(TOKEN, "tx", sender=True).seal(body)
    assert len(header) < MAX_HEADER_BYTES
    assert link_codec(TOKEN, "rx", sender=False).open(header, tag) == ("tx", body)


def _forge(version: int = PROTOCOL_VERSION, ts: float | None = None, msg_id: int = 1234,
           body: bytes | None = None, token: bytes = TOKEN) -> tuple[bytes, bytes]:
    """A header built by hand (as an attacker or an old peer would), with a MAC under `token`."""
    enc = msgspec.msgpack.Encoder()
    raw = body if body is not None else enc.encode(Ack(pull_id=1, ctx_request_id="r"))
    env = Envelope(version=version, epoch="peer", seq=msg_id, ts=time.time() if ts is None else ts,
                   body=msgspec.Raw(raw))
    header = enc.encode(env)
    return header, _mac(header, token)


def _mac(header: bytes, token: bytes = TOKEN, direction: str = TO_SENDER) -> bytes:
    return mac(derive_key(token, "kv-link", direction), header)


def _rejection(codec: SignedCodec, header: bytes, tag: bytes) -> str:
    with pytest.raises(Rejected) as err:
        codec.open(header, tag)
    return err.value.reason


def test_each_bad_message_is_rejected_with_its_reason_and_good_ones_still_pass() -> None:
    rx = link_codec(TOKEN, "rx", sender=True)
    header, tag = _forge()
    assert _rejection(rx, header, _mac(header, b"x" * 32)) == "bad_mac"
    assert _rejection(rx, header[:-1] + bytes([header[-1] ^ 1]), tag) == "bad_mac"  # tampered
    assert _rejection(rx, *_forge(token=b"other-token-xxxxxxxx")) == "bad_mac"
    assert _rejection(rx, header, _mac(header, direction="to-receiver")) == "bad_mac"  # the other direction
    assert _rejection(rx, header, tag[:16]) == "malformed"  # truncated MAC frame
    assert _rejection(rx, b"\x95" + b"x" * MAX_HEADER_BYTES, tag) == "malformed"  # too long to be ours
    assert _rejection(rx, *_forge(version=PROTOCOL_VERSION + 1)) == "wrong_version"
    assert _rejection(rx, *_forge(ts=time.time() - MAX_SKEW_S - 5)) == "stale"
    assert _rejection(rx, *_forge(ts=time.time() + MAX_SKEW_S + 5)) == "stale"
    assert _rejection(rx, *_forge(ts=float("nan"))) == "stale"
    assert _rejection(rx, *_forge(body=b"\xc1garbage")) == "undecodable"
    garbage = b"\x93\x01\x02"  # msgpack, but not an envelope
    assert _rejection(rx, garbage, _mac(garbage)) == "undecodable"
    cut = header[: len(header) // 2]  # truncated header, MAC computed over the truncated bytes
    assert _rejection(rx, cut, _mac(cut)) == "undecodable"
    assert rx.open(header, tag) == ("peer", Ack(pull_id=1, ctx_request_id="r"))
    assert _rejection(rx, header, tag) == "replayed"
    good = link_codec(TOKEN, "tx", sender=False).seal(Done(pull_id=1, total_bytes=0, chunks=0))
    assert rx.open(*good) == ("tx", Done(pull_id=1, total_bytes=0, chunks=0))


def test_replay_guard_forgets_only_what_staleness_already_rejects() -> None:
    guard = ReplayGuard(window_s=10.0, capacity=3)
    assert guard.check_and_add(1, now=100.0)
    assert not guard.check_and_add(1, now=105.0)
    assert guard.check_and_add(2, now=106.0) and guard.check_and_add(3, now=107.0)
    assert guard.check_and_add(4, now=108.0)  # capacity 3: the oldest id goes
    assert len(guard) == 3
    assert guard.check_and_add(5, now=117.5)  # 2 (106) and 3 (107) are older than the 10 s window
    assert len(guard) == 2
    assert not guard.check_and_add(4, now=117.9)


@pytest.mark.parametrize("change, expected", [
    (dict(fingerprint="other"), "model fingerprint differs: context 'tiny-llama:abc' vs generation 'other'"),
    (dict(tokens_per_block=16), "tokens_per_block differs: context 32 vs generation 16"),
    (dict(windows=_layout().windows[:1]), "window groups differ: context [64, 2048] vs generation [64]"),
    (dict(windows=[_layout().windows[0],
                   WindowLayout(window=2048, layers=[1], kv_heads=2, head_dim=16, dtype="bfloat16",
                                slot_bytes=4096)]),
     "window 2048: layers differs: context [1, 3] vs generation [1]"),
    (dict(windows=[_layout().windows[0],
                   WindowLayout(window=2048, layers=[1, 3], kv_heads=2, head_dim=16, dtype="float16",
                                slot_bytes=8192)]),
     "window 2048: dtype differs: context 'bfloat16' vs generation 'float16'"),
])
def test_incompatible_layouts_name_the_difference(change, expected) -> None:
    assert layout_mismatch(_layout(), _layout()) is None
    assert layout_mismatch(_layout(), _layout(**change)) == expected


def _transceiver(data) -> TransceiverConfig:
    """`cache_transceiver_config` as a server file gives it (the one conversion, server/config/yaml_io.py)."""
    return server_config_from_dict({"model": "m", "cache_transceiver_config": data}, "d.yaml").cache_transceiver_config


def test_config_defaults_and_token(monkeypatch) -> None:
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    cfg = _transceiver({"auth_token": "t" * 16})
    assert (cfg.kv_transfer_timeout_ms, cfg.host, cfg.port) == (60000, "127.0.0.1", 0)
    assert cfg.max_chunk_bytes == 8 << 20 and cfg.same_host_ipc is True
    assert _transceiver({"same_host_ipc": False}).same_host_ipc is False
    assert cfg.token_bytes() == b"t" * 16 and cfg.timeout_s == 60.0
    with pytest.raises(ValueError, match="auth_token is not set"):
        TransceiverConfig().token_bytes()
    assert _transceiver(None) == TransceiverConfig()


@pytest.mark.parametrize("data, message", [
    ({"port": 70000}, K + "port: must be <= 65535, got 70000"),
    ({"port": True}, K + "port: must be an integer, got a boolean True"),
    ({"kv_transfer_timeout_ms": 0}, K + "kv_transfer_timeout_ms: must be >= 1, got 0"),
    ({"auth_token": "short"}, K + "auth_token: must be null or a string of at least 16 characters, got 'short'"),
    ({"host": ""}, K + "host: must be an interface address such as 127.0.0.1, got ''"),
    ({"max_chunk_bytes": 1000}, K + "max_chunk_bytes: must be a multiple of 8 in 65536..1073741824, got 1000"),
    ({"max_chunk_bytes": 65540}, K + "max_chunk_bytes: must be a multiple of 8 in 65536..1073741824, got 65540"),
    ({"backend": "NIXL"}, K + "backend: unknown key; valid keys: kv_transfer_timeout_ms"),
    ({"same_host_ipc": "yes"}, K + "same_host_ipc: must be true or false, got a string 'yes'"),
    ({"same_host_ipc": 1}, K + "same_host_ipc: must be true or false, got an integer 1"),
    ([1, 2], "d.yaml: cache_transceiver_config: must be a mapping, got a list [1, 2]"),
])
def test_config_errors_name_key_and_source(data, message) -> None:
    with pytest.raises(ConfigError) as err:
        _transceiver(data)
    assert str(err.value).startswith(message), str(err.value)

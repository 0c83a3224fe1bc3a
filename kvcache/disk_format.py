"""The disk tier's files: one per (window group, disk slot), and the directory's manifest. No torch,
no pickle: msgpack headers and a JSON manifest, through msgspec Structs.

A block file (`w{window}/{slot}.kv`):

    MAGIC (8 bytes) | header length (u32 LE) | header (msgpack BlockHeader) | header MAC (32) | payload

The header MAC is keyed blake2b; the payload's (`payload_hasher`) HMAC-SHA256 under a subkey, fed piece
by piece (SHA-NI ~1.9 GB/s a core, blake2b ~1.0: docs/BENCHMARKS.md); the key is the deployment
token's, so a foreign, torn or flipped file never passes. A header names its block (a stale file
fails) and format (`dtype`, FP8 `scales`). The manifest (`manifest.json`, disk_dir.py) names the
model fingerprint, the KV layout and the key's id, sealed under the same key.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import struct
from hashlib import blake2b

import msgspec

MAGIC = b"PDKVBLK3"  # 3: the header names the block format (2: HMAC-SHA256 payload MAC; 1: blake2b)
MAC_BYTES = 32
_LEN = struct.Struct("<I")
PREFIX_BYTES = len(MAGIC) + _LEN.size
MAX_HEADER_BYTES = 1 << 20  # tokens_per_block tokens fit many times over
MANIFEST_VERSION = 3  # a directory of another version starts empty (its files are deleted)
CHUNK_BYTES = 256 << 10  # a payload is written and hashed in pieces of this size (reads: disk_store.py)


class BlockHeader(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    window: int
    slot: int
    block_hash: bytes
    parent_hash: bytes | None  # None: a root child, whose tree key is `root_salt`
    root_salt: bytes  # the salt digest of a root child's namespace; empty for other blocks
    tokens: tuple[int, ...]
    priority: int
    written_ns: int  # wall clock at write: restored blocks are ordered by it for LRU
    payload_bytes: int
    payload_mac: bytes
    dtype: str  # the payload's element type ("float8_e4m3fn", "bfloat16", ...)
    scales: tuple[float, ...]  # FP8: the k scales then the v scales of the window group's layers


class BlockFormat(msgspec.Struct, frozen=True):
    """What a window group's block bytes are: element type, and the scales they were stored with."""

    dtype: str = ""
    scales: tuple[float, ...] = ()

    def describe(self) -> str:
        return self.dtype + (f" with scales {list(self.scales)}" if self.scales else "")


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int
    fingerprint: str  # the model's (the KV cache manager's salt)
    dtype: str
    tokens_per_block: int
    layer_windows: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    key_id: str  # hex: which deployment token's key seals the files
    k_scales: tuple[float, ...] = ()  # an FP8 cache's per-layer scales (empty for other dtypes)
    v_scales: tuple[float, ...] = ()
    layout: str = "heads"  # the KV format's layout: "heads" (K and V) or "latent" (MLA)


class ManifestFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    manifest: Manifest
    mac: str  # hex keyed blake2b of the manifest's JSON


class BadFile(Exception):
    """A block file failed a check; `reason` is the metric label (corrupt, truncated, stale, ...)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def check_format(header: BlockHeader, wanted: BlockFormat) -> None:
    """BadFile("format") unless the file's payload is of the block format `wanted`."""
    if (header.dtype, header.scales) != (wanted.dtype, wanted.scales):
        found = BlockFormat(header.dtype, header.scales)
        raise BadFile("format", f"the file holds {found.describe()} KV, this server's is {wanted.describe()}")


def mac(key: bytes, person: bytes, *parts: bytes | memoryview) -> bytes:
    h = blake2b(key=key, digest_size=MAC_BYTES, person=person)
    for part in parts:
        h.update(part)
    return h.digest()


def key_id(key: bytes) -> str:
    return mac(key, b"pdserve-kv-kid", b"disk tier key id").hex()[:32]


@functools.lru_cache(maxsize=8)
def _payload_key(key: bytes) -> bytes:
    return mac(key, b"pdserve-kv-data", b"payload HMAC-SHA256 key")


def payload_hasher(key: bytes) -> hmac.HMAC:
    """A fresh payload MAC: update it with the payload's bytes in order, then `digest()`."""
    return hmac.new(_payload_key(key), digestmod=hashlib.sha256)


def encode_prefix(key: bytes, header: BlockHeader) -> bytes:
    """Everything before the payload: magic, header length, header, header MAC."""
    encoded = msgspec.msgpack.encode(header)
    body = MAGIC + _LEN.pack(len(encoded)) + encoded
    return body + mac(key, b"pdserve-kv-head", body)


def header_length(prefix: bytes | memoryview) -> int:
    """The header length from a file's first PREFIX_BYTES (BadFile if not a block file)."""
    if len(prefix) < PREFIX_BYTES:
        raise BadFile("truncated", f"{len(prefix)} bytes, shorter than the file prefix")
    if bytes(prefix[:len(MAGIC)]) != MAGIC:
        raise BadFile("corrupt", "not a pdserve KV block file (magic)")
    (n,) = _LEN.unpack_from(prefix, len(MAGIC))
    if n > MAX_HEADER_BYTES:
        raise BadFile("corrupt", f"header length {n} is implausible")
    return n


def decode_header(key: bytes, data: bytes | memoryview) -> tuple[BlockHeader, int]:
    """(the checked header, the payload's offset) from a file's first bytes (through the header MAC)."""
    end = PREFIX_BYTES + header_length(data)
    if len(data) < end + MAC_BYTES:
        raise BadFile("truncated", "the file ends inside its header")
    view = memoryview(data)
    if mac(key, b"pdserve-kv-head", view[:end]) != bytes(view[end:end + MAC_BYTES]):
        raise BadFile("corrupt", "header MAC mismatch (damaged, or written under another token)")
    try:
        header = msgspec.msgpack.decode(view[PREFIX_BYTES:end], type=BlockHeader)
    except msgspec.DecodeError as exc:  # a sealed header that does not decode: another format
        raise BadFile("corrupt", f"header does not decode: {exc}") from None
    return header, end + MAC_BYTES


def check_digest(header: BlockHeader, digest: bytes) -> None:
    """BadFile unless `digest` (the payload's MAC as read back) is the one the header names."""
    if not hmac.compare_digest(digest, header.payload_mac):
        raise BadFile("corrupt", "payload checksum mismatch")


def seal_manifest(key: bytes, manifest: Manifest) -> bytes:
    body = msgspec.json.encode(manifest)
    return msgspec.json.encode(ManifestFile(manifest, mac(key, b"pdserve-kv-mani", body).hex()))


def open_manifest(key: bytes, data: bytes) -> Manifest:
    """The manifest of a manifest file's bytes; ValueError saying why it cannot be trusted."""
    try:
        sealed = msgspec.json.decode(data, type=ManifestFile)
    except msgspec.DecodeError as exc:
        raise ValueError(f"unreadable ({exc})") from None
    if sealed.manifest.key_id != key_id(key):
        raise ValueError("written under another deployment token")
    body = msgspec.json.encode(sealed.manifest)
    if mac(key, b"pdserve-kv-mani", body).hex() != sealed.mac:
        raise ValueError("its MAC does not match (edited or damaged)")
    return sealed.manifest


def manifest_difference(found: Manifest, wanted: Manifest) -> str | None:
    """The first field (other than the key id) in which two manifests differ, as a phrase."""
    for field in Manifest.__struct_fields__:
        a, b = getattr(found, field), getattr(wanted, field)
        if a != b:
            return f"{field} is {a!r}, this server has {b!r}"
    return None

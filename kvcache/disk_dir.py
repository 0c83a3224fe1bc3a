"""The disk tier's directory at start-up (no torch): the lock giving it to one server, and the
manifest deciding whether its block files are this server's to restore.

A matching manifest (model fingerprint, KV layout, token key): every header is checked (failed ones,
other formats, slots beyond `max_bytes` deleted) and returned. Else the files are deleted with a
warning naming why, and the tier starts empty under a new manifest.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

from kvcache.disk_format import (
    MAC_BYTES,
    PREFIX_BYTES,
    BadFile,
    BlockFormat,
    BlockHeader,
    Manifest,
    check_format,
    decode_header,
    header_length,
    manifest_difference,
    open_manifest,
    seal_manifest,
)

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
BLOCK_FILE = re.compile(r"^(\d+)\.kv$")
_HEADER_READ = 4096  # bytes read first: a header of tokens_per_block tokens fits


def take_directory(path: Path) -> int:
    """Create `path` (0700) and lock it; returns the lock's fd (closing it releases the directory)."""
    where = f"kv_cache_config.disk.path={str(path)!r}"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise ValueError(f"{where}: cannot use the directory: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            raise ValueError(f"{where}: another server uses this directory (give each server its own "
                             f"disk.path)") from None
        raise ValueError(f"{where}: cannot lock the directory: {exc.strerror or exc}") from None
    return fd


class StartUp:
    """What the scan needs: the directory, the key, slots, payload bytes and block format per window;
    it counts the files it did not use by reason (`skipped`)."""

    def __init__(self, path: Path, key: bytes, num_slots: dict[int, int], slot_bytes: dict[int, int],
                 format_of: Callable[[int], BlockFormat] = lambda _: BlockFormat()) -> None:
        self.path, self.key, self.num_slots, self.slot_bytes = path, key, num_slots, slot_bytes
        self.format_of = format_of
        self.skipped: dict[str, int] = {}


def restore_or_reset(store: StartUp, wanted: Manifest) -> dict[int, list[BlockHeader]]:
    """The checked headers of the blocks to restore per window (none unless the manifest matches)."""
    path, num_slots = store.path, store.num_slots
    why = _manifest_mismatch(path, store.key, wanted)
    if why is None:
        return {w: _scan(store, w, n) for w, n in num_slots.items()}
    files = [p for d in path.glob("w*") if d.is_dir() for p in d.iterdir()
             if BLOCK_FILE.match(p.name) or p.suffix == ".tmp"]
    if files or why != "no manifest":
        log.warning("disk tier %s: ignoring its %d block files (%s); starting it empty", path, len(files), why)
    for name in files:
        name.unlink(missing_ok=True)
    for window in num_slots:
        (path / f"w{window}").mkdir(mode=0o700, exist_ok=True)
    tmp = path / f"{MANIFEST}.tmp"
    tmp.write_bytes(seal_manifest(store.key, wanted))
    os.replace(tmp, path / MANIFEST)
    return {w: [] for w in num_slots}


def read_header(fd: int, key: bytes, window: int, slot: int, payload_bytes: int, fmt: BlockFormat,
                block_hash: bytes | None = None) -> tuple[BlockHeader, int]:
    """The checked header of an open block file (of `window`'s `slot`, `block_hash` if given, `fmt`,
    `payload_bytes`, whole) and its payload's offset."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, min(size, _HEADER_READ), 0)
    need = PREFIX_BYTES + header_length(head) + MAC_BYTES
    if need > len(head) and size > len(head):
        head += os.pread(fd, min(size, need) - len(head), len(head))
    header, offset = decode_header(key, head)
    if (header.window, header.slot) != (window, slot) or block_hash not in (None, header.block_hash):
        raise BadFile("stale", f"the file of slot {slot} (window {window}) holds another block")
    check_format(header, fmt)
    if header.payload_bytes != payload_bytes:
        raise BadFile("corrupt", f"payload of {header.payload_bytes} bytes, blocks have {payload_bytes}")
    if size != offset + header.payload_bytes:
        raise BadFile("truncated", f"{size} bytes, the header says {offset + header.payload_bytes}")
    return header, offset


def _manifest_mismatch(path: Path, key: bytes, wanted: Manifest) -> str | None:
    try:
        data = (path / MANIFEST).read_bytes()
    except FileNotFoundError:
        return "no manifest"
    except OSError as exc:
        return f"manifest unreadable: {exc.strerror or exc}"
    try:
        found = open_manifest(key, data)
    except ValueError as exc:
        return f"manifest {exc}"
    difference = manifest_difference(found, wanted)
    return None if difference is None else f"manifest: {difference}"


def _scan(store: StartUp, window: int, num_slots: int) -> list[BlockHeader]:
    """The checked headers of window's block files (a file that fails a check is deleted)."""
    folder = store.path / f"w{window}"
    folder.mkdir(mode=0o700, exist_ok=True)
    found = []
    for p in sorted(folder.iterdir()):
        m = BLOCK_FILE.match(p.name)
        if m is None or int(m.group(1)) >= num_slots:
            _skip(store, p, "leftover" if m is None else "beyond max_bytes")
            continue
        try:
            fd = os.open(p, os.O_RDONLY)
            try:
                header, _ = read_header(fd, store.key, window, int(m.group(1)), store.slot_bytes[window],
                                        store.format_of(window))
            finally:
                os.close(fd)
            found.append(header)
        except BadFile as exc:
            _skip(store, p, exc.reason)
        except OSError as exc:
            log.warning("disk tier: cannot read %s: %s", p, exc)
    return found


def _skip(store: StartUp, p: Path, reason: str) -> None:
    store.skipped[reason] = store.skipped.get(reason, 0) + 1
    p.unlink(missing_ok=True)

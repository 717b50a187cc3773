"""The on-disk page format: one file per page, a fixed header then the payload.

    offset size  field
    0      4     magic b"RMKV"
    4      2     format version (uint16 LE) = 2
    6      2     key length (uint16 LE) = K
    8      8     payload length (uint64 LE) = N
    16     4     crc32 of the key then the payload (uint32 LE; `checksum`)
    20     4     crc32 of bytes 0..19 (the header itself)
    24     K     the page key
    24+K   N     the payload (opaque bytes: the client's serialized page)

A file whose header is malformed, whose size is not 24 + K + N, whose key is
not the one its name says, or whose key and payload do not match the crc32 is
corrupt: `read_page` returns None and the caller deletes it. The crc covers the
key as well as the payload, so a page's bytes filed under another key fail it
too. crc32 (zlib, about 1 GB/s) detects flipped bits and truncation; it is not a
defence against an attacker who can write the directory. Version 1 files (a crc
of the payload alone) read as corrupt and are removed at start.

Files are written to `<name>.<pid>.<thread>.tmp` and renamed into place, so a crash mid-write
leaves a temp file (removed at the next start), never a half page under a page
name. No fsync: the store is a cache; a page lost or torn by a power cut reads
as a miss.
"""
from __future__ import annotations

import os
import struct
import threading
import zlib
from pathlib import Path

MAGIC = b"RMKV"
VERSION = 2  # 2: the crc covers key ‖ payload (1: the payload alone)
_HEADER = struct.Struct("<4sHHQI")  # magic, version, key length, payload length, payload crc32
_HEADER_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size + _HEADER_CRC.size  # 24
SUFFIX = ".page"
TMP_SUFFIX = ".tmp"


def checksum(key: bytes, payload: bytes | memoryview) -> int:
    """crc32 of key ‖ payload: the page's bytes bound to the key they are stored under."""
    return zlib.crc32(payload, zlib.crc32(key))


def page_path(root: Path, key: bytes) -> Path:
    """<root>/<first byte hex>/<key hex>.page: 256 subdirectories keep listings short."""
    name = key.hex()
    return root / name[:2] / (name + SUFFIX)


def key_of_path(path: Path) -> bytes | None:
    """The key a page file's name claims, or None for a name that is not one."""
    if not path.name.endswith(SUFFIX):
        return None
    try:
        return bytes.fromhex(path.name[: -len(SUFFIX)])
    except ValueError:
        return None


def encode_header(key: bytes, payload_len: int, crc: int) -> bytes:
    head = _HEADER.pack(MAGIC, VERSION, len(key), payload_len, crc)
    return head + _HEADER_CRC.pack(zlib.crc32(head))


def decode_header(raw: bytes) -> tuple[int, int, int] | None:
    """(key length, payload length, payload crc) of a header, or None when malformed."""
    if len(raw) < HEADER_BYTES:
        return None
    head = raw[: _HEADER.size]
    (head_crc,) = _HEADER_CRC.unpack_from(raw, _HEADER.size)
    if zlib.crc32(head) != head_crc:
        return None
    magic, version, key_len, payload_len, crc = _HEADER.unpack(head)
    if magic != MAGIC or version != VERSION:
        return None
    return key_len, payload_len, crc


def write_page(path: Path, key: bytes, payload: bytes, crc: int) -> int:
    """Write one page atomically (temp file + rename); returns the file's size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Unique per writer: two threads spilling the same key never share a temp file.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
    with open(tmp, "wb") as f:
        f.write(encode_header(key, len(payload), crc))
        f.write(key)
        f.write(payload)
    os.replace(tmp, path)
    return HEADER_BYTES + len(key) + len(payload)


def scan_page(path: Path) -> int | None:
    """Cheap validity check for a restart: the header parses, names this file's
    key, and the file has exactly the size it announces. Returns the file size,
    or None when the file is corrupt (the payload's crc is checked on read)."""
    key = key_of_path(path)
    if key is None:
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES + len(key))
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return None
    parsed = decode_header(raw)
    if parsed is None:
        return None
    key_len, payload_len, _ = parsed
    if key_len != len(key) or raw[HEADER_BYTES:] != key or size != HEADER_BYTES + key_len + payload_len:
        return None
    return size


def read_page(path: Path, key: bytes) -> tuple[bytes, int] | None:
    """(payload, checksum) of a page file, or None when it is corrupt or truncated.

    Raises FileNotFoundError when there is no file (the caller's miss, not corruption).
    """
    with open(path, "rb", buffering=0) as f:  # unbuffered: the payload is read straight into its bytes
        raw = f.read(HEADER_BYTES + len(key))
        parsed = decode_header(raw)
        if parsed is None:
            return None
        key_len, payload_len, crc = parsed
        if key_len != len(key) or raw[HEADER_BYTES:] != key:
            return None
        if os.fstat(f.fileno()).st_size != HEADER_BYTES + key_len + payload_len:  # truncated or extended
            return None
        payload = f.read(payload_len)
    if len(payload) != payload_len or checksum(key, payload) != crc:
        return None
    return payload, crc

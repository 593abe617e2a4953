"""The on-disk formats of one block, named by its content hash in every tier.

In a raw tier (``Codec.RAW``) a block's file is its bare content: no
header, as long as the block. The kernel can then be handed the file of an
object that is one block (FUSE passthrough), and it takes the object's end
from the file's. The name is the proof of identity: the content is hashed
against it (``check_content``) before it is served.

In a compressed tier (``Codec.LZ4``), and inside a shared tier's blob, a
block is a frame, a fixed header then the payload:

    offset size field
    0      4    magic b"CFSB"
    4      1    format version (FORMAT_VERSION)
    5      1    codec: 0 raw, 1 lz4 frame
    6      2    reserved, zero
    8      8    raw length (bytes of the block's content)
    16     8    payload length (bytes that follow the header)
    24     16   xxh3_128 of the raw content, big-endian

All integers are big-endian. The hash is the block's name too, so a frame
proves its own identity: a torn write, a bit flip or a file renamed to the
wrong name fails ``decode``. Any change to this layout must bump
FORMAT_VERSION (a golden-bytes test enforces it); frames of another version
are treated as corrupt and re-fetched, never misread. Which of the two a
tier's files are is recorded by the index's schema version
(``index.SCHEMA_VERSION``): a cache written in another layout is set aside
whole, never read as this one.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import lz4.frame
import xxhash

MAGIC = b"CFSB"
FORMAT_VERSION = 1
_HEADER = struct.Struct(">4sBBHQQ16s")
HEADER_SIZE = _HEADER.size


class Codec(enum.IntEnum):
    """How a tier stores a block (``encode_file``): as bare content, or in a
    frame, lz4-compressed when that shrinks it. In a frame's header, how
    its payload is stored: as it is, or lz4-compressed."""

    RAW = 0
    LZ4 = 1


class CorruptBlock(Exception):
    """A block file that does not hold the content its name (or header) claims."""


def content_hash(data: bytes | bytearray | memoryview) -> str:
    """The name of a block: xxh3_128 of its content, as 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(data)


def content_hasher() -> xxhash.xxh3_128:
    """Hashes content fed in parts: its ``hexdigest()`` is ``content_hash``
    of the parts joined (a whole file, made of blocks)."""
    return xxhash.xxh3_128()


@dataclass(frozen=True, slots=True)
class Frame:
    """A block file's bytes in two parts, written with one ``writev``:
    joining them would copy a whole block to prepend 40 bytes. The header
    is empty for a raw tier's bare content."""

    header: bytes
    payload: bytes | bytearray

    @property
    def size(self) -> int:
        return len(self.header) + len(self.payload)

    def __bytes__(self) -> bytes:
        return self.header + self.payload


def encode(data: bytes | bytearray, codec: Codec = Codec.RAW, digest: str | None = None) -> Frame:
    """The frame for ``data``, whose ``content_hash`` is ``digest`` when the
    caller has it (a block is hashed once as it arrives). LZ4 is skipped
    when it does not shrink the block (already-compressed images, tensors):
    decoding it would be pure cost."""
    payload = data
    if codec is Codec.LZ4:
        compressed = lz4.frame.compress(data)
        if len(compressed) < len(data):
            payload = compressed
        else:
            codec = Codec.RAW
    hashed = xxhash.xxh3_128_digest(data) if digest is None else bytes.fromhex(digest)
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, codec, 0, len(data), len(payload), hashed)
    return Frame(header, payload)


def _payload(frame: bytes | memoryview, expected_hash: str) -> tuple[int, int, memoryview]:
    """(codec, raw length, payload) of ``frame`` once its header is checked."""
    if len(frame) < HEADER_SIZE:
        raise CorruptBlock("short header")
    magic, version, codec, _, raw_length, payload_length, digest = _HEADER.unpack_from(frame)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptBlock(f"unknown frame format {magic!r} v{version}")
    if digest.hex() != expected_hash:
        raise CorruptBlock("header hash does not match the block's name")
    payload = memoryview(frame)[HEADER_SIZE:]
    if len(payload) != payload_length:
        raise CorruptBlock(f"payload is {len(payload)} bytes, header says {payload_length}")
    return codec, raw_length, payload


def check_content(content: bytes | bytearray | memoryview, expected_hash: str) -> int:
    """Verify a raw tier's block, the bare content of its file, where it
    lies (a reader is then served from the file, without a copy); its length."""
    if content_hash(content) != expected_hash:
        raise CorruptBlock("content does not match its hash")
    return len(content)


def decode(frame: bytes, expected_hash: str) -> bytes:
    """The content of ``frame``, verified against its header and ``expected_hash``."""
    codec, raw_length, payload = _payload(frame, expected_hash)
    if codec == Codec.RAW:
        data = bytes(payload)
    elif codec == Codec.LZ4:
        try:
            data = lz4.frame.decompress(payload)
        except RuntimeError as exc:
            raise CorruptBlock(f"lz4: {exc}") from exc
    else:
        raise CorruptBlock(f"unknown codec {codec}")
    if len(data) != raw_length or content_hash(data) != expected_hash:
        raise CorruptBlock("content does not match its hash")
    return data


def encode_file(data: bytes | bytearray, codec: Codec, digest: str) -> Frame:
    """What a tier of ``codec`` writes as the file of block ``data``, whose
    ``content_hash`` is ``digest``: a raw tier its bare content, a
    compressed one its frame."""
    if codec is Codec.RAW:
        return Frame(b"", data)
    return encode(data, codec, digest)


def decode_file(contents: bytes, codec: Codec, digest: str) -> bytes:
    """The verified content of the file of block ``digest`` in a tier of ``codec``."""
    if codec is Codec.RAW:
        check_content(contents, digest)
        return contents
    return decode(contents, digest)

"""A block's file: a raw tier's is its bare content, a compressed tier's a
frame whose golden bytes pin the format; every kind of damage is caught."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachefsd.cache.codec import (
    FORMAT_VERSION,
    HEADER_SIZE,
    Codec,
    CorruptBlock,
    check_content,
    content_hash,
    decode,
    decode_file,
    encode,
    encode_file,
)

HELLO_HASH = content_hash(b"hello")
# The exact frame of b"hello". If this test fails, the on-disk format changed:
# bump FORMAT_VERSION (old caches are then re-fetched, never misread) and
# update the golden bytes.
GOLDEN_HELLO = (
    bytes.fromhex(
        "43465342"  # magic CFSB
        "01"  # format version
        "00"  # codec raw
        "0000"  # reserved
        "0000000000000005"  # raw length
        "0000000000000005"  # payload length
    )
    + bytes.fromhex(HELLO_HASH)
    + b"hello"
)


def test_golden_bytes_pin_the_format() -> None:
    assert FORMAT_VERSION == 1
    assert HEADER_SIZE == 40
    assert HELLO_HASH == "b5e9c1ad071b3e7fc779cfaa5e523818"
    assert bytes(encode(b"hello")) == GOLDEN_HELLO


@given(st.binary(max_size=4096), st.sampled_from(list(Codec)))
def test_round_trip(data: bytes, codec: Codec) -> None:
    assert decode(bytes(encode(data, codec)), content_hash(data)) == data


def test_lz4_is_used_when_it_shrinks_and_skipped_when_it_does_not() -> None:
    compressible = b"a" * 100_000
    assert encode(compressible, Codec.LZ4).size < 1000
    incompressible = random.Random(0).randbytes(1024)
    frame = bytes(encode(incompressible, Codec.LZ4))
    assert frame[5] == Codec.RAW
    assert decode(frame, content_hash(incompressible)) == incompressible


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda f: f[:-1], id="truncated payload"),
        pytest.param(lambda f: f[:10], id="truncated header"),
        pytest.param(lambda f: f[:-1] + bytes([f[-1] ^ 1]), id="flipped payload bit"),
        pytest.param(lambda f: b"XXXX" + f[4:], id="bad magic"),
        pytest.param(lambda f: f[:4] + bytes([FORMAT_VERSION + 1]) + f[5:], id="other version"),
        pytest.param(lambda f: f[:5] + b"\x07" + f[6:], id="unknown codec"),
        pytest.param(lambda f: f + b"x", id="trailing bytes"),
    ],
)
def test_damage_is_detected(damage: object) -> None:
    frame = bytes(encode(b"some block content" * 100, Codec.LZ4))
    with pytest.raises(CorruptBlock):
        decode(damage(frame), content_hash(b"some block content" * 100))  # type: ignore[operator]


@given(st.binary(max_size=4096), st.sampled_from(list(Codec)))
def test_a_tiers_file_round_trips_and_a_raw_tiers_is_the_bare_content(data: bytes, codec: Codec) -> None:
    """A raw tier's file holds exactly the block's bytes from offset 0: the
    kernel, handed it (FUSE passthrough), takes end of file from it."""
    digest = content_hash(data)
    contents = bytes(encode_file(data, codec, digest))
    if codec is Codec.RAW:
        assert contents == data
    else:
        assert contents == bytes(encode(data, codec, digest))
    assert decode_file(contents, codec, digest) == data


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda c: c[:-1], id="truncated"),
        pytest.param(lambda c: c[:-1] + bytes([c[-1] ^ 1]), id="flipped bit"),
        pytest.param(lambda c: c + b"x", id="trailing bytes"),
        pytest.param(lambda c: bytes(encode(c)), id="a frame of it"),
    ],
)
def test_damage_to_a_raw_tiers_file_is_detected_in_place(damage: object) -> None:
    content = random.Random(3).randbytes(5000)
    assert check_content(memoryview(bytearray(content)), content_hash(content)) == len(content)
    with pytest.raises(CorruptBlock):
        check_content(memoryview(damage(content)), content_hash(content))  # type: ignore[operator]
    with pytest.raises(CorruptBlock):
        decode_file(damage(content), Codec.RAW, content_hash(content))  # type: ignore[operator]


def test_a_frame_under_the_wrong_name_is_rejected() -> None:
    with pytest.raises(CorruptBlock):
        decode(bytes(encode(b"hello")), content_hash(b"world"))

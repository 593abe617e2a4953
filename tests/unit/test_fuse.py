"""The FUSE edge without a mount: the messages ``protocol`` packs and
parses, and the judging of a mount's opens (``passthrough.OpenSizes``).
The passthrough rules of each open are the native plane's, tested by
``cargo test`` (``native/src/opens.rs``)."""

from __future__ import annotations

from cachefsd.fuse import protocol
from cachefsd.fuse.passthrough import JUDGED_OPENS, OpenSizes

ATTR = protocol.Attr(ino=77, size=1000, mtime=1.5, mode=0o100444, nlink=1, uid=10, gid=20)


def offer(flags: int, minor: int = 45) -> protocol.InitOffer:
    low, high = flags & 0xFFFFFFFF, flags >> 32
    body = protocol.INIT_IN.pack(7, minor, 128 << 10, low | protocol.INIT_EXT, high)
    return protocol.parse_init(memoryview(body + bytes(44)))


def test_init_asks_for_passthrough_only_where_offered_and_says_its_depth() -> None:
    wanted = protocol.ASYNC_READ | protocol.PASSTHROUGH
    fields = protocol.INIT_OUT.unpack(
        protocol.pack_init(offer(protocol.ASYNC_READ | protocol.PASSTHROUGH), wanted, 2)
    )
    flags, flags2, depth = fields[3], fields[10], fields[11]
    assert flags == protocol.ASYNC_READ | protocol.INIT_EXT
    assert flags2 << 32 == protocol.PASSTHROUGH
    assert depth == 2
    assert fields[1] == protocol.MINOR  # the kernel's 45 is newer than ours
    assert fields[8] == protocol.MAX_PAGES_COUNT

    fields = protocol.INIT_OUT.unpack(protocol.pack_init(offer(protocol.ASYNC_READ, minor=38), wanted, 2))
    assert fields[1] == 38  # an older kernel's version
    assert fields[10] == 0  # not offered: not asked for
    assert fields[11] == 0  # and no stack depth without it


def test_an_init_without_its_extension_flag_has_no_high_flags() -> None:
    body = protocol.INIT_IN.pack(7, 45, 0, protocol.ASYNC_READ, 0xFFFFFFFF)
    assert protocol.parse_init(memoryview(body)).flags == protocol.ASYNC_READ


def test_an_entry_carries_its_node_timeouts_and_attributes() -> None:
    packed = protocol.pack_entry(5, ATTR, 1.25)
    assert protocol.ENTRY_OUT.unpack_from(packed) == (5, 0, 1, 1, 250_000_000, 250_000_000)
    attr = protocol.ATTR.unpack_from(packed, protocol.ENTRY_OUT.size)
    assert attr[:3] == (77, 1000, 2)  # ino, size, 512-byte blocks rounded up
    assert (attr[4], attr[7]) == (1, 500_000_000)  # mtime
    assert attr[9:13] == (0o100444, 1, 10, 20)


def test_an_answer_states_its_length_and_an_error_its_negative_errno() -> None:
    parts = protocol.reply(42, b"abc", memoryview(b"defg"))
    length, error, unique = protocol.OUT_HEADER.unpack(parts[0])
    assert (length, error, unique) == (protocol.OUT_HEADER.size + 7, 0, 42)
    assert protocol.OUT_HEADER.unpack(protocol.error(43, 5)) == (protocol.OUT_HEADER.size, -5, 43)


def test_an_invalidation_names_its_entry_with_a_terminating_nul() -> None:
    message = protocol.pack_inval_entry(1, b"img.jpg")
    length, code, unique = protocol.OUT_HEADER.unpack_from(message)
    assert (length, code, unique) == (len(message), protocol.NOTIFY_INVAL_ENTRY, 0)
    parent, namelen, _ = protocol.NOTIFY_INVAL_ENTRY_OUT.unpack_from(message, protocol.OUT_HEADER.size)
    assert (parent, namelen) == (1, 7)
    assert message.endswith(b"img.jpg\0")


def test_a_mount_of_small_files_gives_up_open_requests_once_judged() -> None:
    sizes = OpenSizes(read_size=1 << 20)
    verdicts = [sizes.opened(100 << 10) for _ in range(JUDGED_OPENS)]
    assert verdicts[:-1] == [None] * (JUDGED_OPENS - 1)
    assert verdicts[-1] is False  # images: no-open costs fewer requests
    assert not sizes.judging
    assert sizes.opened(32 << 20) is None  # judged once, for good


def test_a_mount_of_files_larger_than_a_read_keeps_open_requests() -> None:
    sizes = OpenSizes(read_size=1 << 20)
    verdicts = [sizes.opened((32 << 20) if number % 2 else (1 << 20)) for number in range(JUDGED_OPENS)]
    assert verdicts[-1] is True  # half of them larger than a read: passthrough saves requests

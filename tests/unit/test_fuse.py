"""The FUSE edge without a mount: the messages ``protocol`` packs and
parses, and the passthrough rules of ``passthrough.Opens``."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from cachefsd.cache.blocks import WholeFile
from cachefsd.fuse import protocol
from cachefsd.fuse.passthrough import JUDGED_OPENS, Opens, OpenSizes, Through

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


def test_directory_entries_are_padded_to_eight_bytes_and_name_their_type() -> None:
    for name in (b"a", b"abcdefgh", b"x" * 13):
        packed = protocol.pack_direntplus(9, ATTR, 1.0, name, 3)
        assert len(packed) == protocol.direntplus_size(name)
        assert len(packed) % 8 == 0
        start = protocol.ENTRY_OUT.size + protocol.ATTR.size
        ino, offset, namelen, kind = protocol.DIRENT.unpack_from(packed, start)
        assert (ino, offset, namelen, kind) == (77, 3, len(name), 8)  # DT_REG
        assert packed[start + protocol.DIRENT.size :][: len(name)] == name


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


class Backing:
    """Backing ids as the kernel hands them out: counted up, each closed once."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.open_ids: set[int] = set()
        self.registered = 0

    def register(self, fd: int) -> int:
        os.fstat(fd)  # the descriptor is still open when registered
        if self.refuse:
            raise PermissionError(1, "Operation not permitted")
        self.registered += 1
        self.open_ids.add(self.registered)
        return self.registered

    def unregister(self, backing_id: int) -> None:
        self.open_ids.remove(backing_id)


@pytest.fixture
def cache_file(tmp_path: Path) -> Path:
    path = tmp_path / "block"
    path.write_bytes(b"x" * 100)
    return path


def whole(path: Path) -> WholeFile:
    return WholeFile(os.open(path, os.O_RDONLY), "hot", 100)


def test_opens_of_a_cached_file_share_one_backing_id_closed_at_the_last_release(cache_file: Path) -> None:
    backing = Backing()
    opens = Opens(backing)
    first = opens.open(7, lambda: whole(cache_file))
    second = opens.open(7, lambda: whole(cache_file))
    assert first == second == Through(1, "hot")
    assert backing.registered == 1
    opens.release(7, through=True)
    assert backing.open_ids == {1}  # one open left
    opens.release(7, through=True)
    assert backing.open_ids == set()
    assert opens.open(7, lambda: whole(cache_file)) == Through(2, "hot")  # a new id after the last release


def test_an_inode_open_in_cached_mode_gets_no_passthrough_until_all_its_opens_close(cache_file: Path) -> None:
    backing = Backing()
    opens = Opens(backing)
    assert opens.open(7, lambda: None) is None  # being read cold
    asked = []
    assert opens.open(7, lambda: asked.append(1) or whole(cache_file)) is None  # cached by now, still not
    assert asked == []  # the rule decided: the cache was not asked
    opens.release(7, through=False)
    opens.release(7, through=False)
    assert opens.open(7, lambda: whole(cache_file)) == Through(1, "hot")


def test_an_inode_in_passthrough_stays_there_when_its_file_left_the_cache(cache_file: Path) -> None:
    backing = Backing()
    opens = Opens(backing)
    assert opens.open(7, lambda: whole(cache_file)) == Through(1, "hot")
    assert opens.open(7, lambda: None) == Through(1, "hot")  # evicted: the id still holds the file


def test_opens_say_whether_any_inode_is_in_passthrough(cache_file: Path) -> None:
    """A mount that gives passthrough up answers OPEN until none is."""
    opens = Opens(Backing())
    assert not opens.passing_through()
    assert opens.open(7, lambda: None) is None
    assert not opens.passing_through()  # a cached open only
    assert opens.open(8, lambda: whole(cache_file)) == Through(1, "hot")
    assert opens.passing_through()
    opens.release(8, through=True)
    assert not opens.passing_through()


def test_a_refused_backing_file_makes_a_cached_open_and_leaks_no_descriptor(cache_file: Path) -> None:
    opens = Opens(Backing(refuse=True))
    handed: list[int] = []

    def found() -> WholeFile:
        file = whole(cache_file)
        handed.append(file.fd)
        return file

    assert opens.open(7, found) is None
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(handed[0])


def test_concurrent_opens_and_releases_keep_the_counts(cache_file: Path) -> None:
    backing = Backing()
    opens = Opens(backing)
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            for _ in range(200):
                through = opens.open(7, lambda: whole(cache_file))
                assert through is not None
                opens.release(7, through=True)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors
    assert backing.open_ids == set()  # every id closed once, none left open


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

"""Which keys become paths, and what a listing looks like as a directory."""

from __future__ import annotations

import pytest

from cachefsd.namespace.names import directory_from_listing, inode_number, is_valid_name
from cachefsd.store.base import Listing, ObjectInfo


def info(key: str) -> ObjectInfo:
    return ObjectInfo(key=key, size=1, etag="e", mtime=0.0)


@pytest.mark.parametrize("name", ["a", "with space", "ünïcødé", "x" * 255, "é" * 127, ".hidden", "..."])
def test_valid_names(name: str) -> None:
    assert is_valid_name(name)


@pytest.mark.parametrize(
    "name", ["", ".", "..", "a\0b", "a/b", "x" * 256, "é" * 128, "bad\udcff\udcfename.bin"]
)
def test_invalid_names(name: str) -> None:
    assert not is_valid_name(name)


def test_directory_wins_over_an_object_of_the_same_name() -> None:
    listing = Listing(objects=(info("p/x"), info("p/y")), prefixes=("p/x/",))
    directory = directory_from_listing("p/", listing)
    assert directory.entries == {"x": None, "y": info("p/y")}
    assert (directory.hidden, directory.shadowed) == (0, 1)  # counted, so the daemon logs it


def test_marker_and_escaping_keys_are_not_entries() -> None:
    listing = Listing(
        objects=(info("p/"), info("p/.."), info("p/."), info("p/ok")),
        prefixes=("p//", "p/../", "p/sub/"),
    )
    directory = directory_from_listing("p/", listing)
    assert directory.entries == {"ok": info("p/ok"), "sub": None}
    assert directory.hidden == 4


def test_inode_numbers_are_stable_distinct_and_never_0_or_1() -> None:
    paths = ["/", "/a", "/a/b", "/b", "/a/b/c.jpg", "/ünïcødé"] + [f"/d/{i}" for i in range(10_000)]
    numbers = [inode_number(path) for path in paths]
    # The same in every process and release, so a remount keeps them: pinned.
    assert numbers[:2] == [5134827694651168304, 7102927890839267337]
    assert len(set(numbers)) == len(paths)
    assert all(2 <= number < 1 << 63 for number in numbers)

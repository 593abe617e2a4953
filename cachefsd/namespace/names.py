"""Which object keys may become paths, and how a listing becomes a directory.

A bucket key is an arbitrary string; a path component is not. A key is
exposed only if every segment between slashes is a valid file name: not
empty (``a//b``, ``/abs``), not ``.`` or ``..``, no NUL, valid UTF-8 (a
local directory may hold other bytes; the index, like a bucket, holds
text), at most 255 bytes in UTF-8 (NAME_MAX). Other keys are hidden, never rewritten, so a path can
never point outside the bucket prefix or collide with another key.

When a key is both an object and a prefix (``x`` and ``x/y``), the directory
wins and the object ``x`` is hidden, as in Mountpoint for S3: a directory
hides a whole subtree, and losing it would lose more than losing one file.
A directory-marker object (``dir/``) only makes ``dir`` exist.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from cachefsd.store.base import Listing, ObjectInfo

NAME_MAX = 255


def is_valid_name(name: str) -> bool:
    try:
        encoded = name.encode("utf-8")  # undecodable bytes of a local name are surrogates here
    except UnicodeEncodeError:
        return False
    return name not in ("", ".", "..") and "\0" not in name and "/" not in name and len(encoded) <= NAME_MAX


@dataclass(frozen=True, slots=True)
class Directory:
    """The entries of one directory: name -> object, or None for a subdirectory."""

    entries: dict[str, ObjectInfo | None]
    hidden: int  # keys under this prefix that cannot be paths
    shadowed: int  # objects named as a subdirectory here (the directory wins)


def directory_from_listing(prefix: str, listing: Listing) -> Directory:
    entries: dict[str, ObjectInfo | None] = {}
    hidden = shadowed = 0
    for common in listing.prefixes:
        name = common[len(prefix) : -1]
        if is_valid_name(name):
            entries[name] = None
        else:
            hidden += 1
    for info in listing.objects:
        name = info.key[len(prefix) :]
        if name == "":
            continue  # the directory's own marker object
        if not is_valid_name(name):
            hidden += 1
        elif name in entries:
            shadowed += 1
        else:
            entries[name] = info
    return Directory(entries=entries, hidden=hidden, shadowed=shadowed)


def inode_number(path: str) -> int:
    """The inode number of the file or directory at ``path`` (``/a/b``): a hash of the
    path, so that it stays the same when the kernel forgets the inode and
    looks it up again (the kernel's node numbers then change: tools that key on
    device and inode saw a new file), and in directory listings. Never 0 or
    1, which some tools read as "no inode"; 63 bits, as signed 64-bit readers
    expect."""
    return 2 + xxhash.xxh3_64_intdigest(path.encode("utf-8", "surrogateescape")) % ((1 << 63) - 2)


def split_path(path: str) -> list[str]:
    """``/a/b`` -> ``["a", "b"]``; the FUSE layer hands us normalised absolute paths."""
    return [part for part in path.split("/") if part]


def dir_prefix(parts: list[str]) -> str:
    """The key prefix of the directory at ``parts``: ``""`` for the root, else ``a/b/``."""
    return "".join(part + "/" for part in parts)

"""A level of the block cache, and what passes between levels.

A block is looked for in levels, nearest first, and composed by one object
(``layered.py``): the decoded blocks reads were served lately, in RAM
(``recent.py``); the local tiers, hot and warm (``tiered.py``); the tier
all nodes share, in a bucket (``shared.py``). The reader fetches what no
level holds from the origin and puts it into every level. Each level is a
``BlockCache`` (after Mountpoint's ``DataCache``): get a block or nothing,
put a block with what its policy needs to know (``Use``).

A level never fails a read: a block it cannot serve (absent, damaged, its
disk or bucket failing) is a miss, logged and counted, and the next level
or the origin serves it. A block is always found through its object
version (``Version``): bytes cached for one version are never served for
another.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from cachefsd.cache.index import BlockRef
from cachefsd.fetch import FetchKind
from cachefsd.store.base import ObjectInfo


@dataclass(slots=True)  # not frozen: one is made on every read of a raw block, frozen ones cost 3x
class FileSpan:
    """Bytes of a block that lie in a cached block file: the FUSE layer
    reads them from the descriptor straight into its answer. The
    receiver owns ``fd`` and must close it. Measured like bytes; a part of
    it is the same descriptor, further in (``part``)."""

    fd: int
    offset: int
    length: int

    def __len__(self) -> int:
        return self.length

    def part(self, start: int, end: int) -> FileSpan:
        """Its bytes ``[start, end)``, as ``content[start:end]`` of bytes."""
        return FileSpan(self.fd, self.offset + start, end - start)


@dataclass(frozen=True, slots=True)
class WholeFile:
    """A cached object whose whole content is one raw file (its one block,
    or its whole file, ``index.WHOLE``), for the
    kernel to serve its reads from (FUSE passthrough): ``fd``, open
    read-only, is a verified file that holds exactly the object's ``size``
    bytes from offset 0; the receiver owns it and must close it. ``tier``
    names the tier it lies in (reads the daemon no longer sees are counted
    by tier)."""

    fd: int
    tier: str
    size: int


# A block's content: bytes (a bytearray as a fetch brings it), or where it
# lies in a raw block file.
Content = bytes | bytearray | FileSpan


class Block(NamedTuple):  # a tuple: made on every hit, at a third of a frozen dataclass's cost
    """A block found: its content hash, its content, and the level it came
    from (``memory``, a tier's name, ``shared``, or ``cold`` for the
    origin), which its read reports."""

    digest: str
    content: Content
    level: str


def block_ref(source: str, info: ObjectInfo, index: int) -> BlockRef:
    """Block ``index`` of version ``info`` of an object of ``source``, as the
    index names it: by version, so bytes of one are never another's."""
    return BlockRef(source, info.key, info.etag, index)


class Version(NamedTuple):  # a tuple: made on every read, at a third of a frozen dataclass's cost
    """One version of one object as the cache keys its blocks: of
    ``size`` bytes, cut into blocks of ``block_size``. ``content_etag``
    when its etag (with its size) identifies its content, so that a block
    of another object with the same identity may serve it (dedup by etag)."""

    source: str
    key: str
    etag: str
    size: int
    block_size: int
    content_etag: bool

    def ref(self, index: int) -> BlockRef:
        return BlockRef(self.source, self.key, self.etag, index)

    def length(self, index: int) -> int:
        """Bytes in block ``index`` (the last one is shorter)."""
        return min(self.block_size, self.size - index * self.block_size)

    @property
    def identity(self) -> tuple[str, int] | None:
        """The content identity (etag, size) its blocks are recorded under, if any."""
        return (self.etag, self.size) if self.content_etag else None


@dataclass(frozen=True, slots=True)
class Use:
    """Why a block is wanted, as a level's policy and priorities need it:
    ``kind`` the priority of the requests it costs (a reader waits on
    "demand", nobody yet on "prefetch"); ``ahead`` when no read asked for it
    yet (prefetch, stage), so a policy does not count it as read;
    ``next_use`` when a plan says when it will be read; ``tier`` the local
    tier a stage asked for."""

    kind: FetchKind = "demand"
    ahead: bool = False
    next_use: float | None = None
    tier: str | None = None


FOR_A_READ = Use()


class BlockCache(Protocol):
    """One level of the block cache. Thread-safe; no method raises for a
    failing level (a miss, counted), except ``put_many`` of a level that
    writes synchronously, whose caller must know (a fleet stage)."""

    @property
    def remote(self) -> bool:
        """Whether looking costs a request (a bucket): such a level is
        asked only for blocks no other level holds, once for all the
        readers of a block, a run's blocks at once (``get_many``), and takes
        a fetch's blocks together once it is done (``put_many``)."""
        ...

    def get(self, version: Version, index: int, use: Use) -> Block | None:
        """Block ``index`` of ``version``, verified, or None; a hit counts
        as a read in the level's policy."""
        ...

    def get_many(self, version: Version, indices: Sequence[int], use: Use) -> dict[int, Block]:
        """The blocks of ``indices`` the level holds, by index."""
        found = {}
        for index in indices:
            block = self.get(version, index, use)
            if block is not None:
                found[index] = block
        return found

    def put(self, version: Version, index: int, digest: str, content: bytes | bytearray, use: Use) -> bool:
        """Keep ``content`` (whose hash ``digest`` the caller computed) as
        block ``index`` of ``version``, if the level's policy makes room;
        whether the level now serves it in place (a raw file read without
        a copy), so the levels before it need no copy."""
        ...

    def put_many(
        self, version: Version, blocks: Mapping[int, tuple[str, bytes | bytearray]], use: Use
    ) -> None:
        """``put`` of several blocks (index -> hash, content)."""
        for index, (digest, content) in blocks.items():
            self.put(version, index, digest, content, use)

    def served(self, version: Version, index: int, block: Block) -> bool:
        """A read was served ``block`` without this level (from a level
        before it, or a fetch): its policy counts the read, or, for RAM,
        it keeps what was read. Whether it serves the block in place, as
        ``put``."""
        ...

    def residency(self, version: Version, index: int) -> str | None:
        """The name of where the level holds the block (a tier, "shared"),
        without reading it; None if it does not, or holds it only in RAM."""
        ...

    def forget(self, version: Version) -> None:
        """``version`` no longer exists upstream: drop what only it used."""
        ...

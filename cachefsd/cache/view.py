"""The tiered cache as seen from one source: its blocks by object version
and index, for the layers beside the read path.

The prefetcher (``prefetch.prefetcher.CachedBlocks``), staging
(``stage.Resident``) and the filesystem (``fs.CacheDisk``) each say in a
protocol of their own what they ask of the cache: whether a block is
cached and where, plans for its next read, loading it into RAM ahead of
that read, room, and the file of an object cached whole in one raw file.
``CacheView`` answers all of them over the one ``TieredCache`` a
node shares, naming a block as the read path does: (source, key, etag,
index), so a version's blocks are never another's. It holds no state of
its own; thread-safe as the cache is.

That one raw file is the object's only block, or, for an object larger
than a block, its whole file (``index.WHOLE``): made of its blocks in the
background (``whole.WholeFiles``) once a read reached its end, and from
then on what the view names for each of its blocks. The prefetcher plans
and warms the whole file, which passthrough opens read, not the blocks,
which nothing reads any more and which the policy may then evict first.
"""

from __future__ import annotations

from pathlib import Path

from cachefsd.cache.blocks import Use, Version, WholeFile, block_ref
from cachefsd.cache.codec import content_hash
from cachefsd.cache.index import WHOLE
from cachefsd.cache.tiered import TieredCache
from cachefsd.cache.whole import WholeFiles, worth_whole_file
from cachefsd.store.base import ObjectInfo

# Blocks of a file written through the mount: nobody read them yet.
_WRITTEN = Use(ahead=True)


class CacheView:
    """The blocks of ``source``'s objects, cut at ``block_size``, in
    ``cache``; the whole files of the larger ones made by ``whole_files``."""

    def __init__(self, source: str, cache: TieredCache, block_size: int, whole_files: WholeFiles) -> None:
        self._source = source
        self._cache = cache
        self._block_size = block_size
        self._whole_files = whole_files
        # Whether the kernel reads cache files through the page cache
        # (passthrough is on; the FUSE edge says, through ``fs``). Else
        # the native plane reads a verified raw file past the page cache
        # (O_DIRECT): its pages warmed would be read from disk twice.
        self.page_warming = True

    def digest(self, info: ObjectInfo, index: int) -> str | None:
        """The content hash cached for block ``index`` of ``info``, or None:
        its whole file's when it has one (which holds that block's bytes)."""
        return self._whole_digest(info) or self._cache.lookup(block_ref(self._source, info, index))

    def _whole_digest(self, info: ObjectInfo) -> str | None:
        """The content hash of ``info``'s whole file, or None."""
        if not worth_whole_file(info.size, self._block_size):
            return None
        return self._cache.lookup(block_ref(self._source, info, WHOLE))

    def residency(self, info: ObjectInfo, index: int) -> str | None:
        """The tier holding block ``index`` of ``info``, or None."""
        digest = self.digest(info, index)
        return None if digest is None else self._cache.tier_of(digest)

    def plan(self, info: ObjectInfo, index: int, position: float) -> str | None:
        """Plan cached block ``index`` of ``info`` to be read next at
        ``position``; its hash, or None if it is not cached."""
        digest = self.digest(info, index)
        return digest if digest is not None and self._cache.plan(digest, position) else None

    def unplan(self, digest: str) -> None:
        """Block ``digest`` is no longer planned (read, or the plan changed)."""
        self._cache.unplan(digest)

    def warm(self, info: ObjectInfo, index: int, hold: bool = False) -> bool:
        """Start loading cached block ``index`` of ``info`` from the cache
        disk into the page cache (its part of the whole file, if there is
        one); False if it is not cached. With ``hold`` its read is due next
        and reuses the descriptor (``Tier.warm``)."""
        whole = self._whole_digest(info)
        if whole is not None:
            offset = index * self._block_size
            if self._worth_warming(whole):
                self._cache.warm(whole, hold, offset, min(self._block_size, info.size - offset))
            return True
        digest = self.digest(info, index)
        if digest is None:
            return False
        if self._worth_warming(digest):
            self._cache.warm(digest, hold)
        return True

    def _worth_warming(self, digest: str) -> bool:
        """Whether block ``digest``'s pages are read through the page cache
        (``page_warming``): not a verified raw file the native plane reads."""
        return self.page_warming or self._cache.verified_file(digest) is None

    def warm_file(self, info: ObjectInfo) -> None:
        """Start loading the file ``whole_file`` would hand over for
        ``info`` (a lookup is how the kernel opens it), if it is cached, its
        descriptor held for that open: the object's one block, or its whole
        file. A larger object's block files are not: its first read may
        not be at offset 0 (a footer)."""
        if 0 < info.size <= self._block_size:
            self.warm(info, 0, hold=True)
            return
        whole = self._whole_digest(info)
        if whole is not None and self._worth_warming(whole):
            self._cache.warm(whole, hold=True)

    def read_to_end(self, info: ObjectInfo) -> None:
        """A read reached the end of ``info``: if it is larger than a block
        and has no whole file, have one made (in the background), which
        ``whole_file`` then hands over."""
        if worth_whole_file(info.size, self._block_size) and self._whole_digest(info) is None:
            version = Version(self._source, info.key, info.etag, info.size, self._block_size, False)
            self._whole_files.want(version)

    def raw_files(self, info: ObjectInfo, indices: range) -> list[tuple[int, str, int, int, int, int, str]]:
        """The blocks of ``indices`` of ``info`` that lie in raw files this
        process verified, as (index, path, offset of the block in the file,
        the file's device, inode and ctime in ns, tier): its whole file's
        place for each block when it has one."""
        whole_digest = self._whole_digest(info)
        whole = None if whole_digest is None else self._cache.verified_file(whole_digest)
        files = []
        for index in indices:
            found, offset = whole, index * self._block_size
            if found is None:
                digest = self._cache.lookup(block_ref(self._source, info, index))
                found, offset = None if digest is None else self._cache.verified_file(digest), 0
            if found is not None:
                tier, path, (dev, ino, ctime_ns) = found
                files.append((index, str(path), offset, dev, ino, ctime_ns, tier))
        return files

    def count_read(self, info: ObjectInfo, index: int) -> None:
        """A read of block ``index`` of ``info`` served from its raw file
        without the cache (the native plane): the tier's policy counts it."""
        digest = self.digest(info, index)
        if digest is not None:
            self._cache.touch(digest)

    def whole_file(self, info: ObjectInfo) -> WholeFile | None:
        """The file of exactly ``info``'s bytes in a raw tier, if there is
        one: its one block's (not empty), or its whole file (``WHOLE``).
        Served as a read of a block is (``raw_hit``): verified before its
        first handover by this process and whenever the file changes,
        counted as a read by the tier's policy, dropped if corrupt (then
        None)."""
        digest = self._whole_file_digest(info)
        hit = None if digest is None else self._cache.raw_hit(digest)
        if hit is None:
            return None
        tier, fd = hit
        return WholeFile(fd, tier, info.size)

    def whole_place(self, info: ObjectInfo) -> tuple[str, int, int, int, str] | None:
        """Where the file ``whole_file`` hands over lies, as this process
        verified it, for the native plane to hand over itself: (path, its
        device, inode and ctime in ns, tier); None if there is none yet."""
        digest = self._whole_file_digest(info)
        found = None if digest is None else self._cache.verified_file(digest)
        if found is None:
            return None
        tier, path, (dev, ino, ctime_ns) = found
        return str(path), dev, ino, ctime_ns, tier

    def count_whole_read(self, info: ObjectInfo) -> None:
        """The native plane handed ``info``'s whole file over (as
        ``whole_file`` would): the tier's policy counts the read."""
        digest = self._whole_file_digest(info)
        if digest is not None:
            self._cache.touch(digest)

    def _whole_file_digest(self, info: ObjectInfo) -> str | None:
        """The content hash of the file of exactly ``info``'s bytes: its
        one block's, or its whole file's; None if not cached so."""
        if info.size == 0:
            return None
        if worth_whole_file(info.size, self._block_size):
            return self._whole_digest(info)
        # Never block 0 of a larger object: the kernel would end the file there.
        return self._cache.lookup(block_ref(self._source, info, 0))

    def admit_file(self, info: ObjectInfo, path: Path) -> None:
        """Cache the file at ``path``, which holds exactly version ``info``'s
        bytes (a staged file just uploaded), as its blocks: read back on
        this node, it costs no GET. Admitted as not yet read, like a
        prefetch, so the policy weighs it against what readers use."""
        version = Version(self._source, info.key, info.etag, info.size, self._block_size, False)
        with path.open("rb", buffering=0) as file:
            for index in range(-(-info.size // self._block_size)):
                data = file.read(version.length(index))
                if len(data) != version.length(index):
                    raise OSError(f"{path} is shorter than the {info.size} bytes uploaded")
                self._cache.put(version, index, content_hash(data), data, _WRITTEN)

    def room(self, next_use: float | None = None, wanted: int | None = None) -> int:
        """Bytes the cache would keep of blocks fetched ahead now (planned to
        be read at ``next_use``, if known), counted until ``wanted`` bytes
        are found; fetching more than that only spends bandwidth on blocks
        it would refuse."""
        return self._cache.room(next_use, wanted)

    def usage(self) -> tuple[int, int]:
        """The cache's capacity and the bytes it holds (all sources')."""
        return self._cache.capacity, self._cache.used_bytes

"""The tiered block cache: hot (fast disk, each block's bare content in a file)
and warm (larger disk, lz4 frames), or a single tier, over one index. It is
the local level of the block cache (``blocks.BlockCache``): a raw block is
served in place, as a span of its file, or for an object that is one block,
as the whole file (``view.CacheView.whole_file``, for FUSE passthrough); a
compressed one decoded (once for its concurrent readers), and a block of
another object with the same content identity is adopted instead of fetched.

Whole files: an object larger than a block whose blocks all lie in raw
tiers may be given one raw file of all its bytes (``assemble_whole``),
for passthrough too. It is an entry of its tier like a block (named by
its content's hash, verified as one, admitted by the tier's policy),
recorded under block number ``index.WHOLE``; evicted, it is dropped, never
demoted (its blocks hold the same bytes), and the lz4 and shared tiers
never hold one.

Movement: a new block enters the fastest tier whose policy makes room for
it; a block evicted from a tier is demoted to the next one instead of being
dropped, and leaves the last tier for good. A hit in a slower tier promotes
the block when the fastest tier's policy makes room for it, which with the
epoch-aware policy means only in place of blocks already consumed this
epoch. Identical content is stored once (blocks are named by their hash) and
referenced from every (source, key, etag, block) that holds it.

Crash safety: a block's file is written to a temp file and renamed into its
tier before the index names it there (a whole file too: assembled in the
tier's tmp, renamed, then recorded); a moved block is written to its new
tier, re-homed in the index, and only then deleted from the old one; an
evicted block leaves the index before its file goes. Whether a victim is a
whole file is read from its references in the index (``Index.is_whole``),
so it holds after a restart with no state of its own.
``maintenance.reconcile`` at start-up deletes temp files, files the index
does not place in that tier, rows whose file is missing or of the wrong
size, and unreferenced blocks. Every file is named by its content's hash and
verified against it when read back (a raw one on its first read by this
process, and again whenever the file changes), so nothing a ``kill -9`` or a
power loss leaves behind can be served.

The cache is advisory: a failing tier (disk full, I/O error, an index on a
full disk) is logged, counted, and turned into a miss or a skipped
admission, never into a failed read.

Concurrency: ``_move_lock`` serialises everything that adds bytes to a tier
(admission, promotion, demotion), so a tier's victims are gone before its
newcomer is written and capacities hold at every moment. Reads take no lock
but the tiers' own; nor does ``assemble_whole`` while it reads and writes,
only to admit the file it wrote. Lock order: ``_move_lock``, a tier's lock, the index's.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal, Protocol, TypeVar

from cachefsd.cache.blocks import Block, BlockCache, FileSpan, Use, Version
from cachefsd.cache.codec import Codec, CorruptBlock, content_hasher, decode_file, encode_file
from cachefsd.cache.index import WHOLE, BlockRef, Index, IndexDamaged, StoredBlock
from cachefsd.cache.policy import PlannedUse
from cachefsd.cache.tier import NoRoom, Tier, UnplaceableBlock, disk_bytes
from cachefsd.errors import NoSpace
from cachefsd.singleflight import SingleFlight

log = logging.getLogger(__name__)

# What a failing cache disk raises: the filesystem's errors, and sqlite's when
# the index, which lives on a cache disk, cannot be written (SQLITE_FULL,
# SQLITE_IOERR). Both are turned into a miss, never into a failed read.
_DISK_ERRORS = (OSError, sqlite3.Error)

# Raw block files remembered as checked (``raw_hit``), the most recently
# served: 128 GiB of 4 MiB blocks in about 9 MiB of RAM. Past it, a block is
# checked again on its next read, which for small blocks (a file of a sample
# each) costs little next to the read itself.
CHECKED_FILES_REMEMBERED = 1 << 15
# The buffer a thread keeps for checking raw files: a default block, read
# and hashed in one system call. A larger file (a larger block, a whole
# file of any size) is read through it a part at a time: a buffer of each
# file's size held 704 MiB in 11 threads for the daemon's life at 64 MiB
# blocks, and a whole file may be many GiB.
CHECK_BUFFER_BYTES = 4 << 20
# A tier whose disk failed a write takes no blocks (and offers no room to
# prefetch) for this long, then is tried again: a read-only or vanished
# disk made prefetch fetch the same blocks over and over, 1.2 GB in 10 s,
# with a warning for each.
DISK_ERROR_BACKOFF_SECONDS = 30.0
# How long a read waits for another thread's read and decode of the same
# compressed block: as long as a read may wait for the origin (the default
# fetch deadline), which a disk that answers at all never comes near.
DECODE_WAIT_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class CacheTuning:
    """The numbers above, as one cache uses them (tests pass their own)."""

    checked_files_remembered: int = CHECKED_FILES_REMEMBERED
    disk_error_backoff_seconds: float = DISK_ERROR_BACKOFF_SECONDS
    decode_wait_seconds: float = DECODE_WAIT_SECONDS


DedupWhere = Literal["disk", "wire"]
T = TypeVar("T")


class CacheEvents(Protocol):
    """What the cache reports (metrics.py implements it)."""

    def tier_usage(self, tier: str, used_bytes: int, capacity_bytes: int, blocks: int) -> None: ...
    def tier_read(self, tier: str, nbytes: int) -> None: ...
    def block_evicted(self, tier: str) -> None: ...
    def block_moved(self, direction: Literal["promotion", "demotion"]) -> None: ...
    def block_corrupt(self, tier: str) -> None: ...
    def cache_error(self, tier: str) -> None: ...
    def dedup_saved(self, where: DedupWhere, nbytes: int) -> None: ...
    def whole_file_made(self, tier: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Placement:
    tier: str
    raw: bool  # stored as bare content: servable from the file without copying


def _file_identity(stat: os.stat_result) -> tuple[int, int, int]:
    """What changes when a file is written to or replaced: its device and
    inode, and its ctime, which every write, truncation or rename sets to
    now and no user can set back."""
    return stat.st_dev, stat.st_ino, stat.st_ctime_ns


def _check_file(fd: int, buffer: bytearray, file_size: int, digest: str) -> int:
    """Verify a raw file of ``file_size`` bytes open as ``fd`` (a block's,
    or a whole file's), read through ``buffer`` a part at a time: all of
    it, not only the block's length. A file longer than its block, its
    block's bytes first, would pass the hash, and a kernel handed the file
    (``view.CacheView.whole_file``) would serve the rest: it takes end of
    file from the file. Its length."""
    hasher = content_hasher()
    view = memoryview(buffer)
    length = 0
    while length < file_size:
        read = os.preadv(fd, [view], length)
        if read == 0:
            break
        hasher.update(view[:read])
        length += read
    if length != file_size:
        raise CorruptBlock(f"{length} of the file's {file_size} bytes read: it is not its block")
    if hasher.hexdigest() != digest:
        raise CorruptBlock("content does not match its hash")
    return length


class TieredCache(BlockCache):
    """The tiers in speed order over one index: admission, reads, promotion, demotion and eviction
    between them. As a level of the block cache (``blocks.BlockCache``), the
    local one: a raw block is served in place, from its file."""

    def __init__(
        self,
        tiers: list[Tier],
        index: Index,
        events: CacheEvents,
        planned: PlannedUse | None = None,
        tuning: CacheTuning = CacheTuning(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tiers = tiers
        self._tuning = tuning
        self._clock = clock  # for the disk-error backoff
        self._planned = planned  # the plan the tiers' policies read, if any
        # Per thread, a buffer for ``raw_hit``: checking a file costs no
        # allocation (``CHECK_BUFFER_BYTES`` per FUSE thread).
        self._buffers = threading.local()
        # Raw blocks checked by this process -> the identity of the file
        # checked (``_file_identity``), the most recently served last.
        self._checked_files: OrderedDict[str, tuple[int, int, int]] = OrderedDict()
        self._checked_lock = threading.Lock()
        self._index = index
        self._events = events
        self._move_lock = threading.Lock()
        # Blocks being promoted or demoted -> the tier their file is still
        # in: out of its accounting before the copy is written, they must
        # not look uncached to a reader meanwhile (it would GET them again).
        self._moving: dict[str, Tier] = {}
        self._failing_until: dict[str, float] = {}  # tier name -> end of its backoff (``admit``)
        # Tier name -> blocks whose name is blocked there (``UnplaceableBlock``):
        # not tried again until a restart, each try cost a write and a warning.
        self._unplaceable: dict[str, set[str]] = {tier.name: set() for tier in tiers}
        # A compressed block's concurrent READs (the kernel's read-ahead
        # sends about four) share one read and decode of the whole block.
        self._decoding: SingleFlight[str, bytes | None] = SingleFlight()

    @property
    def tiers(self) -> list[Tier]:
        return self._tiers

    @property
    def index(self) -> Index:
        return self._index

    @property
    def capacity(self) -> int:
        return sum(tier.capacity for tier in self._tiers)

    @property
    def used_bytes(self) -> int:
        return sum(tier.used_bytes for tier in self._tiers)

    def _tier_holding(self, digest: str) -> Tier | None:
        for tier in self._tiers:
            if tier.holds(digest):
                return tier
        return self._moving.get(digest)

    # -- start-up -------------------------------------------------------

    def save_recency(self) -> None:
        """Persist the order of use so eviction order survives a restart;
        best effort (a full disk costs the order, not the exit)."""
        now = time.time()
        try:
            blocks = self._index.blocks()
            self._index.save_last_used(
                {block.hash: now - (len(blocks) - i) * 1e-6 for i, block in enumerate(blocks)}
            )
        except (sqlite3.Error, IndexDamaged) as exc:
            log.warning("cannot save the order of use of cached blocks: %s", exc)

    # -- as a level of the block cache -------------------------------------

    @property
    def remote(self) -> bool:
        return False

    def get(self, version: Version, index: int, use: Use) -> Block | None:
        """The block: a raw one as a ``FileSpan`` of its file (checked where
        it lies on its first read, see ``raw_hit``), a compressed one
        decoded and verified. On a miss, with a content identity, another
        object's block of that identity, adopted (``adopt``)."""
        ref = version.ref(index)
        digest = self._index.lookup(ref)
        if digest is not None:
            return self._hit(digest, version.length(index))
        identity = version.identity
        adopted = None if identity is None else self.adopt(ref, identity)
        if adopted is None:
            return None
        digest, data = adopted
        placement = self.placement(digest)
        if placement is not None and placement.raw:
            return self._hit(digest, version.length(index))  # served in place, as its next reads are
        return Block(digest, data, "memory" if placement is None else placement.tier)

    def _hit(self, digest: str, length: int) -> Block | None:
        hit = self.raw_hit(digest)
        if hit is not None:
            tier, fd = hit
            return Block(digest, FileSpan(fd, 0, length), tier)
        placement = self.placement(digest)
        if placement is None:
            return None
        data = self._decoding.do(digest, lambda: self.read(digest), self._tuning.decode_wait_seconds)
        return None if data is None else Block(digest, data, placement.tier)

    def put(self, version: Version, index: int, digest: str, content: bytes | bytearray, use: Use) -> bool:
        self.admit(version.ref(index), digest, content, version.identity, use.tier, use.ahead, use.next_use)
        placement = self.placement(digest)
        return placement is not None and placement.raw

    def served(self, version: Version, index: int, block: Block) -> bool:
        tier = self._tier_holding(block.digest)
        if tier is None:
            return False
        self._read_from(tier, block.digest)
        return tier.codec is Codec.RAW

    def residency(self, version: Version, index: int) -> str | None:
        digest = self.lookup(version.ref(index))
        return None if digest is None else self.tier_of(digest)

    def forget(self, version: Version) -> None:
        block_count = -(-version.size // version.block_size)
        self.release_version(version.source, version.key, version.etag, block_count)

    # -- read path ------------------------------------------------------

    def lookup(self, ref: BlockRef) -> str | None:
        return self._index.lookup(ref)

    def adopt(self, ref: BlockRef, identity: tuple[str, int]) -> tuple[str, bytes] | None:
        """The block (hash, content) of another object with the same content
        identity (etag, size), now also recorded for ``ref``: a download
        saved. None if no such block is cached. If ``ref``'s own block was
        admitted since the caller missed it (a prefetch of it finished), that
        is the block, and nothing was saved."""
        try:
            own = self.lookup(ref)
            digest = own or self._index.lookup_identity(*identity, ref.block)
        except sqlite3.Error:
            return None
        data = None if digest is None else self.read(digest)
        if data is None or digest is None:
            return None
        if own is None:
            self.admit(ref, digest, data, identity)
            self._events.dedup_saved("wire", len(data))
        return digest, data

    def room(self, incoming_use: float | None = None, wanted: int | None = None) -> int:
        """Bytes new blocks could take now, over all tiers (``Tier.room``)
        but those whose disk is failing."""
        return sum(tier.room(incoming_use, wanted) for tier in self._tiers if not self._failing(tier))

    def _failing(self, tier: Tier, digest: str | None = None) -> bool:
        """Whether ``tier`` takes no blocks now (its disk failed a write),
        or not ``digest``, whose name is blocked there."""
        if digest is not None and digest in self._unplaceable[tier.name]:
            return True
        return self._clock() < self._failing_until.get(tier.name, 0.0)

    def plan(self, digest: str, position: float) -> bool:
        """Plan resident block ``digest`` to be read next at ``position``;
        False if it is not cached (or the cache keeps no plans)."""
        tier = self._tier_holding(digest)
        if tier is None or self._planned is None:
            return False
        self._planned.plan(digest, position)
        tier.replanned(digest)
        return True

    def unplan(self, digest: str) -> None:
        """Block ``digest`` is no longer planned (read, or the plan changed)."""
        if self._planned is None:
            return
        self._planned.consumed(digest)
        tier = self._tier_holding(digest)
        if tier is not None:
            tier.replanned(digest)

    def tier_of(self, digest: str) -> str | None:
        tier = self._tier_holding(digest)
        return None if tier is None else tier.name

    def placement(self, digest: str) -> Placement | None:
        """Where block ``digest`` is (one look through the tiers), or None."""
        tier = self._tier_holding(digest)
        return None if tier is None else Placement(tier.name, tier.codec is Codec.RAW)

    def verified_file(self, digest: str) -> tuple[str, Path, tuple[int, int, int]] | None:
        """Where raw block ``digest`` lies as this process verified it: its
        tier's name, its path, and the identity of the file checked
        (``_file_identity``), which a reader that opens the path itself
        compares before it trusts the bytes; None if it is compressed,
        absent, or not verified yet."""
        tier = self._tier_holding(digest)
        if tier is None or tier.codec is not Codec.RAW:
            return None
        with self._checked_lock:
            identity = self._checked_files.get(digest)
        return None if identity is None else (tier.name, tier.path_of(digest), identity)

    def touch(self, digest: str) -> None:
        """A read served from RAM, not through ``read``: the policies still
        have to see it."""
        tier = self._tier_holding(digest)
        if tier is not None:
            self._read_from(tier, digest)

    def _read_from(self, tier: Tier, digest: str) -> None:
        """Count a read of block ``digest`` in ``tier``: it ends the block's
        plan (it was planned to be read next; now it has been), and its
        policy ranks it as read."""
        if self._planned is not None:
            self._planned.consumed(digest)
        tier.accessed(digest)

    def warm(self, digest: str, hold: bool = False, offset: int = 0, length: int = 0) -> None:
        """Have block ``digest`` (``length`` bytes of it from ``offset``, if
        given) read from disk into RAM ahead of its read; not a read itself,
        so the policies do not see it. ``hold`` as in ``Tier.warm``: the
        read is due next."""
        tier = self._tier_holding(digest)
        if tier is not None:
            try:
                tier.warm(digest, hold, offset, length)
            except OSError as exc:
                log.warning("cannot warm block %s in the %s tier: %s", digest, tier.name, exc)

    def raw_hit(self, digest: str) -> tuple[str, int] | None:
        """For a read served straight from a raw block file (the block's
        bare content, so the FUSE edge reads it as it lies, or the kernel
        reads it itself): the tier's name and an open descriptor of the file,
        which the caller closes, with the hit counted by its policy. The
        content is verified where it lies (no copy of it) unless this very
        file was already (``_checked_before``). None if the block is
        compressed, absent, or found corrupt (then dropped, as by ``read``)."""
        opened = self._open_raw(digest)
        if opened is None:
            return None
        tier, fd = opened
        self._read_from(tier, digest)
        return tier.name, fd

    def _open_raw(self, digest: str) -> tuple[Tier, int] | None:
        """``raw_hit`` but for counting the read: the tier and a verified
        descriptor of raw block ``digest``'s file."""
        tier = self._tier_holding(digest)
        if tier is None or tier.codec is not Codec.RAW:
            return None
        fd = self._checked(tier, digest, lambda: tier.open(digest))
        if fd is None and tier is not self._tier_holding(digest):  # moved meanwhile: look once more
            return self._open_raw(digest)
        if fd is None:
            return None
        if not self._verified(tier, digest, fd):
            os.close(fd)
            return None
        return tier, fd

    def _verified(self, tier: Tier, digest: str, fd: int) -> bool:
        """Whether block ``digest``, open as ``fd`` in ``tier``, may be
        served: checked by this process in this very file before, or now."""
        status = self._checked(tier, digest, lambda: os.fstat(fd))
        if status is None:
            return False
        identity = _file_identity(status)
        if self._checked_before(digest, identity):
            return True
        if not tier.holds(digest):  # evicted or moved since it was found: a miss
            return False
        buffer = getattr(self._buffers, "check", None)
        if buffer is None:
            buffer = self._buffers.check = bytearray(CHECK_BUFFER_BYTES)
        length = self._checked(tier, digest, lambda: _check_file(fd, buffer, status.st_size, digest))
        if length is None:
            return False
        self._events.tier_read(tier.name, length)
        self._remember_checked(digest, identity)
        return True

    def _checked_before(self, digest: str, identity: tuple[int, int, int]) -> bool:
        """Whether this process verified block ``digest`` in the file that
        is now ``identity``. Hashing a whole block for each read of part of
        it made random reads through fresh opens (a loader that opens its
        shard per sample) read and hash 64 times the bytes they served; a
        block is now checked once per daemon, and again whenever its file
        is written to (a new ctime) or replaced (a new inode)."""
        with self._checked_lock:
            if self._checked_files.get(digest) != identity:
                return False
            self._checked_files.move_to_end(digest)
            return True

    def _remember_checked(self, digest: str, identity: tuple[int, int, int]) -> None:
        with self._checked_lock:
            self._checked_files[digest] = identity
            self._checked_files.move_to_end(digest)
            if len(self._checked_files) > self._tuning.checked_files_remembered:
                self._checked_files.popitem(last=False)

    def read(self, digest: str) -> bytes | None:
        """The verified content of block ``digest``, or None on any miss or
        failure. A hit in a slower tier may promote the block."""
        tier = self._tier_holding(digest)
        if tier is None:
            return None
        data = self._checked(tier, digest, lambda: decode_file(tier.read(digest), tier.codec, digest))
        if data is None and tier is not self._tier_holding(digest):  # moved meanwhile: look once more
            return self.read(digest)
        if data is None:
            return None
        self._read_from(tier, digest)
        self._events.tier_read(tier.name, len(data))
        if tier is not self._tiers[0]:
            self._promote(digest, data, tier)
        return data

    def _checked(self, tier: Tier, digest: str, load: Callable[[], T]) -> T | None:
        """``load()``, a read of block ``digest`` from ``tier``; None, and
        the block dropped if it is gone or corrupt, on failure."""
        try:
            return load()
        except FileNotFoundError:
            self._lost(tier, digest)
        except CorruptBlock as exc:
            log.warning("dropping corrupt block %s from the %s tier: %s", digest, tier.name, exc)
            self._events.block_corrupt(tier.name)
            self._lost(tier, digest)
        except OSError as exc:
            log.warning("cannot read block %s from the %s tier: %s", digest, tier.name, exc)
            self._events.cache_error(tier.name)
        return None

    # -- admission and movement -------------------------------------------

    def admit(
        self,
        ref: BlockRef,
        digest: str,
        data: bytes | bytearray,
        identity: tuple[str, int] | None = None,
        tier: str | None = None,
        ahead: bool = False,
        next_use: float | None = None,
    ) -> None:
        """Store ``data`` (whose hash the caller computed from the fetched
        bytes) as the content of ``ref``, in ``tier`` or the fastest tier with
        room; ``ahead`` when no read asked for it yet (prefetch, stage), so
        the policies do not count the admission as a read, and ``next_use``
        when a plan says when it will be (the policies weigh it against the
        residents' plans). Best effort: failures only log."""
        if next_use is not None and self._planned is not None:
            self._planned.plan(digest, next_use)
        first = 0 if tier is None else next(i for i, each in enumerate(self._tiers) if each.name == tier)
        with self._move_lock:
            holder = self._tier_holding(digest)
            if holder is not None:
                size = holder.size_of(digest) or 0
                self._record(ref, StoredBlock(digest, holder.name, size, len(data), time.time()), identity)
                self._events.dedup_saved("disk", len(data))
                return
            for position in range(first, len(self._tiers)):
                target = self._tiers[position]
                if self._failing(target, digest):
                    continue
                try:
                    size = self._place(position, digest, data, ahead)
                except NoRoom:
                    continue
                except _DISK_ERRORS as exc:
                    self._disk_failed(target, digest, f"cannot cache block {digest} in it", exc)
                    continue
                self._record(ref, StoredBlock(digest, target.name, size, len(data), time.time()), identity)
                break
            else:
                # No tier took it: a plan left behind would rank the block,
                # when some later read admits it, by a position long past.
                if self._planned is not None:
                    self._planned.consumed(digest)
        self.report_usage()

    def _record(self, ref: BlockRef, stored: StoredBlock, identity: tuple[str, int] | None) -> None:
        try:
            self._index.record(ref, stored, identity)
        except sqlite3.Error as exc:
            log.warning("cannot record block %s: %s", stored.hash, exc)
            self._events.cache_error(stored.tier)
            self.discard(stored.hash)

    def _place(self, position: int, digest: str, data: bytes | bytearray, ahead: bool = False) -> int:
        """Write ``data`` into tier ``position``, demoting or evicting what
        its policy gives up for it; the file's bytes on disk."""
        tier = self._tiers[position]
        frame = encode_file(data, tier.codec, digest)
        size = disk_bytes(frame.size)
        # A failed write leaves nothing behind.
        self._admit_file(position, digest, size, lambda: tier.write(digest, frame), ahead)
        return size

    def _admit_file(
        self, position: int, digest: str, size: int, write: Callable[[], os.stat_result], ahead: bool
    ) -> None:
        """Make room in tier ``position`` for ``size`` bytes of ``digest``,
        demoting or evicting what its policy gives up for it, then put its
        file in place (``write()``, which returns the file's status) and
        account for it; ``NoRoom`` if the policy refuses."""
        tier = self._tiers[position]
        try:
            victims = tier.make_room(size, digest)
        except NoRoom as refused:
            self._give_up(position, refused.victims)
            raise
        self._give_up(position, victims)
        written = write()
        tier.add(digest, size, ahead)
        if tier.codec is Codec.RAW:
            # Written from verified bytes by this process: checked, until
            # the file is written to or replaced (``_checked_before``).
            self._remember_checked(digest, _file_identity(written))

    # -- whole files ----------------------------------------------------

    def assemble_whole(self, version: Version, abandoned: Callable[[], bool]) -> bool:
        """Make ``version``'s whole file (``index.WHOLE``): one raw file of
        exactly its bytes from offset 0, for the kernel to read itself
        (FUSE passthrough) when the object is larger than a block. It is
        made of the version's block files, each verified as a read's is
        (not counted as read: nobody read it), written to a temp file and
        hashed on the way, then admitted to the fastest raw tier holding
        any of them as a fetched block is, ahead of its read: its first
        read is the next epoch's. Whether the version has a whole file now.

        None is made, and nothing left behind, if a block is not cached in
        a raw tier or is corrupt, the tier has no room, its disk fails, or
        ``abandoned()`` turns true (the daemon stops). ``_move_lock`` is
        held only to admit the written file: until then it lies in the
        tier's tmp, beyond its capacity by its size."""
        ref = version.ref(WHOLE)
        if self.lookup(ref) is not None:
            return True
        blocks = [self.lookup(version.ref(index)) for index in range(-(-version.size // version.block_size))]
        holders = [None if digest is None else self._tier_holding(digest) for digest in blocks]
        if not all(tier is not None and tier.codec is Codec.RAW for tier in holders):
            return False
        position, target = next((i, tier) for i, tier in enumerate(self._tiers) if tier in holders)
        temp, fd = target.temp_file()
        try:
            # Its room on disk taken at once, in as few pieces as the disk
            # has: written a block at a time with others' writes between, a
            # file could come out in so many pieces that the filesystem
            # needed a block of its own to map them, beyond what the tier
            # accounts for it (``disk_bytes``); and a full disk fails here.
            os.posix_fallocate(fd, 0, version.size)
            digest = self._write_whole(fd, version, blocks, abandoned)
            if digest is None:
                return False
            return self._admit_whole(
                position, ref, version.size, digest, partial(target.place, temp, fd, digest)
            )
        except _DISK_ERRORS as exc:
            log.warning("%s tier: cannot make the whole file of %s: %s", target.name, ref.key, exc)
            self._events.cache_error(target.name)
            return False
        finally:
            os.close(fd)
            temp.unlink(missing_ok=True)  # gone once placed

    def _write_whole(
        self, fd: int, version: Version, blocks: list[str | None], abandoned: Callable[[], bool]
    ) -> str | None:
        """Write ``version``'s blocks (their hashes, in order) through
        ``fd``; the hash of all the bytes written, or None if a block could
        not be read whole and verified."""
        hasher = content_hasher()
        buffer = bytearray(version.block_size)
        for index, digest in enumerate(blocks):
            opened = None if digest is None or abandoned() else self._open_raw(digest)
            if opened is None:
                return None
            tier, block_fd = opened
            try:
                content = tier.read_into(block_fd, buffer)
            finally:
                os.close(block_fd)
            if len(content) != version.length(index):
                return None
            hasher.update(content)
            while content:
                content = content[os.write(fd, content) :]
        return hasher.hexdigest()

    def _admit_whole(
        self, position: int, ref: BlockRef, size: int, digest: str, place: Callable[[], os.stat_result]
    ) -> bool:
        """Admit a whole file of ``size`` bytes, written and hashed as
        ``digest``, to tier ``position`` (``place()`` renames it into place)
        and record it as ``ref``; whether ``ref`` has it now."""
        target = self._tiers[position]
        with self._move_lock:
            holder = self._tier_holding(digest)
            if holder is not None:  # the same bytes, cached for another version
                stored = StoredBlock(digest, holder.name, holder.size_of(digest) or 0, size, time.time())
                self._record(ref, stored, None)
                return self.lookup(ref) is not None
            if self._failing(target, digest):
                return False
            try:
                self._admit_file(position, digest, disk_bytes(size), place, ahead=True)
            except NoRoom:
                made = False
            else:
                self._record(ref, StoredBlock(digest, target.name, disk_bytes(size), size, time.time()), None)
                made = self.lookup(ref) is not None  # not if the index could not be written
        self.report_usage()  # victims were given up, even for a refusal
        if made:
            self._events.whole_file_made(target.name)
        return made

    def _forget_checked(self, digest: str) -> None:
        """Block ``digest``'s file is gone from where it was checked: its
        entry would only push out those of blocks still cached."""
        with self._checked_lock:
            self._checked_files.pop(digest, None)

    def _give_up(self, position: int, victims: list[str]) -> None:
        """Blocks tier ``position`` no longer holds: demote each to the next
        tier, or drop it from the last. A whole file is dropped wherever it
        is: its blocks hold the same bytes, and the slower tiers serve
        blocks, not files the kernel reads itself."""
        tier = self._tiers[position]
        self._moving.update(dict.fromkeys(victims, tier))
        for digest in victims:
            try:
                demotable = position + 1 < len(self._tiers) and not self._index.is_whole(digest)
                if demotable and self._demote(digest, position):
                    continue
                self.drop(digest, tier)
            finally:
                self._moving.pop(digest, None)
            self._events.block_evicted(tier.name)

    def _disk_failed(self, tier: Tier, digest: str, what: str, exc: BaseException) -> None:
        """A write of ``digest`` to ``tier`` failed: the tier takes no
        blocks for a while (its room is 0), with one warning. Unless the
        disk took the bytes and only this block's name is blocked: then only
        this block is not cached there (a bad path must not stop the whole tier)."""
        if isinstance(exc, UnplaceableBlock):
            self._unplaceable[tier.name].add(digest)
            consequence = "it is not cached there until a restart"
        else:
            backoff = self._tuning.disk_error_backoff_seconds
            self._failing_until[tier.name] = self._clock() + backoff
            consequence = f"it takes no blocks for {backoff:.0f} s"
        log.warning("%s tier: %s: %s; %s", tier.name, what, exc, consequence)
        self._events.cache_error(tier.name)

    def _demote(self, digest: str, position: int) -> bool:
        source, target = self._tiers[position], self._tiers[position + 1]
        if self._failing(target, digest):
            return False
        try:
            data = decode_file(source.read(digest), source.codec, digest)
            self._place(position + 1, digest, data)
        except (NoRoom, CorruptBlock):
            return False
        except _DISK_ERRORS as exc:
            self._disk_failed(target, digest, f"cannot demote block {digest} to it", exc)
            return False
        return self._rehome(digest, source, target, "demotion")

    def _promote(self, digest: str, data: bytes, source: Tier) -> None:
        if self._failing(self._tiers[0], digest):
            return
        with self._move_lock:
            self._moving[digest] = source
            try:
                size = source.remove(digest)  # out of reach of the demotions this may cause
                if size is None:
                    return
                try:
                    self._place(0, digest, data)
                except NoRoom:
                    source.add(digest, size)
                    return
                except _DISK_ERRORS as exc:
                    self._disk_failed(self._tiers[0], digest, f"cannot promote block {digest} to it", exc)
                    source.add(digest, size)
                    return
                self._rehome(digest, source, self._tiers[0], "promotion")
            finally:
                self._moving.pop(digest, None)
        self.report_usage()

    def _rehome(
        self, digest: str, source: Tier, target: Tier, direction: Literal["promotion", "demotion"]
    ) -> bool:
        """The block's new copy in ``target`` is written and accounted: name
        it there in the index, then delete the old file."""
        try:
            self._index.move_block(digest, target.name, target.size_of(digest) or 0)
        except sqlite3.Error as exc:
            log.warning("cannot move block %s in the index: %s", digest, exc)
            self._events.cache_error(target.name)
            target.remove(digest)
            target.delete(digest)
            return False
        source.delete(digest)
        if target.codec is not Codec.RAW:  # a raw copy was checked as it was written
            self._forget_checked(digest)
        self._events.block_moved(direction)
        return True

    # -- removal --------------------------------------------------------

    def drop(self, digest: str, tier: Tier | None) -> None:
        """Delete a block's row, then its file, and its plan; best effort. If
        the row cannot be deleted the file goes anyway: a row naming a
        missing file is a miss on read, and start-up drops it. The caller
        has taken it out of ``tier``'s accounting (or it never was in it:
        ``maintenance``)."""
        if self._planned is not None:
            self._planned.consumed(digest)
        try:
            self._index.remove_block(digest)
        except sqlite3.Error as exc:
            log.warning("cannot drop block %s from the index: %s", digest, exc)
        self._forget_checked(digest)
        if tier is not None:
            try:
                tier.delete(digest)
            except OSError as exc:
                log.warning("cannot delete block file %s: %s", digest, exc)
                self._events.cache_error(tier.name)

    def _lost(self, tier: Tier, digest: str) -> None:
        """Block ``digest``'s file in ``tier`` is gone or bad: drop the block,
        unless ``tier`` no longer holds it. Then it was moved (its copy in
        the next tier is good) or evicted since the reader found it there,
        and the read is only a miss."""
        if tier.remove(digest) is not None:
            self.drop(digest, tier)
            self.report_usage()

    def discard(self, digest: str) -> None:
        """Drop block ``digest`` from wherever it is (it is bad, or nothing
        references it any more); best effort, as ``drop``."""
        tier = self._tier_holding(digest)
        if tier is not None:
            tier.remove(digest)
        self.drop(digest, tier)
        self.report_usage()

    def release_version(self, source: str, key: str, etag: str, block_count: int) -> None:
        """Drop one version of an object (it changed or was deleted upstream),
        deleting the blocks nothing else references."""
        try:
            unreferenced = self._index.release_version(source, key, etag, block_count)
        except sqlite3.Error as exc:
            log.warning("cannot release %s version %s in the index: %s", key, etag, exc)
            return
        with self._move_lock:
            for digest in unreferenced:
                self.discard(digest)

    # -- staged writes ----------------------------------------------------

    def reserve(self, nbytes: int) -> None:
        """Room in the hot tier for ``nbytes`` of staged writes, cached
        blocks demoted or evicted for it; ``NoSpace`` if it has none."""
        if nbytes <= 0:
            return
        with self._move_lock:
            try:
                victims = self._tiers[0].reserve(nbytes)
            except NoRoom as refused:
                self._give_up(0, refused.victims)
                raise NoSpace(
                    f"the {self._tiers[0].name} tier cannot hold {nbytes} more bytes of staged writes"
                ) from None
            self._give_up(0, victims)

    def hold(self, nbytes: int) -> None:
        """Account ``nbytes`` staged already (found at start): never refused."""
        with self._move_lock:
            self._give_up(0, self._tiers[0].reserve(nbytes, refusable=False))

    def unreserve(self, nbytes: int) -> None:
        if nbytes > 0:
            self._tiers[0].unreserve(nbytes)

    def staged_room(self) -> tuple[int, int]:
        hot = self._tiers[0]
        return hot.capacity, hot.capacity - hot.reserved_bytes

    def report_usage(self) -> None:
        """Tell the events each tier's usage, after anything that changed it."""
        for tier in self._tiers:
            self._events.tier_usage(tier.name, tier.used_bytes, tier.capacity, tier.block_count)

"""Cache maintenance: making the files, the index and the tiers'
accounting agree at start-up (``reconcile``), and checking every block
(``verify_blocks``, for ``cachefsd verify``). ``directory.open_cache``
reconciles every cache it opens; ``directory.verify`` and ``directory.gc``
are the commands.

Crash safety rests on the order every change to the cache keeps (a block
file written and renamed before the index names it, a row deleted before its
file, see ``tiered.py``): whatever a ``kill -9`` or a power loss leaves,
``reconcile`` deletes temp files, files the index does not place in that
tier, rows whose file is missing or of the wrong size, and unreferenced
blocks, and trims every tier to its capacity. Both run before the cache
serves (or with no daemon using it): nothing else touches the tiers
meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from cachefsd.cache.codec import Codec, CorruptBlock, decode_file
from cachefsd.cache.index import StoredBlock
from cachefsd.cache.tier import Tier, disk_bytes
from cachefsd.cache.tiered import TieredCache
from cachefsd.config import human_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyReport:
    checked: int
    corrupt: list[str]
    missing: list[str]
    # Bad blocks a repair could not drop from the index (its disk is full).
    unrepaired: list[str] = field(default_factory=list)
    # Files no block row names (left by a crash, or strays): a repair, a
    # gc and the next mount remove them.
    orphans: int = 0


@dataclass(frozen=True)
class Damage:
    """What ``reconcile`` found (and, tidying, dropped): blocks whose row
    names a file of the wrong size (corrupt) or none (missing), and files
    in the tiers that no row names (orphans: crash leftovers, strays)."""

    corrupt: list[str]
    missing: list[str]
    orphans: int = 0


def reconcile(cache: TieredCache, tidy: bool = True) -> Damage:
    """Make files, index and accounting agree after whatever happened
    last time, and trim every tier to its (possibly new) capacity; the
    damage found on the way (dropped, as the rest). Without ``tidy``
    (``verify`` without ``--repair``) nothing on disk or in the index
    changes: the damage is only found, and the tiers account for the
    blocks that are intact."""
    by_name = {tier.name: tier for tier in cache.tiers}
    on_disk: dict[str, dict[str, int]] = {}
    strays = 0
    for tier in cache.tiers:
        on_disk[tier.name], not_blocks = tier.files(tidy)
        strays += not_blocks
    stored = cache.index.blocks()  # least recently used first
    kept, damage, trimmed = _judge_rows(cache, stored, on_disk, tidy)
    for block in stored:  # admit in recency order so the policies see it
        if block.hash in kept:
            by_name[block.tier].add(block.hash, block.disk_bytes)
    # What no row took: block files never recorded (a crash), and strays.
    if not tidy:
        damage = replace(damage, orphans=strays + sum(len(files) for files in on_disk.values()))
        log.info("cache inspected: %d blocks intact, %d orphan files", len(kept), damage.orphans)
        return damage
    removed = strays
    for tier in cache.tiers:
        for orphan in on_disk[tier.name]:
            try:
                tier.delete(orphan)
            except OSError as exc:  # immutable, say: it stays, and the mount goes on
                log.warning("cannot remove orphan block %s from the %s tier: %s", orphan, tier.name, exc)
                continue
            removed += 1
    damage = replace(damage, orphans=removed)
    log.info("cache reconciled: %d blocks kept, %d orphan files removed", len(kept), removed)
    if damage.corrupt or damage.missing:
        log.warning(
            "cache: dropped %d blocks whose file was of the wrong size and %d whose file was gone; "
            "they are fetched again when read",
            len(damage.corrupt),
            len(damage.missing),
        )
    for name, (blocks, nbytes) in trimmed.items():
        # A smaller capacity (or a tier left out) empties a warm cache: say so.
        why = "beyond its capacity" if name in by_name else "the tier is no longer configured"
        message = "%s tier: %d cached blocks (%s) evicted at start: %s"
        log.warning(message, name, blocks, human_bytes(nbytes), why)
    cache.report_usage()
    return damage


def _judge_rows(
    cache: TieredCache,
    stored: list[StoredBlock],
    on_disk: dict[str, dict[str, int]],
    tidy: bool,
) -> tuple[dict[str, StoredBlock], Damage, dict[str, tuple[int, int]]]:
    """For ``reconcile``: the rows kept (their files taken out of
    ``on_disk``), the damaged ones, and per tier the blocks and bytes
    trimmed for want of room (or of the tier); all but the kept are
    dropped when ``tidy``."""
    by_name = {tier.name: tier for tier in cache.tiers}
    garbage = set(cache.index.unreferenced())
    damage = Damage([], [])
    kept: dict[str, StoredBlock] = {}
    used = dict.fromkeys(by_name, 0)
    trimmed: dict[str, tuple[int, int]] = {}
    for block in reversed(stored):  # most recent first: they are kept when a tier overflows
        tier = by_name.get(block.tier)
        file_size = None if tier is None else on_disk[tier.name].pop(block.hash, None)
        intact = tier is not None and file_size is not None and _of_its_size(tier, block, file_size)
        fits = tier is not None and used[tier.name] + block.disk_bytes <= tier.capacity
        if intact and fits and block.hash not in garbage:
            used[block.tier] += block.disk_bytes
            kept[block.hash] = block
            continue
        if block.hash not in garbage:  # an unreferenced block is no loss
            if tier is None or intact:  # no room for it, or no tier
                blocks, nbytes = trimmed.get(block.tier, (0, 0))
                trimmed[block.tier] = (blocks + 1, nbytes + block.disk_bytes)
            elif file_size is None:
                damage.missing.append(block.hash)
            else:
                damage.corrupt.append(block.hash)
        if tidy:
            cache.drop(block.hash, tier)
    return kept, damage, trimmed


def _of_its_size(tier: Tier, block: StoredBlock, file_size: int) -> bool:
    """Whether a block's file is as long as its row says: a raw tier's is
    its content, byte for byte; a frame's is known to within its disk
    bytes (the row does not keep a compressed payload's length)."""
    if tier.codec is Codec.RAW and file_size != block.raw_bytes:
        return False
    return disk_bytes(file_size) == block.disk_bytes


def verify_blocks(cache: TieredCache, repair: bool) -> VerifyReport:
    """Check every block's file against its name (a raw tier's bare content
    hashed, a compressed tier's frame decoded); with ``repair``, drop the
    bad ones (they are fetched again on their next read)."""
    corrupt: list[str] = []
    missing: list[str] = []
    checked = 0
    for digest, tier in _stored(cache):
        checked += 1
        try:
            decode_file(tier.read(digest), tier.codec, digest)
        except FileNotFoundError:
            missing.append(digest)
        except (CorruptBlock, OSError):
            corrupt.append(digest)
    if not repair:
        return VerifyReport(checked, corrupt, missing)
    for digest in corrupt + missing:
        cache.discard(digest)  # best effort, as on every path: a row may stay
    left = {block.hash for block in cache.index.blocks()}
    return VerifyReport(checked, corrupt, missing, [digest for digest in corrupt + missing if digest in left])


def _stored(cache: TieredCache) -> Iterator[tuple[str, Tier]]:
    by_name = {tier.name: tier for tier in cache.tiers}
    for block in cache.index.blocks():
        tier = by_name.get(block.tier)
        if tier is not None and tier.holds(block.hash):
            yield block.hash, tier

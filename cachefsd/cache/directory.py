"""Opening a cache directory: its locks, its index and its tiers, for the
daemon and for the maintenance commands (``verify``, ``gc``) alike.

The cache directory holds the index; the tiers may live elsewhere (a hot
NVMe, a warm disk). The tier layout is recorded in the index, so
``cachefsd verify --cache-dir D`` finds the tiers a daemon used without
being told again. Every directory involved is locked: two daemons sharing a
tier would each evict the other's blocks and break its capacity.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sqlite3
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from cachefsd.cache.codec import Codec
from cachefsd.cache.index import (
    BLOCK_SIZE_META,
    Index,
    IndexDamaged,
    IndexSchemaMismatch,
    damage_note,
    is_damage,
)
from cachefsd.cache.lock import CacheDirLock, create_cache_directory
from cachefsd.cache.maintenance import Damage, VerifyReport, reconcile, verify_blocks
from cachefsd.cache.policy import LRU, DueElsewhere, EpochClock, PlannedUse, make_policy
from cachefsd.cache.tier import Tier
from cachefsd.cache.tiered import CacheEvents, DedupWhere, TieredCache
from cachefsd.config import CacheSettings, human_bytes, resolve_tier_size
from cachefsd.errors import CachefsdError, ConfigError

log = logging.getLogger(__name__)

_TIERS_META = "tiers"
_INDEX_NAME = "index.sqlite"
_CODECS = {"raw": Codec.RAW, "lz4": Codec.LZ4}
# Maintenance commands never wait for a running daemon: they tell the user.
_NO_WAIT = 0.0


@dataclass(frozen=True)
class TierSpec:
    name: str
    dir: str
    capacity: int
    codec: str


# The smallest tier capacity taken, the smallest block size: anything less
# is a size typed without its unit (or a cache that can hold nothing).
MIN_TIER_BYTES = 64 << 10


def tier_specs(settings: CacheSettings) -> list[TierSpec]:
    """The configured tiers, directories created and sizes in bytes."""
    if (settings.hot is not None or settings.warm is not None) and "size" in settings.model_fields_set:
        # Not refused: the CLI lists --cache-size beside the tier flags.
        log.warning("cache.size is not used with hot or warm tiers: each tier's own size applies")
    specs = []
    for name, tier in settings.tiers():
        create_cache_directory(settings.tier_setting(name), tier.dir)
        capacity = resolve_tier_size(tier.size, tier.dir)
        setting = settings.tier_setting(name, "size")
        if capacity < MIN_TIER_BYTES:
            # A size without its unit ("500" for 500G): it would empty a warm cache.
            raise ConfigError(f"{setting}: {human_bytes(capacity)} is too small for a cache (no unit?)")
        if capacity < settings.block_size:
            log.warning(
                "%s: %s holds not even one %s block: every read goes to the store",
                setting,
                human_bytes(capacity),
                human_bytes(settings.block_size),
            )
        specs.append(TierSpec(name, str(tier.dir), capacity, tier.codec))
    return specs


# Free bytes under which the cache disk counts as full: sqlite needs a few
# pages for the write-ahead log and its index.
_FULL_DISK_BYTES = 1 << 20


def _recorded(spec: TierSpec, cache_dir: Path) -> dict[str, object]:
    """``spec`` as the index records it: a directory inside the cache
    directory relative to it ("." for the single tier of --cache-dir)."""
    directory = Path(spec.dir).resolve()
    if directory.is_relative_to(cache_dir.resolve()):
        return {**asdict(spec), "dir": str(directory.relative_to(cache_dir.resolve()))}
    return asdict(spec)


def _open_index(cache_dir: Path, maintenance: bool) -> Index:
    """The cache is advisory: an index from another version, or a damaged
    one, is set aside (its blocks become orphans that reconcile removes)
    and costs re-fetches; it is never misread, and never stops a mount. A
    damaged one is kept beside it, for a post-mortem. Maintenance commands
    (``verify``, ``gc``) report it and leave it for the next mount."""
    path = cache_dir / _INDEX_NAME
    try:
        return Index(path)
    except IndexSchemaMismatch as exc:
        if maintenance:
            raise CachefsdError(f"{exc}: the next mount starts a new one") from exc
        log.warning("%s; starting a new index", exc)
        _discard_index(path)
    except (sqlite3.DatabaseError, IndexDamaged) as exc:
        if not is_damage(exc):
            raise ConfigError(f"cache.dir: cannot open the index {path}: {exc}{_if_full(cache_dir)}") from exc
        _set_aside(path, exc, maintenance)
    return Index(path)


def _set_aside(path: Path, exc: sqlite3.DatabaseError | IndexDamaged, maintenance: bool) -> None:
    """Keep a damaged index as ``*.damaged`` so the next open starts a new
    one; a maintenance command raises instead, leaving it to the next mount."""
    if maintenance:
        raise CachefsdError(f"{path} is damaged ({exc}): the next mount sets it aside") from exc
    kept = path.with_name(f"{_INDEX_NAME}.damaged")
    # A directory where it would be kept, say: the new index matters more.
    what = f"kept as {kept}" if _discard_index(path, kept) else f"removed (it cannot be kept as {kept})"
    log.warning(
        "%s is damaged (%s); %s, starting a new index: cached blocks are fetched again", path, exc, what
    )


def _discard_index(path: Path, kept: Path | None = None) -> bool:
    """Remove the index (or move it to ``kept``: whether it was), its
    journal and its damage note."""
    moved = False
    if kept is not None and path.exists():
        try:
            path.replace(kept)
            moved = True
        except OSError as exc:
            log.debug("cannot move %s to %s: %s", path, kept, exc)
    for leftover in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        leftover.unlink(missing_ok=True)
    note = damage_note(path)
    if note.is_file():
        note.unlink()
    return moved


def _if_full(cache_dir: Path) -> str:
    """Why an index may not open: sqlite says only "disk I/O error" when it
    cannot create its write-ahead log on a disk something else filled."""
    try:
        free = os.statvfs(cache_dir)
    except OSError:
        return ""
    if free.f_bavail * free.f_frsize >= _FULL_DISK_BYTES:
        return ""
    return " (its disk is full: free space on it, or give another --cache-dir)"


def _settle_block_size(index: Index, cache_dir: Path, block_size: int, migrate: bool) -> None:
    """Make the references fit ``block_size``: a mount (``migrate``) drops
    those made at another size; anything else (an offline stage, its
    ``--check``) must not wipe a cache over a flag it was not given, and
    refuses instead."""
    previous = index.filled_at(block_size)
    if previous is None:
        try:
            index.save_meta(BLOCK_SIZE_META, str(block_size))
        except sqlite3.Error as exc:  # a full disk: it is recorded by the next open that can
            log.warning("cannot record the block size in the index: %s", exc)
        return
    shown = human_bytes if human_bytes(previous) != human_bytes(block_size) else lambda size: f"{size} bytes"
    filled = f"{shown(previous)} blocks" if previous else "another block size (not recorded)"
    if not migrate:
        raise ConfigError(
            f"cache.block_size: {cache_dir} was filled at {filled}, not {shown(block_size)}: "
            "give the --block-size its mount uses"
        )
    log.warning(
        "cache.block_size: this cache was filled at %s, now read at %s: its blocks are "
        "dropped and fetched again",
        filled,
        shown(block_size),
    )
    try:
        index.use_block_size(block_size)
    except sqlite3.Error as exc:  # forgotten in memory all the same: none is served
        log.warning("cannot drop the references of the old block size from the index: %s", exc)


def _layout(specs: list[TierSpec]) -> list[tuple[str, Path, int, str]]:
    return [(spec.name, Path(spec.dir).resolve(), spec.capacity, spec.codec) for spec in specs]


def require_cache(cache_dir: Path) -> None:
    """Refuse a directory no daemon has used, before anything is created
    there: a command that only reads a cache (``verify``, ``gc``, a
    ``stage --check``) must not leave a new, empty one behind a mistyped
    ``--cache-dir``."""
    if not (cache_dir / _INDEX_NAME).is_file():
        raise _no_cache(cache_dir)


def _no_cache(cache_dir: Path) -> CachefsdError:
    return CachefsdError(f"{cache_dir} holds no cache (no daemon has used it)")


@dataclass
class OpenCache:
    """An opened cache directory: its index and tiered cache, held under its lock until closed."""

    index: Index
    cache: TieredCache
    dropped: Damage  # what reconciling on opening found broken and dropped


@contextmanager
def open_cache(
    cache_dir: Path,
    specs: list[TierSpec] | None,
    policy: str,
    epochs: EpochClock,
    events: CacheEvents,
    lock_wait: float | None = None,
    planned: PlannedUse | None = None,
    block_size: int | None = None,
    migrate_block_size: bool = False,
    keep_recorded_layout: bool = False,
    inspect_only: bool = False,
    elsewhere: DueElsewhere | None = None,
) -> Iterator[OpenCache]:
    """Lock, open and reconcile a cache. ``specs`` None means the layout
    recorded by the last daemon (for maintenance commands), and so does
    ``keep_recorded_layout`` when there is one (an offline stage: a layout
    of its own, or the defaults, would trim or drop the daemon's tiers);
    ``planned`` is the prefetcher's plan and ``elsewhere`` the marks of
    reads other jobs are still to make, which the epoch-aware policy reads;
    ``block_size`` the size the blocks are read at (None for
    maintenance, which reads blocks by their hashes only), and
    ``migrate_block_size`` whether a cache filled at another is dropped (a
    mount) or refused; ``inspect_only`` that nothing in the cache is
    changed (``verify`` without ``--repair``): damage is found, not dropped."""
    maintenance = specs is None
    if maintenance:
        require_cache(cache_dir)
    create_cache_directory("cache.dir", cache_dir)
    wait: dict[str, Any] = {} if lock_wait is None else {"wait_seconds": lock_wait}
    if maintenance:
        wait["busy"] = "unmount the mount using it first"

    def open_in(attempt: ExitStack) -> OpenCache:
        index = _open_index(cache_dir, maintenance)
        attempt.callback(index.close)
        if block_size is not None:
            _settle_block_size(index, cache_dir, block_size, migrate_block_size)
        layout = _tier_layout(index, cache_dir, specs, keep_recorded_layout)
        # One lock a directory, however its path is spelled (a symlink, a
        # layout recorded before directories were made absolute).
        tier_dirs = {Path(spec.dir).resolve(): spec.name for spec in layout}
        tier_dirs.pop(cache_dir.resolve(), None)
        for directory, name in tier_dirs.items():
            attempt.callback(CacheDirLock(directory, **wait, setting=f"cache.{name}.dir").release)
        rng = random.Random()
        tiers = [
            Tier(
                spec.name,
                Path(spec.dir),
                spec.capacity,
                _CODECS[spec.codec],
                make_policy(policy, epochs, rng, planned, elsewhere),
            )
            for spec in layout
        ]
        cache = TieredCache(tiers, index, events, planned)
        dropped = reconcile(cache, tidy=not inspect_only)
        index.start_serving()
        return OpenCache(index, cache, dropped)

    with ExitStack() as stack:
        stack.callback(CacheDirLock(cache_dir, **wait).release)
        attempt = stack.enter_context(ExitStack())
        try:
            opened = open_in(attempt)
        except (sqlite3.DatabaseError, IndexDamaged) as exc:
            # Damage the index's load did not read (the blocks table, read
            # by reconcile): the same as damage found on load.
            attempt.close()  # the index, and the tiers' locks, which the next attempt takes
            if not is_damage(exc):
                raise
            _set_aside(cache_dir / _INDEX_NAME, exc, maintenance)
            opened = open_in(stack.enter_context(ExitStack()))
        yield opened
        if not inspect_only:
            opened.cache.save_recency()


def _damaged_layout(index: Index, what: str) -> CachefsdError:
    """Only a mount (which records its own layout) goes on past it."""
    return CachefsdError(
        f"the tier layout recorded in {index.path} is damaged ({what}); the next mount records its own"
    )


def _require_tiers(layout: list[TierSpec]) -> None:
    """The tiers the index records (for a maintenance command, an offline
    stage) are used as they are, and none is created: a directory that
    holds no blocks is not one (a tier deleted or moved since, or a damaged
    record naming another directory, whose files reconcile must not touch)."""
    for spec in layout:
        if not (Path(spec.dir) / "blocks").is_dir():
            raise CachefsdError(
                f"the index records the {spec.name} tier at {spec.dir}, which holds no cached blocks "
                "(deleted or moved?); the next mount lays its tiers out again"
            )


def _tier_layout(
    index: Index, cache_dir: Path, specs: list[TierSpec] | None, keep_recorded_layout: bool
) -> list[TierSpec]:
    """The tiers to open: the layout the index records when asked for it
    (``specs`` None, or ``keep_recorded_layout``) and there is one, else
    ``specs``, which the index then records."""
    recorded = index.load_meta(_TIERS_META) if specs is None or keep_recorded_layout else None
    if recorded is not None:
        # A tier recorded inside the cache directory, relative to it: it
        # moves with the directory (``mv``, a copy, another mount path).
        try:
            kept = [
                TierSpec(**{**spec, "dir": str(cache_dir / spec["dir"])}) for spec in json.loads(recorded)
            ]
        except (ValueError, TypeError, KeyError) as exc:
            raise _damaged_layout(index, repr(exc)) from exc
        if any(spec.codec not in _CODECS or type(spec.capacity) is not int for spec in kept):
            raise _damaged_layout(index, recorded)
        _require_tiers(kept)
        if specs is not None and _layout(specs) != _layout(kept):
            log.warning("%s: the cache's own tiers apply, as its daemon laid them out", cache_dir)
        return kept
    if specs is None:
        raise _no_cache(cache_dir)
    try:
        index.save_meta(_TIERS_META, json.dumps([_recorded(spec, cache_dir) for spec in specs]))
    except sqlite3.Error as exc:  # a full disk: the cache works, maintenance sees the old layout
        log.warning("cannot record the tier layout in the index: %s", exc)
    return specs


class _NoEpochs:
    """The epoch clock of an offline command, whose LRU asks it nothing."""

    def current(self) -> int:
        return 0


class _Unreported:
    """The ``CacheEvents`` of an offline command: no daemon serves its
    metrics, so nothing is counted."""

    def tier_usage(self, tier: str, used_bytes: int, capacity_bytes: int, blocks: int) -> None: ...
    def tier_read(self, tier: str, nbytes: int) -> None: ...
    def block_evicted(self, tier: str) -> None: ...
    def block_moved(self, direction: Literal["promotion", "demotion"]) -> None: ...
    def block_corrupt(self, tier: str) -> None: ...
    def cache_error(self, tier: str) -> None: ...
    def dedup_saved(self, where: DedupWhere, nbytes: int) -> None: ...
    def whole_file_made(self, tier: str) -> None: ...


@contextmanager
def _maintenance(cache_dir: Path, inspect_only: bool = False) -> Iterator[OpenCache]:
    """The cache as the last daemon laid it out, for an offline command:
    it never waits for a running daemon, and its metrics go nowhere."""
    with open_cache(
        cache_dir,
        None,
        LRU,
        _NoEpochs(),
        _Unreported(),
        lock_wait=_NO_WAIT,
        inspect_only=inspect_only,
    ) as opened:
        yield opened


def verify(cache_dir: Path, repair: bool) -> VerifyReport:
    """The index and every block checked, counting the damage that opening
    the cache found (a missing file, a file of the wrong size): dropped
    with ``repair``, as the bad hashes are, and otherwise left as it is. A
    damaged index is an error, and noted for the next mount to set aside."""
    with _maintenance(cache_dir, inspect_only=not repair) as opened:
        try:
            opened.index.check_integrity()
        except IndexDamaged as exc:
            opened.index.note_damage(exc)  # for the next mount
            _set_aside(cache_dir / _INDEX_NAME, exc, maintenance=True)
        found, dropped = verify_blocks(opened.cache, repair), opened.dropped
        return VerifyReport(
            found.checked + len(dropped.corrupt) + len(dropped.missing),
            dropped.corrupt + found.corrupt,
            dropped.missing + found.missing,
            found.unrepaired,
            dropped.orphans,
        )


def gc(cache_dir: Path) -> list[Tier]:
    """Reconcile (orphans, unreferenced blocks, over-capacity tiers) and
    return the tiers as they are after it."""
    with _maintenance(cache_dir) as opened:
        return opened.cache.tiers

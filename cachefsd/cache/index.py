"""The persistent index: which content hash holds block i of (source, key,
etag), how big each stored block is, and the persisted directory listings.

sqlite in WAL mode under the cache directory, so readers never wait on the
writer and a ``kill -9`` at any moment leaves the last committed state. The
refcount of a block is not stored: it is the number of ``block_refs`` rows
naming it, so it can never drift or go negative.

Ordering with the files (see cache/tiered.py): a block file is renamed into
place before its row is committed, and its row is deleted before the file is
unlinked. So after a crash the index only names files that exist or are
about to be reconciled away, and start-up removes files it does not name.

Concurrency: one connection, guarded by ``_lock``; every method that
touches it takes it. The in-memory ``_refs`` map mirrors ``block_refs`` for
the read path: it is written under ``_lock``, and ``lookup`` reads it
without the lock (one dict lookup is atomic under the GIL), so a read never
waits for a commit and the policies may look a block up under a tier's
lock. A writer therefore never empties an entry it is about to set again.
"""

from __future__ import annotations

import functools
import logging
import re
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Concatenate, NamedTuple, ParamSpec, TypeVar

log = logging.getLogger(__name__)

# An index of another version is set aside whole (the cache is advisory), so
# no code reads an older one, nor the block files it names: they become
# orphans, which start-up deletes. 3: every saved listing carries its
# checksum. 4: a raw tier's block file is the block's bare content, no frame
# header (codec.py), so an older hot tier's frames are never served as content.
SCHEMA_VERSION = 4
# The meta row naming the block size the references were made at.
BLOCK_SIZE_META = "block_size"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS blocks (
    hash TEXT PRIMARY KEY,
    tier TEXT NOT NULL,
    disk_bytes INTEGER NOT NULL,
    raw_bytes INTEGER NOT NULL,
    last_used REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS block_refs (
    source TEXT NOT NULL,
    key TEXT NOT NULL,
    etag TEXT NOT NULL,
    block INTEGER NOT NULL,
    hash TEXT NOT NULL REFERENCES blocks(hash),
    PRIMARY KEY (source, key, etag, block)
);
CREATE INDEX IF NOT EXISTS block_refs_by_hash ON block_refs(hash);
CREATE TABLE IF NOT EXISTS identities (
    etag TEXT NOT NULL,
    size INTEGER NOT NULL,
    block INTEGER NOT NULL,
    hash TEXT NOT NULL,
    PRIMARY KEY (etag, size, block)
);
CREATE TABLE IF NOT EXISTS listings (
    source TEXT NOT NULL,
    prefix TEXT NOT NULL,
    fetched_at REAL NOT NULL,
    payload BLOB NOT NULL,
    PRIMARY KEY (source, prefix)
);
"""


# The block number under which a version's whole file is recorded
# (``tiered.TieredCache.assemble_whole``): one raw file of all its bytes,
# made of its blocks, for the kernel to read itself (FUSE passthrough). No
# block has a negative number, so code that walks a version's blocks (0, 1,
# ...) never meets it, and the row is told from a block's by its number
# alone: its file is dropped, never demoted, when evicted (``is_whole``).
WHOLE = -1


class BlockRef(NamedTuple):
    """Block ``block`` of one version of one object of one source. A tuple:
    one is made and hashed on every read, at a third of a frozen
    dataclass's cost."""

    source: str
    key: str
    etag: str
    block: int


@dataclass(frozen=True, slots=True)
class StoredBlock:
    hash: str
    tier: str
    disk_bytes: int
    raw_bytes: int
    last_used: float


class IndexSchemaMismatch(Exception):
    """The index was written by another schema version."""


class IndexDamaged(Exception):
    """A value the index holds that we could not have written: damage that
    sqlite's own checks do not see (a flipped byte in a row, a torn page's
    empty rows). The index is set aside, as one sqlite finds corrupt."""


# sqlite's errors, by primary result code (the low byte of the extended
# code: SQLITE_CORRUPT_INDEX counts as SQLITE_CORRUPT). Damage, set aside:
# the file's pages are corrupt, or it is not a database. SQLITE_ERROR is
# any failed statement, our bugs too, which must not throw a warm cache
# away: it is damage only when the schema read back is not ours
# (``Index.schema_problem``), which raises ``IndexDamaged`` then. Every other
# code is the environment's (a full or read-only disk, permissions, locks,
# I/O): reported, since a new index would fail the same way.
_DAMAGED = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})

# The index's structure as sqlite reads it back: each table's columns
# (type, NOT NULL, place in the primary key) and each index's columns.
# Compared with the same of ``_SCHEMA`` made in memory, so a schema row
# damaged into another valid one (a renamed column or table, an index on
# another column) is told from a statement of ours that fails.
_SHAPE = """
SELECT m.type, m.name, m.tbl_name, c.name, c.type, c."notnull", c.pk
FROM sqlite_schema AS m, pragma_table_info(m.name) AS c WHERE m.type = 'table'
UNION ALL
SELECT m.type, m.name, m.tbl_name, c.name, NULL, NULL, c.seqno
FROM sqlite_schema AS m, pragma_index_info(m.name) AS c WHERE m.type = 'index'
"""
Shape = frozenset[tuple[object, ...]]


def _shape_of(db: sqlite3.Connection) -> Shape:
    return frozenset(db.execute(_SHAPE).fetchall())


@functools.cache
def _our_shape() -> Shape:
    db = sqlite3.connect(":memory:")
    try:
        db.executescript(_SCHEMA)
        return _shape_of(db)
    finally:
        db.close()


def _primary_code(exc: sqlite3.Error) -> int | None:
    code: int | None = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def is_damage(exc: sqlite3.DatabaseError | IndexDamaged) -> bool:
    """Whether the index file is not an intact one of ours (``_DAMAGED``).
    An OperationalError with no code is raised by Python's sqlite3 reading
    a value that is not UTF-8 text (a flipped byte), damage too. Not any
    other error without a code: a ProgrammingError is our bug."""
    if isinstance(exc, IndexDamaged):
        return True
    code = _primary_code(exc)
    if code is None:
        return isinstance(exc, sqlite3.OperationalError)
    return code in _DAMAGED


def damage_note(path: Path) -> Path:
    """Where damage found in the index at ``path`` after its load (by a
    daemon while serving, by ``verify``) is noted, for the next open to set
    the index aside."""
    return path.with_name(f"{path.name}.damage-found")


P = ParamSpec("P")
R = TypeVar("R")


def _noting_damage(method: Callable[Concatenate[Index, P], R]) -> Callable[Concatenate[Index, P], R]:
    """Damage sqlite notices only when a statement reaches it (a page of an
    index that only writes read) is noted for the next open: the
    error still goes to the caller, for whom the cache is best effort.
    While the cache opens, the damage is raised, for the open to set the
    index aside."""

    @functools.wraps(method)
    def wrapper(index: Index, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(index, *args, **kwargs)
        except (sqlite3.DatabaseError, IndexDamaged) as exc:
            damage = index.damage_in(exc)
            if damage is not None and not index.serving and damage is not exc:
                raise damage from exc
            if damage is not None and index.serving and index.note_damage(damage):
                log.error("%s is damaged (%s): the next mount sets it aside", index.path, damage)
            raise

    return wrapper  # type: ignore[return-value]  # functools.wraps's type keeps no Concatenate


# A block's name: xxh3_128 in hex (``codec.content_hash``).
_HASH = re.compile(r"[0-9a-f]{32}")


def _integer(value: object, what: str) -> int:
    """A count, a size or a number the index stores as text."""
    if isinstance(value, str) and value.isdecimal():
        value = int(value)
    if type(value) is not int or value < 0:
        raise IndexDamaged(f"{what} is {value!r}")
    return value


def _block_number(value: object) -> int:
    """A reference's block number: a block's, or ``WHOLE``."""
    return WHOLE if value == WHOLE and type(value) is int else _integer(value, "a block number")


def _block_name(digest: object) -> str:
    if not isinstance(digest, str) or not _HASH.fullmatch(digest):
        raise IndexDamaged(f"block name {digest!r}")
    return digest


def _stored_block(
    digest: object, tier: object, disk_bytes: object, raw_bytes: object, last_used: object
) -> StoredBlock:
    if not isinstance(tier, str) or not isinstance(last_used, float | int):
        raise IndexDamaged(f"block {digest!r}: tier {tier!r}, last used {last_used!r}")
    return StoredBlock(
        _block_name(digest),
        tier,
        _integer(disk_bytes, "a block's size on disk"),
        _integer(raw_bytes, "a block's size"),
        last_used,
    )


class Index:
    """A cache directory's sqlite index: which content hash holds block i of (source, key, etag),
    where each block lies, and the saved listings; the references are mirrored in memory for the
    hot path."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._serving = False
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            self._load()
        except BaseException:
            self._db.close()  # a damaged index is set aside: not held open meanwhile
            raise

    def _load(self) -> None:
        note = damage_note(self._path)
        if note.is_file():
            raise IndexDamaged(f"noted before: {note.read_text(errors='replace').strip()}")
        try:
            self._load_checked()
        except sqlite3.DatabaseError as exc:
            damage = self.damage_in(exc)
            if damage is not None and damage is not exc:
                raise damage from exc
            raise

    def _load_checked(self) -> None:
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL is durable against process crashes (the kill -9 case) and
        # cheap; a power loss can lose the last commits, which only costs
        # re-fetches because start-up reconciles files against rows.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        row = self._db.execute("SELECT value FROM meta WHERE name='schema_version'").fetchone()
        if row is None:
            self._db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        elif _integer(row[0], "the schema version") != SCHEMA_VERSION:
            raise IndexSchemaMismatch(f"{self._path} has schema {row[0]}, expected {SCHEMA_VERSION}")
        problem = self._schema_problem_locked()
        if problem is not None:
            raise IndexDamaged(problem)
        self._refs: dict[BlockRef, str] = {}
        self._refs_by_hash: dict[str, set[BlockRef]] = {}
        for source, key, etag, block, digest in self._db.execute(
            "SELECT source, key, etag, block, hash FROM block_refs"
        ):
            ref = BlockRef(source, key, etag, _block_number(block))
            # A key sqlite holds once: twice, a flipped block number made one
            # block's row name another's, whose bytes it then served.
            if not (type(source) is str and type(key) is str and type(etag) is str) or ref in self._refs:
                raise IndexDamaged(f"block reference {ref}")
            self._add_ref_locked(ref, _block_name(digest))

    def damage_in(
        self, exc: sqlite3.DatabaseError | IndexDamaged
    ) -> sqlite3.DatabaseError | IndexDamaged | None:
        """The damage ``exc`` shows (``is_damage``: ``exc`` itself), or,
        after a statement failed with SQLITE_ERROR, ``IndexDamaged`` when the
        schema sqlite reads back is not ours; None when the index is intact."""
        if is_damage(exc):
            return exc
        if isinstance(exc, IndexDamaged) or _primary_code(exc) != sqlite3.SQLITE_ERROR:
            return None
        with self._lock:
            problem = self._schema_problem_locked()
        return None if problem is None else IndexDamaged(f"{problem} ({exc})")

    def _schema_problem_locked(self) -> str | None:
        """What is wrong with the schema sqlite reads back; None when it is ours."""
        try:
            shape = _shape_of(self._db)
        except sqlite3.DatabaseError as exc:
            # _SHAPE reads the schema and nothing else: failing with
            # SQLITE_ERROR, it met a schema sqlite cannot read (a header
            # that says a later file format, say).
            if _primary_code(exc) == sqlite3.SQLITE_ERROR or is_damage(exc):
                return f"its schema cannot be read: {exc}"
            raise
        differ = sorted({str(row[1]) for row in shape ^ _our_shape()})
        return f"the schema of {', '.join(differ)} is not ours" if differ else None

    def _add_ref_locked(self, ref: BlockRef, digest: str) -> None:
        previous = self._refs.get(ref)
        if previous is not None and previous != digest:
            self._unhold_locked(previous, ref)
        self._refs[ref] = digest  # replaced in one step: a lookup meanwhile sees one or the other
        self._refs_by_hash.setdefault(digest, set()).add(ref)

    def _unhold_locked(self, digest: str, ref: BlockRef) -> None:
        holders = self._refs_by_hash[digest]
        holders.discard(ref)
        if not holders:
            del self._refs_by_hash[digest]

    def _drop_ref_locked(self, ref: BlockRef) -> str:
        digest = self._refs.pop(ref)
        self._unhold_locked(digest, ref)
        return digest

    @property
    def path(self) -> Path:
        return self._path

    @property
    def serving(self) -> bool:
        """Whether the cache over this index is open (``start_serving``)."""
        return self._serving

    def start_serving(self) -> None:
        """The cache is open: damage found from now on is noted for the
        next open (``_noting_damage``); found before, the open handles it."""
        self._serving = True

    def note_damage(self, exc: sqlite3.DatabaseError | IndexDamaged) -> bool:
        """Note damage found after the load, for the next open to set the
        index aside; False if it was noted already (or cannot be)."""
        note = damage_note(self._path)
        if note.is_file():
            return False
        try:
            note.write_text(f"{exc}\n")
        except OSError as write_failed:
            log.warning("cannot note the damage of %s in %s: %s", self._path, note, write_failed)
            return False
        return True

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- blocks ---------------------------------------------------------

    def lookup(self, ref: BlockRef) -> str | None:
        return self._refs.get(ref)  # without the lock: see the module's docstring

    def is_whole(self, digest: str) -> bool:
        """Whether ``digest`` is a whole file (``WHOLE``), not a block. From
        the references, as the index holds them, so it holds after a restart."""
        with self._lock:
            return any(ref.block == WHOLE for ref in self._refs_by_hash.get(digest, ()))

    def check_integrity(self) -> None:
        """sqlite's own full check (slow: ``verify`` only). Damage in an
        index of a table, say, is otherwise only seen by the write that
        reaches it."""
        with self._lock:
            problem = self._db.execute("PRAGMA integrity_check(1)").fetchone()[0]
        if problem != "ok":
            raise IndexDamaged(f"integrity check: {problem}")

    @_noting_damage
    def blocks(self) -> list[StoredBlock]:
        """Every stored block, least recently used first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT hash, tier, disk_bytes, raw_bytes, last_used FROM blocks ORDER BY last_used"
            ).fetchall()
        return [_stored_block(*row) for row in rows]

    @_noting_damage
    def record(self, ref: BlockRef, stored: StoredBlock, identity: tuple[str, int] | None = None) -> None:
        """Name ``stored.hash`` as the content of ``ref``, adding the block if
        new. ``identity`` (etag, object size) also files the block under the
        object's content identity, for stores whose etags identify content."""
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT OR IGNORE INTO blocks VALUES (?, ?, ?, ?, ?)",
                (stored.hash, stored.tier, stored.disk_bytes, stored.raw_bytes, stored.last_used),
            )
            self._db.execute(
                "INSERT OR REPLACE INTO block_refs VALUES (?, ?, ?, ?, ?)",
                (ref.source, ref.key, ref.etag, ref.block, stored.hash),
            )
            if identity is not None:
                self._db.execute(
                    "INSERT OR REPLACE INTO identities VALUES (?, ?, ?, ?)",
                    (*identity, ref.block, stored.hash),
                )
            self._add_ref_locked(ref, stored.hash)

    @_noting_damage
    def lookup_identity(self, etag: str, size: int, block: int) -> str | None:
        """A cached block of any object with this content identity."""
        with self._lock:
            row = self._db.execute(
                "SELECT hash FROM identities WHERE etag=? AND size=? AND block=?", (etag, size, block)
            ).fetchone()
        return None if row is None else row[0]

    @_noting_damage
    def move_block(self, digest: str, tier: str, disk_bytes: int) -> None:
        """The block now lives in ``tier`` (promotion, demotion)."""
        with self._lock, self._db:
            self._db.execute(
                "UPDATE blocks SET tier=?, disk_bytes=? WHERE hash=?", (tier, disk_bytes, digest)
            )

    @_noting_damage
    def save_meta(self, name: str, value: str) -> None:
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (name, value))

    @_noting_damage
    def load_meta(self, name: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE name=?", (name,)).fetchone()
        return None if row is None else row[0]

    @_noting_damage
    def filled_at(self, block_size: int) -> int | None:
        """The block size this cache was filled at, when it is not
        ``block_size``; None when the references fit ``block_size``. Block i
        at 4 MiB is not block i at 1 MiB: served as one another, a reader
        gets the wrong bytes. An index whose size could not be recorded
        (its disk was full when it was opened) is judged by its blocks
        (``_refs_fit``); 0 when they do not fit."""
        recorded = self.load_meta(BLOCK_SIZE_META)
        if recorded is not None:
            previous = _integer(recorded, "the block size")
            return None if previous == block_size else previous
        with self._lock:
            return None if self._refs_fit_locked(block_size) else 0

    def _refs_fit_locked(self, block_size: int) -> bool:
        """Whether every reference can be block i at ``block_size``: no
        block is larger, and the first block of an object of several is
        full. Whatever size filled the cache, references that pass are
        right (single-block objects no larger than the new size are the
        same block at both sizes). A whole file (``WHOLE``) is an object's
        bytes at any block size."""
        too_large = self._db.execute(
            "SELECT 1 FROM blocks WHERE raw_bytes > ? AND hash NOT IN "
            "(SELECT hash FROM block_refs WHERE block = ?) LIMIT 1",
            (block_size, WHOLE),
        ).fetchone()
        short_first = self._db.execute(
            "SELECT 1 FROM block_refs AS first JOIN blocks ON blocks.hash = first.hash "
            "WHERE first.block = 0 AND blocks.raw_bytes < ? AND EXISTS ("
            "SELECT 1 FROM block_refs AS second WHERE second.source = first.source "
            "AND second.key = first.key AND second.etag = first.etag AND second.block = 1) LIMIT 1",
            (block_size,),
        ).fetchone()
        return too_large is None and short_first is None

    @_noting_damage
    def use_block_size(self, block_size: int) -> None:
        """Drop every reference (and identity), made at another block size
        as ``filled_at`` said, and record ``block_size``; the blocks are
        then unreferenced, which reconciling removes. The references are
        forgotten in memory first, so that even when the index cannot be
        written (a full disk) none is served."""
        with self._lock:
            self._refs.clear()
            self._refs_by_hash.clear()
            with self._db:
                self._db.execute("BEGIN")
                self._db.execute("DELETE FROM block_refs")
                self._db.execute("DELETE FROM identities")
                self._db.execute(
                    "INSERT OR REPLACE INTO meta VALUES (?, ?)", (BLOCK_SIZE_META, str(block_size))
                )

    @_noting_damage
    def remove_block(self, digest: str) -> None:
        """Forget a block and every reference to it (eviction, corruption)."""
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM block_refs WHERE hash=?", (digest,))
            self._db.execute("DELETE FROM identities WHERE hash=?", (digest,))
            self._db.execute("DELETE FROM blocks WHERE hash=?", (digest,))
            for ref in self._refs_by_hash.pop(digest, set()):
                del self._refs[ref]

    @_noting_damage
    def release_version(self, source: str, key: str, etag: str, block_count: int) -> list[str]:
        """Drop the references of one version of ``key`` (it changed or was
        deleted), its whole file's too; return the hashes nothing references any more, for the
        caller to delete."""
        with self._lock, self._db:
            self._db.execute("BEGIN")
            candidates = (BlockRef(source, key, etag, block) for block in (WHOLE, *range(block_count)))
            stale = [ref for ref in candidates if ref in self._refs]
            if not stale:
                return []
            hashes = {self._drop_ref_locked(ref) for ref in stale}
            self._db.execute(
                "DELETE FROM block_refs WHERE source=? AND key=? AND etag=?", (source, key, etag)
            )
            return [digest for digest in hashes if digest not in self._refs_by_hash]

    @_noting_damage
    def unreferenced(self) -> list[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT hash FROM blocks WHERE hash NOT IN (SELECT hash FROM block_refs)"
            ).fetchall()
        return [row[0] for row in rows]

    @_noting_damage
    def save_last_used(self, last_used: dict[str, float]) -> None:
        """Persist recency so eviction order survives a restart."""
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.executemany(
                "UPDATE blocks SET last_used=? WHERE hash=?", [(t, h) for h, t in last_used.items()]
            )

    @_noting_damage
    def resident_bytes_by_prefix(self, source: str) -> list[tuple[str, str, int]]:
        """(prefix, tier, raw bytes) of the cached blocks ``source``'s keys
        reference, where prefix is a key's first path component (``''`` for
        keys at the root). A block shared by keys of several prefixes counts
        for each: the question is how much of each prefix reads locally.

        A full scan of ``block_refs``, so it runs on its own read-only
        connection: WAL readers never wait on the writer, and the data path
        never waits on this (it does not take ``_lock``). Call it every few
        seconds at most, never per read. Raises ``sqlite3.Error``."""
        uri = self._path.resolve().as_uri() + "?mode=ro"
        db = sqlite3.connect(uri, uri=True, check_same_thread=False)
        try:
            return [
                (prefix, tier, int(nbytes))
                for prefix, tier, nbytes in db.execute(
                    """
                    SELECT CASE WHEN instr(r.key, '/') > 0
                                THEN substr(r.key, 1, instr(r.key, '/') - 1) ELSE '' END AS prefix,
                           b.tier, SUM(b.raw_bytes)
                    FROM block_refs AS r JOIN blocks AS b ON b.hash = r.hash
                    WHERE r.source = ?
                    GROUP BY prefix, b.tier
                    ORDER BY prefix, b.tier
                    """,
                    (source,),
                )
            ]
        finally:
            db.close()

    # -- listings ---------------------------------------------------------

    @_noting_damage
    def save_listing(self, source: str, prefix: str, fetched_at: float, payload: bytes) -> None:
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO listings VALUES (?, ?, ?, ?)", (source, prefix, fetched_at, payload)
            )

    @_noting_damage
    def load_listing(self, source: str, prefix: str) -> tuple[float, bytes] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT fetched_at, payload FROM listings WHERE source=? AND prefix=?", (source, prefix)
            ).fetchone()
        return None if row is None else (row[0], row[1])

"""The upload journal: what a writable mount still owes the bucket, in
``writes.sqlite`` under the cache directory, so that neither a ``kill -9``
nor a reboot loses it.

One row per staged file (``staged.py``) of a source, numbered in the
order they are to reach the bucket. A staged file's row is written before the file is, and marked closed once
the last writer closed it: only closed files are uploaded, and a file
found unclosed at the next mount was being written when the daemon died,
so it is set aside, never published. A row is deleted only once its
operation is done in the bucket.

sqlite in WAL mode with ``synchronous=FULL``: a row committed survives a
power loss (rows change at opens and closes, not at each write).
Concurrency: one connection, guarded by ``_lock``.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

JOURNAL_NAME = "writes.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS ops (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    source TEXT NOT NULL,
    key TEXT NOT NULL,
    file TEXT NOT NULL,
    closed INTEGER NOT NULL DEFAULT 0,
    size INTEGER NOT NULL DEFAULT 0,
    mtime REAL NOT NULL DEFAULT 0
);
CREATE UNIQUE INDEX IF NOT EXISTS one_staged_file_a_key ON ops (source, key);
"""


@dataclass(frozen=True, slots=True)
class Op:
    """One staged file to upload; ``file`` is its name in the staged directory."""

    id: int
    key: str
    file: str
    closed: bool
    size: int
    mtime: float


class Journal:
    """The pending operations of every source cached in one cache directory."""

    def __init__(self, cache_dir: Path) -> None:
        path = cache_dir / JOURNAL_NAME
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        path.chmod(0o600)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def pending(self, source: str) -> list[Op]:
        """``source``'s operations, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, key, file, closed, size, mtime FROM ops WHERE source = ? ORDER BY id",
                (source,),
            ).fetchall()
        return [Op(row[0], row[1], row[2], bool(row[3]), row[4], row[5]) for row in rows]

    def files(self) -> set[str]:
        """The staged files every source's rows name."""
        with self._lock:
            return {row[0] for row in self._db.execute("SELECT file FROM ops")}

    def staged(self, source: str, key: str, file: str, mtime: float) -> int:
        """A new staged file for ``key`` (replacing any staged before it,
        whose row the caller dropped); its operation's id."""
        with self._lock:
            cursor = self._db.execute(
                "INSERT INTO ops (source, key, file, mtime) VALUES (?, ?, ?, ?)",
                (source, key, file, mtime),
            )
        assert cursor.lastrowid is not None
        return cursor.lastrowid

    def closed(self, op: int, size: int, mtime: float) -> None:
        """The staged file of ``op`` is closed at ``size`` bytes: due for upload."""
        with self._lock:
            self._db.execute("UPDATE ops SET closed = 1, size = ?, mtime = ? WHERE id = ?", (size, mtime, op))

    def reopened(self, op: int) -> None:
        """The staged file of ``op`` is open for writing again: not due."""
        with self._lock:
            self._db.execute("UPDATE ops SET closed = 0 WHERE id = ?", (op,))

    def moved(self, op: int, source: str, key: str) -> int:
        """The staged file of ``op`` now stands for ``key``: its operation
        goes to the end of the queue under a new id, which is returned."""
        with self._lock, self._db:
            self._db.execute("BEGIN")
            row = self._db.execute("SELECT file, closed, size, mtime FROM ops WHERE id = ?", (op,)).fetchone()
            self._db.execute("DELETE FROM ops WHERE id = ?", (op,))
            cursor = self._db.execute(
                "INSERT INTO ops (source, key, file, closed, size, mtime) VALUES (?, ?, ?, ?, ?, ?)",
                (source, key, *row),
            )
        assert cursor.lastrowid is not None
        return cursor.lastrowid

    def done(self, op: int) -> None:
        """``op`` is uploaded (or its file dropped): its row goes."""
        with self._lock:
            self._db.execute("DELETE FROM ops WHERE id = ?", (op,))

"""The sqlite index: persistence, derived refcounts, and schema versioning."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from cachefsd.cache.codec import content_hash
from cachefsd.cache.index import (
    BlockRef,
    Index,
    IndexDamaged,
    IndexSchemaMismatch,
    StoredBlock,
    damage_note,
    is_damage,
)


def stored(name: str) -> StoredBlock:
    return StoredBlock(hashed(name), "hot", 4096, 10, 0.0)


def hashed(name: str) -> str:
    """A block name (32 hex digits) for a readable one."""
    return content_hash(name.encode())


def test_records_survive_reopen(tmp_path: Path) -> None:
    path = tmp_path / "index.sqlite"
    index = Index(path)
    ref = BlockRef("s3://b", "k", "e1", 0)
    index.record(ref, stored("h1"))
    index.save_listing("s3://b", "", 123.0, b"payload")
    index.close()
    reopened = Index(path)
    assert reopened.lookup(ref) == hashed("h1")
    assert [block.hash for block in reopened.blocks()] == [hashed("h1")]
    assert reopened.load_listing("s3://b", "") == (123.0, b"payload")
    reopened.close()


def test_a_block_shared_by_two_versions_is_freed_only_with_the_last(tmp_path: Path) -> None:
    index = Index(tmp_path / "index.sqlite")
    old, new = BlockRef("src", "k", "old", 0), BlockRef("src", "k", "new", 0)
    index.record(old, stored("shared"))
    index.record(new, stored("shared"))
    index.record(BlockRef("src", "k", "old", 1), stored("only-old"))
    assert sorted(index.release_version("src", "k", "old", block_count=2)) == [hashed("only-old")]
    assert index.lookup(old) is None
    assert index.lookup(new) == hashed("shared")
    assert index.unreferenced() == [hashed("only-old")]
    index.close()


def test_remove_block_drops_every_reference(tmp_path: Path) -> None:
    index = Index(tmp_path / "index.sqlite")
    refs = [BlockRef("src", f"k{i}", "e", 0) for i in range(3)]
    for ref in refs:
        index.record(ref, stored("same"))
    index.remove_block(hashed("same"))
    assert all(index.lookup(ref) is None for ref in refs)
    assert index.blocks() == []
    index.close()


def test_an_index_of_another_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "index.sqlite"
    Index(path).close()
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value='999' WHERE name='schema_version'")
    with pytest.raises(IndexSchemaMismatch):
        Index(path)


def test_content_identity_finds_blocks_of_other_objects(tmp_path: Path) -> None:
    index = Index(tmp_path / "index.sqlite")
    index.record(BlockRef("s3://a", "x", "md5", 2), stored("h"), identity=("md5", 10_000))
    assert index.lookup_identity("md5", 10_000, 2) == hashed("h")
    assert index.lookup_identity("md5", 10_001, 2) is None  # same etag, other size: not the same content
    index.remove_block(hashed("h"))
    assert index.lookup_identity("md5", 10_000, 2) is None
    index.close()


def _failure(path: Path, statements: str, *, timeout: float = 5.0) -> sqlite3.DatabaseError:
    """What sqlite raises for the last of ``statements`` on the file at ``path``."""
    *setup, last = statements.split(";")
    database = sqlite3.connect(path, isolation_level=None, timeout=timeout)
    try:
        database.executescript(";".join(setup))
        with pytest.raises(sqlite3.DatabaseError) as raised:
            database.execute(last).fetchall()
        return raised.value
    finally:
        database.close()


def _run(path: Path, script: str) -> None:
    database = sqlite3.connect(path, isolation_level=None)
    try:
        database.executescript(script)
    finally:
        database.close()


def _write_header(path: Path, offset: int, value: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + 4] = value.to_bytes(4, "big")
    path.write_bytes(bytes(data))


def test_sqlite_errors_are_damage_by_their_code(tmp_path: Path) -> None:
    """Each row of the classification, from a real file: a corrupt or
    foreign file is damage (set aside); the environment's errors are not
    (reported: a new index would fail the same way)."""
    path = tmp_path / "index.sqlite"
    Index(path).close()
    # SQLITE_CORRUPT: a schema row sqlite cannot parse.
    broken = tmp_path / "broken.sqlite"
    broken.write_bytes(path.read_bytes())
    _run(
        broken,
        "PRAGMA writable_schema = ON; UPDATE sqlite_master SET sql = 'CREATE TABLE blocks (' "
        "WHERE name = 'blocks'",
    )
    corrupt = _failure(broken, "SELECT * FROM blocks")
    assert corrupt.sqlite_errorcode & 0xFF == sqlite3.SQLITE_CORRUPT
    assert is_damage(corrupt)
    # SQLITE_NOTADB: not a database at all.
    (tmp_path / "notes.sqlite").write_bytes(b"not a database" * 100)
    foreign = _failure(tmp_path / "notes.sqlite", "SELECT 1 FROM sqlite_master")
    assert foreign.sqlite_errorcode == sqlite3.SQLITE_NOTADB
    assert is_damage(foreign)
    # No code: Python's sqlite3 reading text that is not UTF-8 (a flipped byte).
    undecodable = _failure(
        path, "INSERT INTO listings VALUES (CAST(x'68ff74' AS TEXT), '', 0, x''); SELECT source FROM listings"
    )
    assert getattr(undecodable, "sqlite_errorcode", None) is None
    assert is_damage(undecodable)
    # SQLITE_FULL, SQLITE_READONLY, SQLITE_BUSY: the environment's.
    full = _failure(
        path, "PRAGMA max_page_count = 1; INSERT INTO listings VALUES ('s', 'p', 0, zeroblob(100000))"
    )
    assert full.sqlite_errorcode == sqlite3.SQLITE_FULL
    read_only = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    with pytest.raises(sqlite3.OperationalError) as refused:
        read_only.execute("INSERT INTO meta VALUES ('y', 'z')")
    read_only.close()
    assert refused.value.sqlite_errorcode == sqlite3.SQLITE_READONLY
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    busy = _failure(path, "INSERT INTO meta VALUES ('y', 'z')", timeout=0)
    holder.close()
    assert busy.sqlite_errorcode == sqlite3.SQLITE_BUSY
    for environment in (full, refused.value, busy):
        assert not is_damage(environment)


def test_a_failed_statement_is_damage_only_when_the_schema_is_not_ours(tmp_path: Path) -> None:
    """SQLITE_ERROR is any failed statement, our bugs too: the index reads
    its schema back and compares it with its own before it calls it damage."""
    path = tmp_path / "index.sqlite"
    index = Index(path)
    for statement in ("SELEC 1", "BEGIN; BEGIN", "SELECT nothing FROM blocks", "SELECT * FROM gone"):
        error = _failure(path, statement)
        assert error.sqlite_errorcode == sqlite3.SQLITE_ERROR
        assert not is_damage(error)
        assert index.damage_in(error) is None  # our schema, intact: not damage
    index.close()
    _run(
        path,
        "PRAGMA writable_schema = ON; "
        "UPDATE sqlite_master SET sql = replace(sql, 'last_used REAL', 'last_usex REAL') "
        "WHERE name = 'blocks'",
    )
    with pytest.raises(IndexDamaged, match="the schema of blocks is not ours"):
        Index(path)


def test_an_index_whose_schema_sqlite_cannot_read_is_damage(tmp_path: Path) -> None:
    """A header naming a schema format this sqlite does not know: every
    statement fails with SQLITE_ERROR ("unsupported file format")."""
    path = tmp_path / "index.sqlite"
    Index(path).close()
    _write_header(path, 44, 9)  # the schema format number (1 to 4)
    with pytest.raises(IndexDamaged, match="its schema cannot be read") as raised:
        Index(path)
    assert isinstance(raised.value.__cause__, sqlite3.OperationalError)
    assert raised.value.__cause__.sqlite_errorcode == sqlite3.SQLITE_ERROR


def test_damage_is_noted_once_and_a_note_that_cannot_be_written_is_no_error(tmp_path: Path) -> None:
    index = Index(tmp_path / "index.sqlite")
    assert index.note_damage(IndexDamaged("first"))
    assert not index.note_damage(IndexDamaged("second"))
    assert damage_note(index.path).read_text() == "first\n"
    damage_note(index.path).unlink()
    damage_note(index.path).mkdir()
    assert not index.note_damage(IndexDamaged("third"))
    index.close()

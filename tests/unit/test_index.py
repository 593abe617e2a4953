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


def test_only_damage_is_damage(tmp_path: Path) -> None:
    """A damaged index is thrown away, so a failed statement of ours (a bug)
    or of the environment must not count: only a corrupt file, or our own
    schema that cannot be read back."""
    database = sqlite3.connect(tmp_path / "db.sqlite")
    database.execute("CREATE TABLE t (a)")

    def error_of(statement: str) -> sqlite3.DatabaseError:
        with pytest.raises(sqlite3.DatabaseError) as raised:
            database.execute(statement)
        return raised.value

    assert not is_damage(error_of("SELEC 1"))
    assert not is_damage(error_of("BEGIN; BEGIN"))
    assert is_damage(error_of("SELECT b FROM t"))  # no such column
    assert is_damage(error_of("SELECT a FROM gone"))  # no such table
    database.close()
    (tmp_path / "notes.sqlite").write_bytes(b"not a database" * 100)
    with pytest.raises(sqlite3.DatabaseError) as raised:
        sqlite3.connect(tmp_path / "notes.sqlite").execute("SELECT 1 FROM sqlite_master")
    assert is_damage(raised.value)


def test_damage_is_noted_once_and_a_note_that_cannot_be_written_is_no_error(tmp_path: Path) -> None:
    index = Index(tmp_path / "index.sqlite")
    assert index.note_damage(IndexDamaged("first"))
    assert not index.note_damage(IndexDamaged("second"))
    assert damage_note(index.path).read_text() == "first\n"
    damage_note(index.path).unlink()
    damage_note(index.path).mkdir()
    assert not index.note_damage(IndexDamaged("third"))
    index.close()

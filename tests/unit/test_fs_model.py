"""The filesystem against a model: a hypothesis state machine puts,
overwrites and deletes objects, opens (looks up), reads and releases
(forgets) files and moves the clock, and checks every answer against a plain dict of the bucket and
of what each directory's listing shows.

The model of the listings is exact, not a range of answers: a directory's
listing is taken at its first lookup and again at the first lookup past
the TTL (the lookup waits for that refresh, as the store answers: the
rig's fresh wait is long), or at once after a read found the object it
shows changed (SEMANTICS.md, "When the bucket changes"). No prefetch runs
(the rig's prefetcher is not started), so a block is cached only if a
read brought it.

Run with ``--hypothesis-show-statistics`` to see how often a run reached
a stale listing or a read of a replaced version.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from cachefsd.aio import LoopThread
from cachefsd.config import FetchSettings
from cachefsd.errors import ObjectChanged, ObjectNotFound
from cachefsd.reader import block_range
from tests.unit.conftest import BLOCK_SIZE, build_rig, joined, looked_up

# Hypothesis shrinks a failure for up to 300 s of its own, which the suite's
# timeout of the same length would cut short, counterexample unprinted.
pytestmark = pytest.mark.timeout(600)

TTL_SECONDS = 10.0
NAMES = ("a", "d/c")  # "d" is a directory while "d/c" exists
NEVER_PUT = ("zz", "d/zz", "q/zz")
# An empty file, one shorter than a block, a block exactly, and one whose
# last block is short (a read can span blocks, stop at the end, and find
# some of them cached and others not).
SIZES = (0, 100, BLOCK_SIZE, 3 * BLOCK_SIZE + 100)
OFFSETS = (0, 1, BLOCK_SIZE - 1, BLOCK_SIZE, 2 * BLOCK_SIZE, 3 * BLOCK_SIZE, 4 * BLOCK_SIZE)
READ_SIZES = (1, 100, BLOCK_SIZE, 2 * BLOCK_SIZE + 1)
# Clock steps: within the TTL, to it exactly (expired: a listing is fresh
# while younger than the TTL), and past it.
STEPS_SECONDS = (TTL_SECONDS / 2, TTL_SECONDS, TTL_SECONDS + 1)
# The fetcher's defaults: an in-memory store that injects no fault never
# comes near them, however loaded the machine.
PATIENT_FETCH = FetchSettings()


def etag(content: bytes) -> str:
    return hashlib.md5(content).hexdigest()  # as MemoryStore's


@dataclass
class Listed:
    """What the namespace shows for one directory: name -> content, or None
    for a subdirectory."""

    entries: dict[str, bytes | None]
    taken_at: float


@dataclass
class Handle:
    """One reference the kernel holds to an inode: an open file, an mmap."""

    inode: int
    key: str
    content: bytes  # the version it was opened on
    version: str  # its etag
    # At some moment since the open the bucket did not hold that version:
    # an uncached read of it may fail from then on (even once it is back,
    # as the reader remembers versions it found gone).
    broken: bool
    read_blocks: set[int] = field(default_factory=set)  # blocks it read


class FileSystemAgainstAModel(RuleBasedStateMachine):
    handles = Bundle("handles")
    io: LoopThread  # set by ``fixture_machine_io``, shared by every run

    def __init__(self) -> None:
        super().__init__()
        self._directory = tempfile.TemporaryDirectory(prefix="cachefsd-fs-model-")
        self.rig = build_rig(
            self.io, Path(self._directory.name) / "cache", ttl=TTL_SECONDS, fetch=PATIENT_FETCH
        )
        self.bucket: dict[str, bytes] = {}
        self.changed_at: dict[str, float] = {}  # key -> when it was last put or deleted
        self.listed: dict[str, Listed] = {}  # directory prefix ("" or "d/") -> its listing
        self.open: dict[int, Handle] = {}  # reference -> what it holds
        self.references = itertools.count(1)
        self.ever_read: dict[str, set[int]] = {}  # etag -> blocks some read brought into the cache
        self.versions_made = 0

    def teardown(self) -> None:
        self.rig.index.close()
        self._directory.cleanup()

    @property
    def now(self) -> float:
        return self.rig.clock.now

    # -- the model of the listings ------------------------------------------

    def _listing(self, prefix: str) -> dict[str, bytes | None]:
        """The listing a lookup of ``prefix`` gets now, taken again if it
        was never taken, has expired, or was dropped."""
        listed = self.listed.get(prefix)
        if listed is None or self.now - listed.taken_at >= TTL_SECONDS:
            entries: dict[str, bytes | None] = {}
            for key, content in self.bucket.items():
                if key.startswith(prefix):
                    name, below, _ = key[len(prefix) :].partition("/")
                    entries[name] = None if below else content
            listed = self.listed[prefix] = Listed(entries, self.now)
        return listed.entries

    def _expected(self, path: str) -> bytes | None:
        """The content an open of ``path`` finds now; None: no such file.
        Resolves the parent directories in order, as the namespace does."""
        *parents, name = path.split("/")
        prefix = ""
        for parent in parents:
            if parent not in self._listing(prefix):
                return None
            prefix += parent + "/"
        return self._listing(prefix).get(name)

    def _drop_listing_showing(self, handle: Handle) -> None:
        """A read found ``handle``'s version changed: the listing that
        shows that version is dropped, and taken again at the next lookup."""
        prefix, _, name = handle.key.rpartition("/")
        listed = self.listed.get(prefix + "/" if prefix else "")
        shown = None if listed is None else listed.entries.get(name)
        if listed is not None and shown is not None and etag(shown) == handle.version:
            listed.taken_at = 0.0

    # -- the bucket ----------------------------------------------------------

    def _write(self, key: str, content: bytes | None) -> None:
        if content is None:
            self.rig.store.remove(key)
            del self.bucket[key]
        else:
            self.rig.store.put(key, content)
            self.bucket[key] = content
        self.changed_at[key] = self.now
        for handle in self.open.values():
            if handle.key == key and content != handle.content:
                handle.broken = True

    def _new_content(self, size: int) -> bytes:
        self.versions_made += 1
        return random.Random(self.versions_made).randbytes(size)

    @initialize(target=handles, sizes=st.dictionaries(st.sampled_from(NAMES), st.sampled_from(SIZES)))
    def fill(self, sizes: dict[str, int]) -> object:
        """A bucket with some objects already, each open once and its first
        block read: a reader is there when they change, with a block cached
        and the others not (a run needs few steps to reach a read of a
        replaced version)."""
        for key, size in sorted(sizes.items()):
            self._write(key, self._new_content(size))
        handles = [self.open_file(key) for key in sorted(sizes)]
        for handle in handles:
            self._read(handle, 0, BLOCK_SIZE)
        return multiple(*handles)

    @precondition(lambda self: len(self.bucket) < len(NAMES))
    @rule(data=st.data(), size=st.sampled_from(SIZES))
    def put(self, data: st.DataObject, size: int) -> None:
        key = data.draw(st.sampled_from([name for name in NAMES if name not in self.bucket]), "new key")
        self._write(key, self._new_content(size))

    @precondition(lambda self: bool(self.bucket))
    @rule(data=st.data(), size=st.sampled_from(SIZES))
    def overwrite(self, data: st.DataObject, size: int) -> None:
        key = data.draw(st.sampled_from(sorted(self.bucket)), "overwritten key")
        self._write(key, self._new_content(size))

    @precondition(lambda self: bool(self.bucket))
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        self._write(data.draw(st.sampled_from(sorted(self.bucket)), "deleted key"), None)

    @rule(seconds=st.sampled_from(STEPS_SECONDS))
    def advance_clock(self, seconds: float) -> None:
        self.rig.clock.now += seconds

    # -- the filesystem ------------------------------------------------------

    @rule(target=handles, key=st.sampled_from(NAMES + NEVER_PUT))
    def open_file(self, key: str) -> object:
        expected = self._expected(key)
        if self.now - self.changed_at.get(key, float("-inf")) >= TTL_SECONDS:
            # A TTL after its last change, every lookup shows the bucket as
            # it is (a key never put: no such file).
            assert expected == self.bucket.get(key)
        if expected == self.bucket.get(key):
            event("open: current")
        else:
            event("open: stale listing")
        if expected is None:
            with pytest.raises(ObjectNotFound):
                looked_up(self.rig.fs, "/" + key)
            return multiple()
        ino = looked_up(self.rig.fs, "/" + key).inode
        assert self.rig.fs._files[ino].info.etag == etag(expected)  # the version it stands for
        for other in self.open.values():  # one inode per version
            assert (other.inode == ino) == (other.key == key and other.version == etag(expected))
        reference = next(self.references)
        self.open[reference] = Handle(
            ino, key, expected, etag(expected), broken=self.bucket.get(key) != expected
        )
        return reference

    @precondition(lambda self: bool(self.open))
    @rule(offset=st.sampled_from(OFFSETS), size=st.sampled_from(READ_SIZES))
    def read_every_handle(self, offset: int, size: int) -> None:
        """The same range through every reference, in the order they were
        taken: old and new versions of a file side by side."""
        for handle in sorted(self.open):
            self._read(handle, offset, size)

    def _read(self, handle: int, offset: int, size: int) -> None:
        opened = self.open[handle]
        blocks = set(block_range(offset, size, len(opened.content), BLOCK_SIZE))
        # Blocks that a reference to this version has read: cached, and
        # kept while the kernel holds the version's inode.
        pinned = set().union(
            *(other.read_blocks for other in self.open.values() if other.version == opened.version)
        )
        never_cached = blocks - self.ever_read.get(opened.version, set())
        try:
            data = joined(self.rig.fs.read(opened.inode, size, offset, os.getpid()))
        except ObjectChanged:
            assert opened.broken, "a read failed although the bucket kept its version"
            assert not blocks <= pinned, "a read of cached blocks failed"
            event("read: failed, its version changed")
            self._drop_listing_showing(opened)
            assert not self.rig.fs.stale_entries.empty()  # the kernel is told to forget the name
            return
        # Exactly the opened version's bytes: never a mix, never another's.
        assert data == opened.content[offset : offset + size]
        assert not (never_cached and self.bucket.get(opened.key) != opened.content), (
            "an uncached block of a version the bucket no longer has was read"
        )
        if opened.broken and blocks:
            event("read: served from the cache after its version changed")
        opened.read_blocks |= blocks
        self.ever_read.setdefault(opened.version, set()).update(blocks)

    @rule(handle=consumes(handles))
    def release(self, handle: int) -> None:
        self.rig.fs.forget(self.open.pop(handle).inode, 1)

    @invariant()
    def every_refresh_ended_with_its_lookup(self) -> None:
        """The model's listings assume that a lookup waited for the refresh
        it started; none may still be under way when it returned."""
        for prefix in ("", "d/"):
            assert not self.rig.namespace._listing.busy(prefix)


@pytest.fixture(name="machine_io", autouse=True, scope="module")
def fixture_machine_io() -> Iterator[LoopThread]:
    """One I/O loop for every run of the machine: hundreds of runs (many
    more while a failure shrinks) each starting a loop thread cost time, and
    left descriptors open until the garbage collector found them."""
    io = FileSystemAgainstAModel.io = LoopThread()
    yield io
    io.stop()


FileSystemAgainstAModel.TestCase.settings = settings(
    max_examples=250,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    report_multiple_bugs=False,  # one counterexample, shrunk in a fraction of the time
)
TestFileSystemAgainstAModel = FileSystemAgainstAModel.TestCase

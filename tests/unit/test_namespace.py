"""Listings: resolution, TTL, persistence across restarts, version changes."""

from __future__ import annotations

import logging
import sqlite3
import threading
import types
from collections.abc import Callable

import pytest

from cachefsd.config import FetchSettings
from cachefsd.errors import AccessDenied, DeadlineExceeded, NotADirectory, ObjectNotFound, StoreError
from cachefsd.namespace import tree
from cachefsd.namespace.tree import STALE_RETRY_SECONDS
from cachefsd.store.base import Listing, ListingPage, ObjectInfo
from cachefsd.store.memory import MemoryStore
from tests.polling import wait_until
from tests.unit.conftest import Rig, RigFactory, joined


def test_lookup_resolves_through_parent_listings(make_rig: RigFactory) -> None:
    rig = make_rig({"a/b/c.txt": b"c", "a/d.txt": b"d", "top": b"t"})
    assert rig.namespace.lookup("/").is_dir
    assert rig.namespace.lookup("/a/b").is_dir
    node = rig.namespace.lookup("/a/b/c.txt")
    assert node.info is not None
    assert node.info.size == 1
    assert sorted(rig.namespace.listdir("/a")) == ["b", "d.txt"]
    with pytest.raises(ObjectNotFound):
        rig.namespace.lookup("/a/missing")
    with pytest.raises(ObjectNotFound):
        rig.namespace.lookup("/nope/deeper/still")
    with pytest.raises(NotADirectory):
        rig.namespace.lookup("/top/child")


def test_listings_are_cached_for_the_ttl_then_refreshed(make_rig: RigFactory) -> None:
    rig = make_rig({"f": b"1"}, ttl=10)
    rig.namespace.listdir("/")
    lists = rig.store.list_count
    rig.store.put("g", b"2")
    rig.clock.now += 9
    assert "g" not in rig.namespace.listdir("/")
    assert rig.store.list_count == lists
    rig.clock.now += 2
    assert "g" in rig.namespace.listdir("/")
    assert rig.store.list_count == lists + 1


class _InlineThread:
    """A thread that runs its target inside ``start``: the refresh it
    carries has settled by the time its starter goes on."""

    def __init__(self, target: Callable[..., None], args: tuple[object, ...], **_: object) -> None:
        self._target = target
        self._args = args

    def start(self) -> None:
        self._target(*self._args)


def test_a_refresh_that_settles_before_its_lookup_waits_is_still_seen(
    make_rig: RigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The in-memory store answers at once, so the background refresh can
    settle before the lookup that started it looks for its result; that
    lookup must still return the refreshed listing, not the expired one.
    The refresh runs inline to force that order on every run."""
    rig = make_rig({"f": b"1"}, ttl=10)
    rig.namespace.listdir("/")
    rig.store.put("g", b"2")
    rig.clock.now += 11
    monkeypatch.setattr(tree, "threading", types.SimpleNamespace(Thread=_InlineThread))
    assert "g" in rig.namespace.listdir("/")


def test_a_remount_sees_what_changed_while_nothing_was_mounted(make_rig: RigFactory) -> None:
    rig = make_rig({"d/f": b"1", "d/gone": b"2"})
    old = rig.namespace.lookup("/d/f").info
    rig.store.put("d/f", b"new version")
    rig.store.remove("d/gone")
    rig.store.put("d/added", b"3")
    again = make_rig(store=rig.store, cache_dir=rig.cache_dir)
    again.clock.now = rig.clock.now + 1  # well within the TTL of the saved listing
    listed = again.namespace.lookup("/d/f").info
    assert listed is not None
    assert old is not None
    assert (listed.etag, listed.size) != (old.etag, old.size)
    assert sorted(again.namespace.listdir("/d")) == ["added", "f"]


def test_a_remount_that_trusts_saved_listings_lists_nothing_while_they_are_fresh(
    make_rig: RigFactory,
) -> None:
    rig = make_rig({"d/f": b"1"})
    old = rig.namespace.lookup("/d/f").info
    rig.store.put("d/f", b"new version")
    lists = rig.store.list_count
    again = make_rig(store=rig.store, cache_dir=rig.cache_dir, trust_saved_listings=True)
    again.clock.now = rig.clock.now + 1
    assert again.namespace.lookup("/d/f").info == old
    assert rig.store.list_count == lists


def test_a_saved_listing_is_checked_once_per_mount(make_rig: RigFactory) -> None:
    rig = make_rig({"d/f": b"1"})
    rig.namespace.lookup("/d/f")
    again = make_rig(store=rig.store, cache_dir=rig.cache_dir)
    again.clock.now = rig.clock.now + 1
    lists = rig.store.list_count
    for _ in range(3):
        again.namespace.lookup("/d/f")
    assert rig.store.list_count == lists + 2  # the root and d/, once each


@pytest.mark.parametrize(
    "damage",
    [
        lambda payload: payload.replace(b'["d/f",1,', b'["d/f",9,'),  # one digit of a size
        lambda payload: payload.partition(b"\n")[2],  # its checksum lost
        lambda payload: payload.decode(),  # not even a blob
    ],
    ids=["a flipped digit", "no checksum", "text"],
)
def test_a_saved_listing_that_is_not_intact_is_listed_again(
    make_rig: RigFactory,
    caplog: pytest.LogCaptureFixture,
    damage: Callable[[bytes], object],
) -> None:
    """A listing row a mount trusts must be intact: damaged, it served a
    file 30 bytes short, or its directory EIO, on every mount."""
    rig = make_rig({"d/f": b"1"})
    rig.namespace.lookup("/d/f")
    database = sqlite3.connect(rig.cache_dir / "index.sqlite", isolation_level=None)
    (payload,) = database.execute("SELECT payload FROM listings WHERE prefix = 'd/'").fetchone()
    database.execute("UPDATE listings SET payload = ? WHERE prefix = 'd/'", (damage(payload),))
    database.close()
    lists = rig.store.list_count
    again = make_rig(store=rig.store, cache_dir=rig.cache_dir, trust_saved_listings=True)
    again.clock.now = rig.clock.now + 1
    with caplog.at_level(logging.WARNING):
        info = again.namespace.lookup("/d/f").info
    assert info is not None
    assert info.size == 1
    assert rig.store.list_count == lists + 1
    assert "the saved listing of 'd/' is damaged; listing it again" in caplog.text


def test_a_saved_listing_with_a_damaged_time_is_listed_again(
    make_rig: RigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    rig = make_rig({"d/f": b"1"})
    rig.namespace.lookup("/d/f")
    database = sqlite3.connect(rig.cache_dir / "index.sqlite", isolation_level=None)
    database.execute("UPDATE listings SET fetched_at = 'x' WHERE prefix = 'd/'")
    database.close()
    lists = rig.store.list_count
    again = make_rig(store=rig.store, cache_dir=rig.cache_dir, trust_saved_listings=True)
    again.clock.now = rig.clock.now + 1
    with caplog.at_level(logging.WARNING):
        assert again.namespace.lookup("/d/f").info is not None
    assert rig.store.list_count == lists + 1
    assert "the saved listing of 'd/' is damaged; listing it again" in caplog.text


@pytest.mark.parametrize(
    "damage",
    [
        # One byte of the table's index: d/'s row found under e/.
        "UPDATE listings SET (payload, fetched_at) = "
        "(SELECT payload, fetched_at FROM listings WHERE prefix = 'd/') WHERE prefix = 'e/'",
        # One bit of the time: fresh for ever, a new object never listed.
        "UPDATE listings SET fetched_at = fetched_at + 1e9 WHERE prefix = 'e/'",
    ],
    ids=["another directory's row", "a time in the future"],
)
def test_a_saved_listing_is_checked_with_its_row(make_rig: RigFactory, damage: str) -> None:
    rig = make_rig({"d/f": b"1", "e/g": b"22"})
    rig.namespace.lookup("/d/f")
    rig.namespace.lookup("/e/g")
    database = sqlite3.connect(rig.cache_dir / "index.sqlite", isolation_level=None)
    database.execute(damage)
    database.close()
    rig.store.put("e/new", b"333")
    again = make_rig(store=rig.store, cache_dir=rig.cache_dir, trust_saved_listings=True)
    again.clock.now = rig.clock.now + 1
    assert sorted(again.namespace.listdir("/e")) == ["g", "new"]
    info = again.namespace.lookup("/e/g").info
    assert info is not None
    assert info.size == 2


def test_a_listings_table_that_cannot_be_read_costs_a_listing_and_is_noted(
    make_rig: RigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A lookup must not fail because the index cannot give a saved listing
    (it was EIO); the damage is noted for the next mount."""
    rig = make_rig({"d/f": b"1"})
    database = sqlite3.connect(rig.cache_dir / "index.sqlite", isolation_level=None)
    database.executescript(  # seen by the open index's next statement
        "PRAGMA writable_schema = ON; DELETE FROM sqlite_master WHERE name LIKE '%listings%'; "
        "PRAGMA schema_version = 100; PRAGMA writable_schema = OFF;"
    )
    database.close()
    with caplog.at_level(logging.WARNING):
        assert rig.namespace.lookup("/d/f").info is not None
    assert "cannot load the saved listing of 'd/' (no such table: listings); listing it again" in caplog.text
    assert (rig.cache_dir / "index.sqlite.damage-found").exists()


def cached_then_replaced(make_rig: RigFactory, key: str) -> tuple[Rig, ObjectInfo]:
    """An rig whose object ``key`` was read (so cached), then replaced
    upstream; and its old version."""
    rig = make_rig({key: b"old content"}, ttl=5)
    old = rig.namespace.lookup("/" + key).info
    assert old is not None
    joined(rig.reader.read(old, 0, 100))
    assert rig.cache.used_bytes > 0
    rig.store.put(key, b"new content!")
    return rig, old


def test_a_changed_object_releases_its_old_blocks(make_rig: RigFactory) -> None:
    rig, old = cached_then_replaced(make_rig, "f")
    rig.clock.now += 6
    new = rig.namespace.lookup("/f").info
    assert new is not None
    assert new.etag != old.etag
    assert rig.cache.used_bytes == 0


def test_a_version_is_reported_gone_once_its_successor_is_visible(
    make_rig: RigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup of the old version, served the old listing while the
    refresh runs, must still find its cached blocks (released first, its
    reads got EIO); they are released once the new listing is visible."""
    rig = make_rig({"f": b"old"}, ttl=5, fresh_wait=0)  # lookups never wait for the refresh
    old = rig.namespace.lookup("/f").info
    assert old is not None
    joined(rig.reader.read(old, 0, 100))
    seen: dict[str, str] = {}

    def seen_by(phase: str, then: Callable[[ObjectInfo], None]) -> Callable[[ObjectInfo], None]:
        def recorded(info: ObjectInfo) -> None:
            current = rig.namespace.lookup("/f").info
            assert current is not None
            seen[phase] = current.etag
            then(info)

        return recorded

    monkeypatch.setattr(rig.fs, "version_gone", seen_by("gone", rig.fs.version_gone))
    rig.store.put("f", b"new version")
    rig.clock.now += 6
    # The refresh is held until the lookup has been served: a refresh that
    # already came back is what even a zero wait returns.
    gate = rig.faulty.faults.gate = threading.Event()
    try:
        assert rig.namespace.lookup("/f").info == old  # expired: served while it is refreshed
    finally:
        gate.set()
    wait_until(lambda: not rig.namespace._listing.busy(""), "the refresh of / to end", 10.0)
    new = rig.namespace.lookup("/f").info
    assert new is not None
    assert new.etag != old.etag
    assert seen == {"gone": new.etag}
    assert rig.cache.used_bytes == 0  # released, once the new listing was visible


def test_a_dropped_listing_still_reports_every_version_gone_meanwhile(make_rig: RigFactory) -> None:
    """A read that finds its object changed drops the listing; the next one
    must still be compared with it, or the other objects that changed meanwhile
    keep their old blocks (and the kernel their old names, unnoticed)."""
    rig = make_rig({"d/a": b"a old", "d/b": b"b old"}, ttl=5)
    versions = []
    for key in ("d/a", "d/b"):
        info = rig.namespace.lookup("/" + key).info
        assert info is not None
        joined(rig.reader.read(info, 0, 100))
        versions.append(info)
    rig.store.put("d/a", b"a new")
    rig.store.put("d/b", b"b new")
    rig.namespace.invalidate(versions[0])
    rig.namespace.lookup("/d/a")
    assert rig.cache.used_bytes == 0


def test_dropping_a_listing_for_a_version_it_no_longer_shows_does_nothing(make_rig: RigFactory) -> None:
    """Every read of a handle on a gone version drops the listing that
    shows that version; once listed again without it, dropping the fresh
    listing would LIST the whole directory again, read after read."""
    rig = make_rig({"d/f": b"old"}, ttl=3600)
    old = rig.namespace.lookup("/d/f").info
    assert old is not None
    rig.store.put("d/f", b"new content")
    rig.namespace.invalidate(old)
    rig.namespace.lookup("/d/f")  # listed again: the new version
    lists = rig.store.list_count
    for _ in range(3):
        rig.namespace.invalidate(old)
        rig.namespace.lookup("/d/f")
    assert rig.store.list_count == lists


def test_an_object_replaced_while_unmounted_releases_its_old_blocks(make_rig: RigFactory) -> None:
    rig, _ = cached_then_replaced(make_rig, "d/f")
    again = make_rig(store=rig.store, cache_dir=rig.cache_dir, ttl=5)
    again.clock.now = rig.clock.now + 6
    assert again.cache.used_bytes > 0
    again.namespace.lookup("/d/f")
    assert again.cache.used_bytes == 0


def test_a_listing_of_many_pages_may_take_longer_than_one_request_may(make_rig: RigFactory) -> None:
    """Each page is one request, bounded and retried on its own: ten pages
    of 0.25 s each outlast the 2 s deadline of one request, and a directory
    of 120k keys on a slow link must still list (and its files open)."""
    objects = {f"big/f{i:02d}": b"x" for i in range(30)}
    rig = make_rig(store=MemoryStore(objects, page_size=3))
    rig.faulty.faults.latency_seconds = 0.25
    node = rig.namespace.lookup("/big/f29")
    assert node.info is not None
    assert len(rig.namespace.listdir("/big")) == 30
    assert rig.store.list_count == 1 + 10  # the root's page, then big/'s ten, each once


def test_a_listing_whose_pages_go_in_a_circle_fails_instead_of_listing_forever(
    make_rig: RigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = make_rig({"d/a": b"a"})
    pages = 0

    async def circular(prefix: str, token: str | None) -> ListingPage:
        nonlocal pages
        pages += 1
        assert pages < 100, "listed the same page over and over"  # a regression fails here, at once
        return ListingPage(Listing((), ()), "again")

    monkeypatch.setattr(rig.store, "list_page", circular)
    with pytest.raises(StoreError, match=r"page 2 repeats an earlier page's token"):
        rig.namespace.listdir("/")


def test_an_expired_listing_serves_through_an_outage_and_is_retried_later(
    make_rig: RigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The cached blocks of its files stay readable while the bucket is
    down; a failed refresh is not tried again before ``retry_seconds``."""
    rig = make_rig({"d/f": b"cached"}, ttl=60)
    info = rig.namespace.lookup("/d/f").info
    assert info is not None
    assert joined(rig.reader.read(info, 0, 6)) == b"cached"
    rig.clock.now += 61
    rig.faulty.faults.failures_left = 1_000_000  # down
    rig.faulty.faults.error = DeadlineExceeded  # each request gives up at once
    calls = rig.faulty.calls
    with caplog.at_level(logging.WARNING, logger="cachefsd.namespace.tree"):
        served = rig.namespace.lookup("/d/f").info
        wait_until(lambda: not rig.namespace._listing.busy("d/"), "the refresh of d/ to fail", 10.0)
    assert served == info
    assert joined(rig.reader.read(info, 0, 6)) == b"cached"  # from the cache: no GET needed
    assert "cannot refresh the listing of 'd/'" in caplog.text
    tried = rig.faulty.calls
    assert tried > calls
    rig.clock.now += STALE_RETRY_SECONDS - 1
    assert rig.namespace.lookup("/d/f").info == info
    assert rig.faulty.calls == tried  # within the retry interval: not tried again
    rig.faulty.faults.failures_left = 0  # back
    rig.store.put("d/g", b"new")
    rig.clock.now += 2
    with caplog.at_level(logging.INFO, logger="cachefsd.namespace.tree"):
        rig.namespace.listdir("/d")  # a refresh probes the store, which answers
        wait_until(lambda: not rig.namespace._listing.busy(""), "the root's refresh to end", 10.0)
    assert sorted(rig.namespace.listdir("/d")) == ["f", "g"]
    assert "the store answers again" in caplog.text


def test_directories_that_backed_off_are_refreshed_once_the_store_answers(make_rig: RigFactory) -> None:
    """Backing off is for a store that does not answer: once one refresh
    succeeds, a change is seen at the next lookup past the TTL, not a retry
    interval later."""
    rig = make_rig({"d/f": b"1", "e/g": b"2"}, ttl=60)
    rig.namespace.lookup("/d/f")
    rig.namespace.lookup("/e/g")
    rig.clock.now += 61
    rig.faulty.faults.failures_left = 1_000_000
    rig.faulty.faults.error = DeadlineExceeded
    for probed in ("", "d/"):  # the root's refresh fails, then d/'s: both back off
        rig.namespace.lookup("/d/f")
        wait_until(lambda: not rig.namespace._listing.busy(probed), f"{probed!r} refreshed", 10.0)  # noqa: B023
    rig.faulty.faults.failures_left = 0
    rig.clock.now += 1
    rig.namespace.lookup("/e/g")  # e/ did not back off: its refresh probes the store, and succeeds
    wait_until(lambda: not rig.namespace._listing.busy("e/"), "the refresh of e/ to end", 10.0)
    rig.store.put("d/h", b"3")
    assert sorted(rig.namespace.listdir("/d")) == ["f", "h"]


def test_an_expired_listing_is_served_at_once_while_the_store_hangs(make_rig: RigFactory) -> None:
    """A lookup never waits on the store for a listing it has: one waits
    ``fresh_wait`` for a refresh that does not come, and from then on none
    waits, and only one refresh at a time probes the store, until it answers."""
    hanging = FetchSettings(deadline=600.0, attempt_timeout=600.0)  # only the gate ends a request
    rig = make_rig({"d/f": b"1", "e/g": b"2"}, ttl=60, fetch=hanging, fresh_wait=0.05)
    old = rig.namespace.lookup("/d/f").info
    assert rig.namespace.lookup("/e/g").info is not None
    gate = rig.faulty.faults.gate = threading.Event()
    rig.clock.now += 61
    try:
        assert rig.namespace.lookup("/d/f").info == old  # the root's refresh did not come in time
        assert rig.namespace.lookup("/e/g").info is not None
        assert sorted(rig.namespace.listdir("/e")) == ["g"]
        assert rig.namespace._listing.busy("")  # the lookups were answered while it hangs
        assert not rig.namespace._listing.busy("d/")  # the one probe of a store that does not answer
        assert not rig.namespace._listing.busy("e/")
        rig.store.put("d/new", b"3")
    finally:
        gate.set()
    wait_until(lambda: not rig.namespace._listing.busy(""), "the root's refresh to end", 10.0)
    rig.faulty.faults.gate = None
    rig.namespace.listdir("/d")  # starts d/'s refresh, now the store answers
    wait_until(lambda: not rig.namespace._listing.busy("d/"), "the refresh of d/ to end", 10.0)
    assert sorted(rig.namespace.listdir("/d")) == ["f", "new"]


def test_a_listing_saved_by_a_previous_mount_serves_through_an_outage(make_rig: RigFactory) -> None:
    rig = make_rig({"d/f": b"1"}, ttl=60)
    rig.namespace.lookup("/d/f")
    again = make_rig(store=rig.store, cache_dir=rig.cache_dir, ttl=60)
    again.clock.now = rig.clock.now + 3600
    again.faulty.faults.failures_left = 1_000_000
    listed = again.namespace.lookup("/d/f").info
    assert listed is not None
    # A listing dropped because an object changed under a reader is not served stale.
    again.namespace.invalidate(listed)
    again.clock.now += STALE_RETRY_SECONDS + 1
    with pytest.raises(StoreError):
        again.namespace.lookup("/d/f")


def test_a_listing_dropped_before_a_remount_is_not_served_through_an_outage(
    make_rig: RigFactory,
) -> None:
    """Dropped (an object changed under a reader), a saved listing is empty
    and expired: a remount whose store fails must fail the lookup, not
    answer that the directory holds nothing."""
    rig = make_rig({"d/f": b"1"}, ttl=60)
    listed = rig.namespace.lookup("/d/f").info
    assert listed is not None
    rig.namespace.invalidate(listed)
    again = make_rig(store=rig.store, cache_dir=rig.cache_dir, ttl=60)
    again.clock.now = rig.clock.now + 1
    again.namespace.lookup("/d")  # the root's listing is checked while the store answers
    again.faulty.faults.failures_left = 1_000_000
    with pytest.raises(StoreError) as failed:
        again.namespace.lookup("/d/f")
    assert not isinstance(failed.value, ObjectNotFound)  # EIO, not "no such file"


def test_a_listing_dropped_while_it_is_refreshed_is_not_served_stale(make_rig: RigFactory) -> None:
    """A listing dropped because an object changed under a reader must not
    come back when the refresh under way fails: its next lookup waits for
    the store, and fails with it."""
    rig = make_rig({"d/f": b"1"}, ttl=60, fresh_wait=0)
    rig.namespace.lookup("/d/f")
    rig.clock.now += 61
    rig.namespace.listdir("/")  # starts the root's refresh: the store answers
    wait_until(lambda: not rig.namespace._listing.busy(""), "the root's refresh to end", 10.0)
    gate = rig.faulty.faults.gate = threading.Event()
    try:
        listed = rig.namespace.lookup("/d/f").info  # expired: served, and refreshed behind
        assert listed is not None
        assert rig.namespace._listing.busy("d/")
        rig.namespace.invalidate(listed)
        rig.faulty.faults.failures_left = 1_000_000
        rig.faulty.faults.error = AccessDenied
    finally:
        gate.set()
    wait_until(lambda: not rig.namespace._listing.busy("d/"), "the refresh of d/ to fail", 10.0)
    with pytest.raises(AccessDenied):
        rig.namespace.lookup("/d/f")


def test_objects_a_directory_hides_are_logged(make_rig: RigFactory, caplog: pytest.LogCaptureFixture) -> None:
    """A loader scanning the mount silently lost such samples."""
    rig = make_rig({"d/x": b"object", "d/x/y": b"under the directory", "d/z": b"z"})
    with caplog.at_level(logging.WARNING, logger="cachefsd.namespace.tree"):
        assert sorted(rig.namespace.listdir("/d")) == ["x", "z"]
    assert "1 objects under 'd/' have the name of a directory there and are hidden" in caplog.text

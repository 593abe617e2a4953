"""The metadata cache: directory listings with a TTL, saved in the index (saved.py).

Every path is resolved through the listing of its parent directory, so one
listing answers ``ls``, every ``stat`` in it and every negative lookup for
``metadata_ttl`` seconds (the negative cache is the listing itself). Listings
are saved in the index. A mount checks each saved listing the first time it
needs it (it lists the directory again, and serves the saved one only while
the store does not answer), so an object overwritten while nothing was
mounted is read at its new version at once; with ``trust_saved``, a saved
listing serves as it is while it is younger than the TTL, and a remount of a
source of millions of objects lists nothing.

A listing past its TTL is served at once and refreshed in the background,
one refresh per directory in flight. While the store answers, the lookup
that finds it expired waits for that refresh up to ``fresh_wait`` (so a
change is seen as soon as the TTL runs out); once a refresh failed or
outlasted that wait, the store counts as not answering and no lookup waits
on it: every listing at hand is served as it is, and only one refresh at a
time probes the store (each directory backs off ``retry_seconds`` after a
failure) until one succeeds. Only a directory never listed (or dropped, see
``invalidate``) makes its lookup wait for the store, bounded by the fetch
deadline of each page. So a lookup never waits on the store for a listing
it has: resolving a path checks each of its ancestors, and a synchronous
refresh there made one lookup wait a deadline per directory, while the
others' retry windows lapsed behind it.

When a refresh shows that an object changed (new etag) or disappeared,
``on_version_gone`` is called once the new listing is visible: the kernel is
to forget the old version's name, and its blocks can be released (before,
a lookup served the old listing meanwhile would have found them gone).

Concurrency: ``_lock`` guards ``_dirs`` and the refresh state below it;
listing the same prefix from many threads at once issues one request
(single-flight); background refreshes run on daemon threads, so none holds
up the daemon's exit.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from cachefsd import turns
from cachefsd.aio import LoopThread
from cachefsd.cache.index import Index
from cachefsd.errors import DaemonStopping, DeadlineExceeded, NotADirectory, ObjectNotFound, StoreError
from cachefsd.fetch import Fetcher
from cachefsd.namespace.names import Directory, dir_prefix, directory_from_listing, split_path
from cachefsd.namespace.saved import SavedListings
from cachefsd.singleflight import SingleFlight
from cachefsd.store.base import Listing, ObjectInfo, ObjectStore
from cachefsd.store.listing import merged

log = logging.getLogger(__name__)

BRIDGE_MARGIN_SECONDS = 2.0
# How long a lookup of an expired listing waits for its refresh while the
# store answers: a LIST answers in tens of milliseconds when the store is
# well, and a cached file must open well within a second when it is not.
FRESH_WAIT_SECONDS = 0.5
# After a failed refresh, how long its directory's expired listing is served
# before the next attempt (which itself retries for a whole fetch deadline).
STALE_RETRY_SECONDS = 30.0
# Refreshes in flight at once while the store answers (while it does not,
# one): more directories than that expire together only in a full scan,
# whose lookups are served the listings at hand meanwhile.
MAX_BACKGROUND_REFRESHES = 8
# The time a dropped listing is saved as taken at: expired, and never served.
INVALIDATED = 0.0


@dataclass(frozen=True, slots=True)
class Entry:
    """What a path is: a directory (``info`` None) or one version of an object."""

    info: ObjectInfo | None

    @property
    def is_dir(self) -> bool:
        return self.info is None


ROOT = Entry(info=None)


@dataclass(slots=True)
class _Cached:
    directory: Directory
    fetched_at: float
    # Saved by an earlier mount and not listed since this one began: it is
    # listed again before it serves (unless saved listings are trusted).
    unchecked: bool = False


class Namespace:
    """The directory listings of one source: their TTL, their refresh in the background, their copy
    in the index."""

    def __init__(
        self,
        store: ObjectStore,
        fetcher: Fetcher,
        io: LoopThread,
        index: Index,
        ttl: float,
        on_version_gone: Callable[[ObjectInfo], None],
        trust_saved: bool = False,
        clock: Callable[[], float] = time.time,
        fresh_wait: float = FRESH_WAIT_SECONDS,
        retry_seconds: float = STALE_RETRY_SECONDS,
    ) -> None:
        self._store = store
        self._fetcher = fetcher
        self._io = io
        self._saved = SavedListings(index, store.cache_key)
        self._ttl = ttl
        self._trust_saved = trust_saved
        self._on_version_gone = on_version_gone
        self._clock = clock
        self._fresh_wait = fresh_wait
        self._retry_seconds = retry_seconds
        self._lock = threading.Lock()
        self._dirs: dict[str, _Cached] = {}
        self._answering = True  # the last refresh came back in time, or none failed yet
        self._refreshing = 0  # background refreshes in flight
        self._retry_at: dict[str, float] = {}  # prefix -> no refresh before (after a failure)
        self._listing: SingleFlight[str, _Cached] = SingleFlight()

    def lookup(self, path: str) -> Entry:
        """The entry at ``path``; ``ObjectNotFound`` or ``NotADirectory`` otherwise."""
        parts = split_path(path)
        if not parts:
            return ROOT
        parent = self.directory(parts[:-1])
        if parts[-1] not in parent.entries:
            raise ObjectNotFound(path)
        return Entry(info=parent.entries[parts[-1]])

    def listdir(self, path: str) -> dict[str, ObjectInfo | None]:
        return self.directory(split_path(path)).entries

    def directory(self, parts: list[str]) -> Directory:
        """The directory at ``parts``, resolving every ancestor on the way."""
        for depth in range(len(parts)):
            entries = self._cached(dir_prefix(parts[:depth])).directory.entries
            name = parts[depth]
            if name not in entries:
                raise ObjectNotFound("/" + "/".join(parts[: depth + 1]))
            if entries[name] is not None:
                raise NotADirectory("/" + "/".join(parts[: depth + 1]))
        return self._cached(dir_prefix(parts)).directory

    def invalidate(self, info: ObjectInfo) -> None:
        """Forget the listing that shows version ``info`` (it changed under
        us), so the next lookup sees the bucket's current state. Nothing to
        do if it was dropped already, or listed again since without that
        version: every read of a handle on a gone version comes here, and
        each dropped the fresh listing (a LIST of the whole directory again)."""
        prefix = info.key[: info.key.rfind("/") + 1]
        name = info.key[len(prefix) :]
        with self._lock:
            cached = self._dirs.get(prefix)
            if cached is not None:
                listed = cached.directory.entries.get(name)
                if cached.fetched_at == INVALIDATED or listed is None or listed.etag != info.etag:
                    return
                # Kept, expired, for the next listing to be compared with:
                # the other objects of the directory that changed meanwhile
                # are reported gone too (the kernel may hold their names).
                self._dirs[prefix] = _Cached(cached.directory, INVALIDATED)
        self._saved.save(prefix, INVALIDATED, Listing((), ()))

    def wrote(self, info: ObjectInfo) -> None:
        """This mount put ``info`` in the bucket (an upload, a copy): the
        listings at hand show it at once, its directory's and each
        ancestor's (a key may make a new directory), without listing them
        again: a directory of 100k keys written into is not listed again
        for each checkpoint file. A version it replaces is gone
        (``on_version_gone``)."""
        parts = info.key.split("/")
        replaced = self._edit(info.key, info)
        for depth in range(len(parts) - 1):
            self._edit("/".join(parts[: depth + 1]) + "/", None, only_if_absent=True)
        if replaced is not None and replaced.etag != info.etag:
            self._on_version_gone(replaced)

    def removed(self, key: str) -> None:
        """This mount deleted ``key`` (``a/b/`` a directory) from the bucket:
        the listing at hand of its directory no longer shows it."""
        self._edit(key, None, remove=True)

    def _edit(
        self, key: str, info: ObjectInfo | None, only_if_absent: bool = False, remove: bool = False
    ) -> ObjectInfo | None:
        """Set (or ``remove``) the entry of ``key`` (a directory when it ends
        in ``/``) in its directory's listing, if one is at hand; the object
        it showed there before. The copy saved in the index is dropped: it
        is listed again at the next mount."""
        name_end = len(key) - 1 if key.endswith("/") else len(key)
        prefix = key[: key.rfind("/", 0, name_end) + 1]
        name = key[len(prefix) : name_end]
        with self._lock:
            cached = self._dirs.get(prefix)
            if cached is None or cached.fetched_at == INVALIDATED:
                return None
            entries = cached.directory.entries
            before = entries.get(name)
            if only_if_absent and name in entries:
                return before
            # A new dict: listings handed out are iterated without the lock.
            entries = {each: value for each, value in entries.items() if each != name}
            if not remove:
                entries[name] = info
            directory = Directory(entries, cached.directory.hidden, cached.directory.shadowed)
            self._dirs[prefix] = _Cached(directory, cached.fetched_at, cached.unchecked)
        self._saved.save(prefix, INVALIDATED, Listing((), ()))
        return before

    def _cached(self, prefix: str) -> _Cached:
        now = self._clock()
        with self._lock:
            cached = self._dirs.get(prefix)
        if cached is None:
            cached = self._from_index(prefix)
            if cached is not None:
                # It is what the listing below is compared with (an object
                # replaced while unmounted has its old version's blocks
                # released), and what serves if the store does not answer.
                with self._lock:
                    cached = self._dirs.setdefault(prefix, cached)
        if cached is not None and cached.unchecked:
            return self._checked_saved(prefix, cached)
        if cached is not None and now - cached.fetched_at < self._ttl:
            return cached
        if cached is not None and cached.fetched_at != INVALIDATED:
            return self._refresh_stale(prefix, cached)
        # Never listed, or dropped: nothing to serve meanwhile. Other lookups
        # wait for the listing as long as it takes: each of its pages is
        # bounded, not their number.
        return self._listing.do(prefix, lambda: self._listed(prefix), timeout=None)

    def _checked_saved(self, prefix: str, saved: _Cached) -> _Cached:
        """The listing of ``prefix``, saved by an earlier mount, checked:
        listed again, waited for as long as a directory never listed, so
        that what changed while nothing was mounted is seen at once. While
        the store does not answer (or the directory backs off after a
        failure), ``saved`` serves as an expired listing does, refreshed behind."""
        with self._lock:
            waits = self._answering and self._clock() >= self._retry_at.get(prefix, 0.0)
        if waits:
            try:
                return self._listing.do(prefix, lambda: self._checked(prefix), timeout=None)
            except StoreError:  # logged and backed off by _listed
                return saved
        return self._refresh_stale(prefix, saved)

    def _checked(self, prefix: str) -> _Cached:
        """The listing of ``prefix`` as this mount listed it: the one a
        lookup that read the saved one meanwhile was beaten to, else a new
        one (a directory of a million objects is minutes of listing)."""
        with self._lock:
            cached = self._dirs.get(prefix)
        if cached is not None and not cached.unchecked and cached.fetched_at != INVALIDATED:
            return cached
        return self._listed(prefix)

    def _refresh_stale(self, prefix: str, stale: _Cached) -> _Cached:
        """``stale``, past its TTL, after starting its refresh in the
        background unless one runs or the directory backs off; while the
        store answers, the refreshed listing if it comes within the fresh wait."""
        with self._lock:
            answering = self._answering
            starts = (
                self._clock() >= self._retry_at.get(prefix, 0.0)
                and self._refreshing < (MAX_BACKGROUND_REFRESHES if answering else 1)
                and not self._listing.busy(prefix)
            )
            if starts:
                self._refreshing += 1
        claimed = self._listing.claim([prefix]) if starts else {}
        if starts and not claimed:  # another lookup started it in between
            with self._lock:
                self._refreshing -= 1
        # Taken before the refresh starts: settling its key empties
        # ``claimed`` and frees the key, so a refresh that came back first
        # would leave this lookup nothing to wait on, and the expired
        # listing would be served although the store answered.
        refreshed = claimed.get(prefix) or self._listing.current(prefix)
        if claimed:
            threading.Thread(
                target=self._refresh_in_background,
                args=(prefix, claimed),
                name="cachefsd-list",
                daemon=True,
            ).start()
        if not answering or refreshed is None:
            return stale
        turns.give_up()
        try:
            return refreshed.result(self._fresh_wait)
        except FutureTimeout:
            with self._lock:
                self._answering = False
            return stale
        except StoreError:  # logged and backed off by the refresh
            return stale

    def _refresh_in_background(self, prefix: str, claimed: dict[str, Future[_Cached]]) -> None:
        def refresh(_: list[str], settle: Callable[[str, _Cached], None]) -> None:
            try:
                listed = self._listed(prefix)
            finally:
                with self._lock:
                    self._refreshing -= 1
            settle(prefix, listed)

        try:
            self._listing.compute(claimed, refresh)
        except StoreError:
            pass  # logged and backed off by _listed
        except Exception:
            log.exception("refreshing the listing of %r failed", prefix or "/")

    def _listed(self, prefix: str) -> _Cached:
        """The listing of ``prefix`` refreshed; a failure is recorded before
        any lookup waiting for it learns of it, so the next one knows."""
        try:
            return self._refresh(prefix)
        except StoreError as exc:
            self._refresh_failed(prefix, exc)
            raise

    def _refresh_failed(self, prefix: str, exc: StoreError) -> None:
        """The store did not give the listing of ``prefix``: serve the one at
        hand, and try again ``retry_seconds`` from now. A store that gave up
        on the request or could not be reached does not answer; one that
        refused it (access denied) does, for every other directory."""
        if isinstance(exc, DaemonStopping):
            return
        now = self._clock()
        with self._lock:
            if exc.retryable or isinstance(exc, DeadlineExceeded):
                self._answering = False
            self._retry_at[prefix] = now + self._retry_seconds
            cached = self._dirs.get(prefix)
        if cached is None or cached.fetched_at == INVALIDATED:
            return  # dropped meanwhile: its next lookup lists it, nothing is served stale
        log.warning(
            "cannot refresh the listing of %r (%s); serving the one taken %.0f s ago, retrying in %.0f s",
            prefix or "/",
            exc,
            now - cached.fetched_at,
            self._retry_seconds,
        )

    def _from_index(self, prefix: str) -> _Cached | None:
        """The listing saved by an earlier mount, if any and intact."""
        saved = self._saved.load(prefix)
        if saved is None:
            return None
        fetched_at, listing = saved
        unchecked = not self._trust_saved and fetched_at != INVALIDATED  # a dropped one is listed anyway
        return _Cached(directory_from_listing(prefix, listing), fetched_at, unchecked)

    def _list(self, prefix: str) -> Listing:
        """Every page of the listing of ``prefix``, each page one request
        with its own retries and deadline: a directory of 120k keys (COCO's
        train2017) is 120 pages, more than one deadline's worth on a slow
        link, and a retry must not start over from the first page."""
        pages: list[Listing] = []
        token: str | None = None
        tokens: set[str] = set()
        while True:
            page = self._io.run(
                self._fetcher.call(
                    f"list {prefix or '/'} (page {len(pages) + 1})",
                    functools.partial(self._store.list_page, prefix, token),
                    "metadata",
                ),
                self._fetcher.deadline + BRIDGE_MARGIN_SECONDS,
            )
            pages.append(page.listing)
            token = page.next_token
            if token is None:
                return merged(pages)
            if token in tokens:  # a store that pages in a circle would list it forever
                raise StoreError(f"list {prefix or '/'}: page {len(pages)} repeats an earlier page's token")
            tokens.add(token)

    def _refresh(self, prefix: str) -> _Cached:
        listing = self._list(prefix)
        fetched_at = self._clock()
        cached = _Cached(directory_from_listing(prefix, listing), fetched_at)
        if cached.directory.hidden:
            log.warning(
                "%d keys under %r are not valid file names "
                "(empty, '.', '..', NUL, not UTF-8 or over 255 bytes) and are hidden",
                cached.directory.hidden,
                prefix,
            )
        if cached.directory.shadowed:
            log.warning(
                "%d objects under %r have the name of a directory there and are hidden (the directory wins)",
                cached.directory.shadowed,
                prefix,
            )
        with self._lock:
            previous = self._dirs.get(prefix)
        gone = [] if previous is None else _gone_versions(previous.directory, cached.directory)
        with self._lock:
            self._dirs[prefix] = cached
            recovered, self._answering = not self._answering, True
            if recovered:  # backing off was for a store that did not answer
                self._retry_at.clear()
            else:
                self._retry_at.pop(prefix, None)
        if recovered:
            log.info("the store answers again: listings are refreshed as they expire")
        self._saved.save(prefix, fetched_at, listing)
        for info in gone:
            self._on_version_gone(info)
        return cached


def _gone_versions(old: Directory, new: Directory) -> list[ObjectInfo]:
    """The versions listed in ``old`` that ``new`` shows replaced or deleted."""
    gone = []
    for name, info in old.entries.items():
        current = new.entries.get(name)
        if info is not None and (current is None or current.etag != info.etag):
            gone.append(info)
    return gone

"""Listings saved for the next mount: one row of the index's ``listings``
table a directory, checked when it is read back.

The index is a cache like the rest: a listing that cannot be saved (a full
disk) costs a listing after a restart, and one that is damaged on disk (a
flipped digit of a size served a file short on every mount, one byte of the
table's index served a directory under another's name, one bit of the time
kept a listing fresh for ever) fails its checksum and is listed again.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from typing import Protocol

import xxhash

from cachefsd.store.base import Listing, ObjectInfo

log = logging.getLogger(__name__)


class ListingRows(Protocol):
    """Where saved listings are kept (``cache.index.Index``); both raise ``sqlite3.Error``."""

    def save_listing(self, source: str, prefix: str, fetched_at: float, payload: bytes) -> None: ...
    def load_listing(self, source: str, prefix: str) -> tuple[float, bytes] | None: ...


class SavedListings:
    """The listings of one source as saved in the index: written best
    effort, read back only when intact."""

    def __init__(self, rows: ListingRows, source: str) -> None:
        self._rows = rows
        self._source = source

    def load(self, prefix: str) -> tuple[float, Listing] | None:
        """The listing of ``prefix`` an earlier mount saved, and when it was
        taken; None if there is none, or none intact (with a warning)."""
        try:
            saved = self._rows.load_listing(self._source, prefix)
        except sqlite3.Error as exc:
            log.warning("cannot load the saved listing of %r (%s); listing it again", prefix or "/", exc)
            return None
        if saved is None:
            return None
        fetched_at, payload = saved
        intact = isinstance(payload, bytes) and isinstance(fetched_at, float)
        listing = _decode((self._source, prefix, fetched_at), payload) if intact else None
        if listing is None:
            log.warning("the saved listing of %r is damaged; listing it again", prefix or "/")
            return None
        return fetched_at, listing

    def save(self, prefix: str, fetched_at: float, listing: Listing) -> None:
        """Save the listing of ``prefix`` taken at ``fetched_at``; a failure
        only logs."""
        try:
            fetched_at = float(fetched_at)  # as sqlite gives it back (a REAL), for the checksum
            payload = _encode((self._source, prefix, fetched_at), listing)
            self._rows.save_listing(self._source, prefix, fetched_at, payload)
        except sqlite3.Error as exc:
            log.warning("cannot save the listing of %r in the index: %s", prefix or "/", exc)


def _encode(row: tuple[str, str, float], listing: Listing) -> bytes:
    """A listing as saved in the index: the xxh3-64 (in hex) of its row's
    key and time and of its JSON, a newline, the JSON. A row damaged on disk
    fails the check on load, and the directory is listed again: one flipped
    digit of a size served a file short on every mount, one byte of the
    table's index served a directory under another's name, one bit of the
    time kept a listing fresh for ever."""
    body = json.dumps(
        {
            "objects": [[o.key, o.size, o.etag, o.mtime] for o in listing.objects],
            "prefixes": list(listing.prefixes),
        },
        separators=(",", ":"),
    ).encode()
    return _checksum(row, body) + b"\n" + body


def _checksum(row: tuple[str, str, float], body: bytes) -> bytes:
    source, prefix, fetched_at = row
    key = f"{source}\0{prefix}\0{fetched_at!r}\0".encode("utf-8", "surrogateescape")
    return xxhash.xxh3_64_hexdigest(key + body).encode()


def _decode(row: tuple[str, str, float], payload: bytes) -> Listing | None:
    """The listing saved as ``row`` (source, prefix, time), or None if it is
    not intact."""
    checksum, _, body = payload.partition(b"\n")
    if checksum != _checksum(row, body):
        return None
    raw = json.loads(body)
    return Listing(
        objects=tuple(ObjectInfo(key, size, etag, mtime) for key, size, etag, mtime in raw["objects"]),
        prefixes=tuple(raw["prefixes"]),
    )

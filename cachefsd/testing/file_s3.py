"""An S3 endpoint whose objects are files, for benchmarks and tests: a ranged
GET costs what its bytes cost.

moto reads and copies the whole object for every GET, so a 4 MiB range of a
32 MiB object costs as much as the object, which punishes exactly what real
S3 clients do (parallel ranged parts). Here an object is one file and a GET
sends its bytes, or a range's, with ``sendfile(2)``: they never enter Python.

What it speaks (path-style, HTTP/1.1 with keep-alive, one thread a
connection, any signature accepted):

- ``PUT /bucket`` creates a bucket, ``HEAD /bucket`` asks for one;
- ``PUT``, ``GET``, ``HEAD``, ``DELETE /bucket/key``, with ``Range``
  (``bytes=a-b``, ``bytes=a-``, ``bytes=-n``: 206, or 416 past the end),
  ``If-Match`` (412) and ``If-None-Match`` (304), evaluated in S3's order
  (If-Match before Range);
- ``GET /bucket?list-type=2`` (ListObjectsV2) with prefix, delimiter,
  max-keys, start-after, continuation-token and ``encoding-type=url``; keys
  in UTF-8 byte order, at most 1,000 entries (keys and common prefixes) a
  page;
- multipart uploads (``POST ?uploads``, ``PUT ?partNumber&uploadId``,
  ``POST ?uploadId`` with the parts' list, ``DELETE ?uploadId``; parts
  under 5 MiB but the last refused at completion as S3 does), CopyObject
  and UploadPartCopy (``x-amz-copy-source``, with ``-range`` and
  ``-if-match``); unfinished uploads live in memory, and their parts go at
  the next start;
- S3's XML error bodies (NoSuchKey, NoSuchBucket, NoSuchUpload,
  PreconditionFailed, InvalidRange, ...). Anything else (ListObjects v1,
  ListMultipartUploads, subresources such as ``?acl``) is answered 501
  NotImplemented.

The etag is the MD5 of the content, computed while a PUT (or a copy) is
written, as S3 does for a single-part upload, and the MD5 of the parts'
MD5s and ``-N`` for a multipart one; Last-Modified has whole seconds, so HEAD and
the listing agree.

Layout under ``root``: ``index.sqlite`` (buckets, and for each object its
size, etag, mtime and file) and ``objects/<random name>``. A key never
becomes a path, so no key can reach outside ``root`` and a key may also be
a "directory" of others (``x`` and ``x/y``). Keys that could not be a file
under a mount anyway (a ``.`` or ``..`` segment, a leading ``/``, NUL),
and keys longer than S3's 1,024 bytes, are refused with 400. A PUT writes
a new file and then commits its row, which is the moment the new version
appears; the old file is unlinked then, and a GET that opened it still
sends the old version whole. Files no row names (a PUT cut off by a crash)
are removed at start. Objects survive ``stop()``/``start()`` and a new
server on the same root.

Concurrency: ``start``/``stop`` are called from one controlling thread. The
index (one sqlite connection), the unfinished uploads and the set of open
connections are shared by the per-connection threads and guarded by
``_Index._lock``, ``_Uploads._lock`` and ``FileS3Server._lock`` (the
counters by their own), never two at once; a GET looks its object up and
opens the file under the index lock, so a concurrent PUT or DELETE cannot
unlink it in between. A completion takes its upload out of the registry
before it joins the parts, so a second completion or an abort meanwhile
finds none. ``latency_seconds`` is a plain float read without a
lock (a torn read is impossible in CPython and a stale one is harmless).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import email.utils
import hashlib
import os
import re
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO
from urllib.parse import parse_qs, quote_plus, unquote, urlsplit
from xml.etree import ElementTree
from xml.sax.saxutils import escape

from cachefsd.testing.counting import (
    CountedServer,
    request_kind,
    serve_in_foreground,
)

DEFAULT_HOST = "127.0.0.1"

# S3's own limits: a page of a listing, and a key's length in UTF-8 bytes.
MAX_KEYS = 1000
MAX_KEY_BYTES = 1024
# A PUT's body is copied to its file in pieces of this size.
_COPY_CHUNK = 1 << 20
# S3's rule for a bucket name (the dotted-IP form aside).
_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")
_S3_NAMESPACE = "http://s3.amazonaws.com/doc/2006-03-01/"
# S3's smallest part, but the last, and its most parts an upload.
MIN_PART_BYTES = 5 << 20
MAX_PART_NUMBER = 10_000
_XML_DECLARATION = '<?xml version="1.0" encoding="UTF-8"?>\n'

_SCHEMA = """
CREATE TABLE IF NOT EXISTS buckets (name TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS objects (
    bucket TEXT NOT NULL,
    key BLOB NOT NULL,  -- UTF-8 bytes: BLOBs compare bytewise, S3's listing order
    size INTEGER NOT NULL,
    etag TEXT NOT NULL,
    mtime INTEGER NOT NULL,
    file TEXT NOT NULL,
    PRIMARY KEY (bucket, key)
) WITHOUT ROWID;
"""


class S3Error(Exception):
    """An S3 error reply: its HTTP status, code and message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def _no_such_bucket(bucket: str) -> S3Error:
    return S3Error(404, "NoSuchBucket", f"The specified bucket does not exist: {bucket}")


def _not_implemented(what: str) -> S3Error:
    return S3Error(501, "NotImplemented", f"{what} is not implemented by this test server")


@dataclass(frozen=True)
class StoredObject:
    size: int
    etag: str  # unquoted
    mtime: int  # seconds since the epoch


@dataclass(frozen=True)
class ListedPage:
    """One page of a listing: objects and common prefixes in key order,
    and where the next page starts (an inclusive lower bound), if any."""

    objects: list[tuple[bytes, StoredObject]]
    prefixes: list[bytes]
    next_bound: bytes | None


def _successor(prefix: bytes) -> bytes | None:
    """The least byte string above every string that starts with ``prefix``
    (None: there is none)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])


class _Index:
    """The buckets and objects, in sqlite, beside the files they name."""

    def __init__(self, root: Path) -> None:
        self.objects = root / "objects"
        self.objects.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(root / "index.sqlite", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        named = {name for (name,) in self._db.execute("SELECT file FROM objects")}
        for path in self.objects.iterdir():
            if path.name not in named:
                path.unlink()

    def create_bucket(self, bucket: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO buckets VALUES (?)", (bucket,))

    def has_bucket(self, bucket: str) -> bool:
        with self._lock:
            return self._has_bucket_locked(bucket)

    def _has_bucket_locked(self, bucket: str) -> bool:
        return self._db.execute("SELECT 1 FROM buckets WHERE name = ?", (bucket,)).fetchone() is not None

    def open(self, bucket: str, key: str) -> tuple[StoredObject, BinaryIO]:
        """The object and its file, open; NoSuchKey or NoSuchBucket."""
        with self._lock:
            row = self._db.execute(
                "SELECT size, etag, mtime, file FROM objects WHERE bucket = ? AND key = ?",
                (bucket, key.encode()),
            ).fetchone()
            if row is None:
                if not self._has_bucket_locked(bucket):
                    raise _no_such_bucket(bucket)
                raise S3Error(404, "NoSuchKey", "The specified key does not exist.")
            size, etag, mtime, name = row
            return StoredObject(size, etag, mtime), open(self.objects / name, "rb", buffering=0)

    def commit(self, bucket: str, key: str, stored: StoredObject, name: str) -> None:
        """Make file ``name`` the object's content; NoSuchBucket."""
        with self._lock:
            if not self._has_bucket_locked(bucket):
                raise _no_such_bucket(bucket)
            old = self._file_locked(bucket, key)
            self._db.execute(
                "INSERT OR REPLACE INTO objects VALUES (?, ?, ?, ?, ?, ?)",
                (bucket, key.encode(), stored.size, stored.etag, stored.mtime, name),
            )
            if old is not None:
                (self.objects / old).unlink()

    def delete(self, bucket: str, key: str) -> None:
        """Delete the object if it exists (S3 answers a missing key alike); NoSuchBucket."""
        with self._lock:
            if not self._has_bucket_locked(bucket):
                raise _no_such_bucket(bucket)
            old = self._file_locked(bucket, key)
            if old is not None:
                self._db.execute("DELETE FROM objects WHERE bucket = ? AND key = ?", (bucket, key.encode()))
                (self.objects / old).unlink()

    def _file_locked(self, bucket: str, key: str) -> str | None:
        row = self._db.execute(
            "SELECT file FROM objects WHERE bucket = ? AND key = ?", (bucket, key.encode())
        ).fetchone()
        return None if row is None else str(row[0])

    def page(self, bucket: str, prefix: bytes, delimiter: bytes, bound: bytes, max_keys: int) -> ListedPage:
        """Up to ``max_keys`` entries from ``bound`` on: the keys under
        ``prefix``, those with ``delimiter`` after it rolled up into one
        common prefix each (an entry). Each common prefix costs one query;
        its keys are skipped, not read. ``max_keys`` 0 is an empty page
        with nothing after it, as moto answers."""
        end = _successor(prefix)
        objects: list[tuple[bytes, StoredObject]] = []
        prefixes: list[bytes] = []
        bound = max(bound, prefix)
        with self._lock:
            if not self._has_bucket_locked(bucket):
                raise _no_such_bucket(bucket)
            while max_keys:
                rows = self._db.execute(
                    "SELECT key, size, etag, mtime FROM objects WHERE bucket = ? AND key >= ?"
                    + ("" if end is None else " AND key < ?")
                    + " ORDER BY key LIMIT ?",
                    (
                        bucket,
                        bound,
                        *(() if end is None else (end,)),
                        max_keys + 1 - len(objects) - len(prefixes),
                    ),
                ).fetchall()
                if not rows:
                    return ListedPage(objects, prefixes, None)
                for key, size, etag, mtime in rows:
                    if len(objects) + len(prefixes) == max_keys:
                        return ListedPage(objects, prefixes, bound)  # one more entry exists
                    cut = key.find(delimiter, len(prefix)) if delimiter else -1
                    if cut < 0:
                        objects.append((key, StoredObject(size, etag, mtime)))
                        bound = key + b"\0"
                        continue
                    common = key[: cut + len(delimiter)]
                    prefixes.append(common)
                    following = _successor(common)
                    if following is None:
                        return ListedPage(objects, prefixes, None)
                    bound = following
                    break  # the rows after it may be under it: query again past it
        return ListedPage([], [], None)


@dataclass
class _Upload:
    """An unfinished multipart upload: its object and its parts so far,
    each a file in the objects directory with its size and MD5."""

    bucket: str
    key: str
    parts: dict[int, tuple[str, int, bytes]]


class _Uploads:
    """Unfinished multipart uploads by id, in memory (an upload does not
    survive a restart: its part files are removed at the next start)."""

    def __init__(self, objects: Path) -> None:
        self._objects = objects
        self._lock = threading.Lock()
        self._uploads: dict[str, _Upload] = {}

    def create(self, bucket: str, key: str) -> str:
        upload_id = uuid.uuid4().hex
        with self._lock:
            self._uploads[upload_id] = _Upload(bucket, key, {})
        return upload_id

    def _get_locked(self, upload_id: str, bucket: str, key: str) -> _Upload:
        upload = self._uploads.get(upload_id)
        if upload is None or (upload.bucket, upload.key) != (bucket, key):
            raise S3Error(404, "NoSuchUpload", "The specified upload does not exist.")
        return upload

    def check(self, upload_id: str, bucket: str, key: str) -> None:
        with self._lock:
            self._get_locked(upload_id, bucket, key)

    def add_part(
        self, upload_id: str, bucket: str, key: str, number: int, part: tuple[str, int, bytes]
    ) -> None:
        """Make file ``part[0]`` part ``number`` (replacing one sent before)."""
        with self._lock:
            try:
                upload = self._get_locked(upload_id, bucket, key)
            except S3Error:
                (self._objects / part[0]).unlink()
                raise
            old = upload.parts.get(number)
            upload.parts[number] = part
        if old is not None:
            (self._objects / old[0]).unlink()

    def take(self, upload_id: str, bucket: str, key: str) -> _Upload:
        """Remove the upload and hand its parts over (completion, abort)."""
        with self._lock:
            upload = self._get_locked(upload_id, bucket, key)
            del self._uploads[upload_id]
            return upload

    def restore(self, upload_id: str, upload: _Upload) -> None:
        """Put back an upload whose completion was refused."""
        with self._lock:
            self._uploads[upload_id] = upload

    def discard(self, upload: _Upload) -> None:
        for name, _, _ in upload.parts.values():
            (self._objects / name).unlink(missing_ok=True)


def _bad_key(key: str) -> bool:
    """Keys no file under a mount could have: S3 takes them, this server refuses them."""
    return (
        key.startswith("/")
        or "\0" in key
        or any(part in (".", "..") for part in key.split("/"))
        or len(key.encode()) > MAX_KEY_BYTES
    )


def _append(out: int, path: Path, size: int) -> None:
    """The ``size`` bytes of file ``path`` onto ``out``, in the kernel."""
    with open(path, "rb") as part:
        sent = 0
        while sent < size:
            copied = os.sendfile(out, part.fileno(), sent, size - sent)
            if not copied:
                raise OSError(f"{path} ended early")
            sent += copied


def _check_parts(upload: _Upload, listed: list[tuple[int, str]]) -> None:
    """S3's rules for the parts a completion lists: at least one, in
    ascending order, each uploaded with that etag, each but the last at
    least ``MIN_PART_BYTES``."""
    if not listed:
        raise S3Error(400, "MalformedXML", "The XML you provided was not well-formed.")
    numbers = [number for number, _ in listed]
    if numbers != sorted(set(numbers)):
        raise S3Error(400, "InvalidPartOrder", "The list of parts was not in ascending order.")
    for number, etag in listed:
        part = upload.parts.get(number)
        if part is None or part[2].hex() != etag:
            raise S3Error(400, "InvalidPart", "One or more of the specified parts could not be found.")
    if any(upload.parts[number][1] < MIN_PART_BYTES for number, _ in listed[:-1]):
        raise S3Error(400, "EntityTooSmall", "Your proposed upload is smaller than the minimum allowed size")


def _etag_matches(header: str, etag: str) -> bool:
    """Whether an If-Match / If-None-Match list names ``etag`` (or is ``*``)."""
    return any(tag.strip().removeprefix("W/").strip('"') in (etag, "*") for tag in header.split(","))


def _byte_range(header: str, size: int) -> tuple[int, int] | None:
    """The first and last byte a Range header asks for; None where S3 ignores
    it and sends the whole object (not a single byte range, or ``a-b`` with
    b < a); InvalidRange where it starts at or past the end."""
    match = _RANGE.fullmatch(header.strip())
    if match is None or not (match[1] or match[2]):
        return None
    if match[1]:
        first = int(match[1])
        last = int(match[2]) if match[2] else size - 1
        if last < first and match[2]:
            return None
    else:
        first, last = max(0, size - int(match[2])), size - 1
        if int(match[2]) == 0:
            first = size  # an empty suffix is never satisfiable
    if first >= size:
        raise S3Error(416, "InvalidRange", "The requested range is not satisfiable")
    return first, min(last, size - 1)


def _iso_time(mtime: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(mtime))


def _element(name: str, value: object) -> str:
    return f"<{name}>{escape(str(value))}</{name}>"


def _list_xml(bucket: str, query: dict[str, str], page: ListedPage, key_count: int, max_keys: int) -> bytes:
    encode = query.get("encoding-type") == "url"

    def name(raw: str | bytes) -> str:
        text = raw.decode() if isinstance(raw, bytes) else raw
        return quote_plus(text, safe="/") if encode else text

    parts = [
        _XML_DECLARATION,
        f'<ListBucketResult xmlns="{_S3_NAMESPACE}">',
        _element("Name", bucket),
        _element("Prefix", name(query.get("prefix", ""))),
        _element("MaxKeys", max_keys),
        _element("KeyCount", key_count),
        _element("IsTruncated", "true" if page.next_bound is not None else "false"),
    ]
    if "delimiter" in query:
        parts.append(_element("Delimiter", name(query["delimiter"])))
    if encode:
        parts.append(_element("EncodingType", "url"))
    if "continuation-token" in query:
        parts.append(_element("ContinuationToken", query["continuation-token"]))
    if "start-after" in query:
        parts.append(_element("StartAfter", name(query["start-after"])))
    if page.next_bound is not None:
        parts.append(_element("NextContinuationToken", base64.urlsafe_b64encode(page.next_bound).decode()))
    for key, stored in page.objects:
        parts.append(
            "<Contents>"
            + _element("Key", name(key))
            + _element("LastModified", _iso_time(stored.mtime))
            + _element("ETag", f'"{stored.etag}"')
            + _element("Size", stored.size)
            + _element("StorageClass", "STANDARD")
            + "</Contents>"
        )
    for common in page.prefixes:
        parts.append("<CommonPrefixes>" + _element("Prefix", name(common)) + "</CommonPrefixes>")
    parts.append("</ListBucketResult>")
    return "".join(parts).encode()


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, owner: FileS3Server, address: tuple[str, int]) -> None:
        self.owner = owner
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    server: _HttpServer

    def setup(self) -> None:
        super().setup()
        self.server.owner.track(self.connection, True)

    def finish(self) -> None:
        self.server.owner.track(self.connection, False)
        super().finish()

    def log_message(self, format: str, *args: object) -> None:
        """One line per request would drown benchmark output."""

    def do_GET(self) -> None:
        self._answer()

    def do_HEAD(self) -> None:
        self._answer()

    def do_PUT(self) -> None:
        self._answer()

    def do_DELETE(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self._answer()

    # -- dispatch ---------------------------------------------------------------

    def _answer(self) -> None:
        owner = self.server.owner
        split = urlsplit(self.path)
        try:
            path = unquote(split.path, errors="strict").removeprefix("/")
        except UnicodeDecodeError:
            path = ""
        bucket, _, key = path.partition("/")
        with owner.counter.answering(request_kind(self.command, bucket, key)):
            latency = owner.latency_seconds
            if latency > 0:
                time.sleep(latency)
            try:
                if self.headers.get("Transfer-Encoding"):
                    self.close_connection = True
                    raise S3Error(411, "MissingContentLength", "You must provide the Content-Length header.")
                if not (self.command in ("PUT", "POST") and key):
                    self._drain()
                if not path and split.path not in ("", "/"):
                    raise S3Error(400, "InvalidURI", "Couldn't parse the specified URI.")
                query = {name: values[-1] for name, values in parse_qs(split.query, True).items()}
                if key:
                    self._object(bucket, key, query)
                elif bucket:
                    self._bucket(bucket, query)
                else:
                    raise _not_implemented("ListBuckets")
            except S3Error as error:
                self._error(error, path)

    def _bucket(self, bucket: str, query: dict[str, str]) -> None:
        index = self.server.owner.index
        if self.command == "PUT" and not query:
            if not _BUCKET_NAME.fullmatch(bucket):
                raise S3Error(400, "InvalidBucketName", "The specified bucket is not valid.")
            index.create_bucket(bucket)
            self._reply(200, {"Location": f"/{bucket}"})
        elif self.command == "HEAD" and not query:
            if not index.has_bucket(bucket):
                raise _no_such_bucket(bucket)
            self._reply(200, {})
        elif self.command == "GET" and query.get("list-type") == "2":
            self._list(bucket, query)
        else:
            raise _not_implemented(f"{self.command} on a bucket with {sorted(query)}")

    def _list(self, bucket: str, query: dict[str, str]) -> None:
        try:
            max_keys = min(int(query.get("max-keys", MAX_KEYS)), MAX_KEYS)
        except ValueError:
            max_keys = -1
        if max_keys < 0:
            raise S3Error(400, "InvalidArgument", "max-keys must be a non-negative integer")
        bound = query.get("start-after", "").encode()
        if bound:
            bound += b"\0"
        if "continuation-token" in query:
            try:
                bound = base64.urlsafe_b64decode(query["continuation-token"].encode())
            except (binascii.Error, ValueError):
                raise S3Error(
                    400, "InvalidArgument", "The continuation token provided is incorrect"
                ) from None
        page = self.server.owner.index.page(
            bucket, query.get("prefix", "").encode(), query.get("delimiter", "").encode(), bound, max_keys
        )
        body = _list_xml(bucket, query, page, len(page.objects) + len(page.prefixes), max_keys)
        self._reply(200, {"Content-Type": "application/xml"}, body)

    def _object(self, bucket: str, key: str, query: dict[str, str]) -> None:
        if _bad_key(key):
            self.close_connection = True  # the body is not read
            raise S3Error(400, "InvalidArgument", "This server refuses keys that could not be file names.")
        copying = "x-amz-copy-source" in self.headers
        if self.command == "POST" and "uploads" in query:
            self._drain()
            self._create_upload(bucket, key)
        elif self.command == "POST" and "uploadId" in query:
            self._complete_upload(bucket, key, query["uploadId"])
        elif self.command == "PUT" and "uploadId" in query:
            self._put_part(bucket, key, query)
        elif self.command == "DELETE" and "uploadId" in query:
            self.server.owner.uploads.discard(self.server.owner.uploads.take(query["uploadId"], bucket, key))
            self._reply(204, {})
        elif query or self.command == "POST":
            self.close_connection = True  # the body is not read
            raise _not_implemented(f"{self.command} on an object with {sorted(query)}")
        elif self.command in ("GET", "HEAD"):
            self._get(bucket, key)
        elif self.command == "PUT" and copying:
            self._drain()
            self._copy_object(bucket, key)
        elif self.command == "PUT":
            self._put(bucket, key)
        elif self.command == "DELETE":
            self.server.owner.index.delete(bucket, key)
            self._reply(204, {})
        else:
            raise _not_implemented(f"{self.command} on an object")

    def _get(self, bucket: str, key: str) -> None:
        stored, file = self.server.owner.index.open(bucket, key)
        with file:
            headers = {
                "ETag": f'"{stored.etag}"',
                "Last-Modified": email.utils.formatdate(stored.mtime, usegmt=True),
                "Accept-Ranges": "bytes",
            }
            if_match = self.headers.get("If-Match")
            if if_match is not None and not _etag_matches(if_match, stored.etag):
                raise S3Error(
                    412, "PreconditionFailed", "At least one of the preconditions you specified did not hold."
                )
            if_none_match = self.headers.get("If-None-Match")
            if if_none_match is not None and _etag_matches(if_none_match, stored.etag):
                self._reply(304, headers)
                return
            first, last, status = 0, stored.size - 1, 200
            asked = self.headers.get("Range")
            chosen = None if asked is None else _byte_range(asked, stored.size)
            if chosen is not None:
                (first, last), status = chosen, 206
                headers["Content-Range"] = f"bytes {first}-{last}/{stored.size}"
            length = last - first + 1
            headers["Content-Type"] = "binary/octet-stream"
            self._reply(status, headers, length=length)
            if self.command == "GET" and length:
                try:
                    self.connection.sendfile(file, first, length)
                except OSError:
                    self.close_connection = True  # the client went away mid-body

    def _put(self, bucket: str, key: str) -> None:
        index = self.server.owner.index
        name = uuid.uuid4().hex
        try:
            size, digest = self._receive(name)
            stored = StoredObject(size, digest.hex(), int(time.time()))
            index.commit(bucket, key, stored, name)
        except BaseException:
            (index.objects / name).unlink(missing_ok=True)
            raise
        self._reply(200, {"ETag": f'"{stored.etag}"'})

    def _receive(self, name: str) -> tuple[int, bytes]:
        """The request's body into file ``name``: its size and MD5."""
        remaining = int(self.headers.get("Content-Length", 0))
        digest, size = hashlib.md5(), 0
        with open(self.server.owner.index.objects / name, "wb") as out:
            while remaining:
                chunk = self.rfile.read(min(remaining, _COPY_CHUNK))
                if not chunk:
                    self.close_connection = True
                    raise S3Error(400, "IncompleteBody", "The request body ended early.")
                out.write(chunk)
                digest.update(chunk)
                remaining -= len(chunk)
                size += len(chunk)
        return size, digest.digest()

    def _copy_into(self, name: str) -> tuple[int, bytes]:
        """The bytes ``x-amz-copy-source`` (and ``-range``) name into file
        ``name``, if the source matches ``x-amz-copy-source-if-match``: their
        size and MD5."""
        index = self.server.owner.index
        path = unquote(self.headers["x-amz-copy-source"].partition("?")[0]).removeprefix("/")
        bucket, _, key = path.partition("/")
        if not key:
            raise S3Error(400, "InvalidArgument", "Copy Source must name the source bucket and key")
        stored, file = index.open(bucket, key)
        with file:
            if_match = self.headers.get("x-amz-copy-source-if-match")
            if if_match is not None and not _etag_matches(if_match, stored.etag):
                raise S3Error(
                    412, "PreconditionFailed", "At least one of the preconditions you specified did not hold."
                )
            first, last = 0, stored.size - 1
            asked = self.headers.get("x-amz-copy-source-range")
            if asked is not None:
                match = _RANGE.fullmatch(asked.strip())
                if match is None or not (match[1] and match[2]) or int(match[2]) < int(match[1]):
                    raise S3Error(
                        400, "InvalidArgument", "The x-amz-copy-source-range value must be bytes=first-last"
                    )
                first, last = int(match[1]), int(match[2])
                if last >= stored.size:
                    raise S3Error(416, "InvalidRange", "The requested range is not satisfiable")
            digest, remaining = hashlib.md5(), last - first + 1
            file.seek(first)
            with open(index.objects / name, "wb") as out:
                while remaining > 0:
                    chunk = file.read(min(remaining, _COPY_CHUNK))
                    out.write(chunk)
                    digest.update(chunk)
                    remaining -= len(chunk)
        return last - first + 1, digest.digest()

    def _copy_object(self, bucket: str, key: str) -> None:
        index = self.server.owner.index
        name = uuid.uuid4().hex
        try:
            size, digest = self._copy_into(name)
            stored = StoredObject(size, digest.hex(), int(time.time()))
            index.commit(bucket, key, stored, name)
        except BaseException:
            (index.objects / name).unlink(missing_ok=True)
            raise
        body = (
            f'{_XML_DECLARATION}<CopyObjectResult xmlns="{_S3_NAMESPACE}">'
            + _element("LastModified", _iso_time(stored.mtime))
            + _element("ETag", f'"{stored.etag}"')
            + "</CopyObjectResult>"
        )
        self._reply(200, {"Content-Type": "application/xml"}, body.encode())

    def _create_upload(self, bucket: str, key: str) -> None:
        if not self.server.owner.index.has_bucket(bucket):
            raise _no_such_bucket(bucket)
        upload_id = self.server.owner.uploads.create(bucket, key)
        body = (
            f'{_XML_DECLARATION}<InitiateMultipartUploadResult xmlns="{_S3_NAMESPACE}">'
            + _element("Bucket", bucket)
            + _element("Key", key)
            + _element("UploadId", upload_id)
            + "</InitiateMultipartUploadResult>"
        )
        self._reply(200, {"Content-Type": "application/xml"}, body.encode())

    def _put_part(self, bucket: str, key: str, query: dict[str, str]) -> None:
        owner = self.server.owner
        copying = "x-amz-copy-source" in self.headers
        if copying:
            self._drain()
        try:
            number = int(query.get("partNumber", ""))
        except ValueError:
            number = 0
        if not 1 <= number <= MAX_PART_NUMBER:
            self.close_connection = True  # the body is not read
            raise S3Error(
                400, "InvalidArgument", f"Part number must be an integer between 1 and {MAX_PART_NUMBER}"
            )
        try:
            owner.uploads.check(query["uploadId"], bucket, key)
        except S3Error:
            self.close_connection = True  # the body is not read
            raise
        name = uuid.uuid4().hex
        try:
            size, digest = self._copy_into(name) if copying else self._receive(name)
        except BaseException:
            (owner.index.objects / name).unlink(missing_ok=True)
            raise
        owner.uploads.add_part(query["uploadId"], bucket, key, number, (name, size, digest))
        if not copying:
            self._reply(200, {"ETag": f'"{digest.hex()}"'})
            return
        body = (
            f'{_XML_DECLARATION}<CopyPartResult xmlns="{_S3_NAMESPACE}">'
            + _element("LastModified", _iso_time(int(time.time())))
            + _element("ETag", f'"{digest.hex()}"')
            + "</CopyPartResult>"
        )
        self._reply(200, {"Content-Type": "application/xml"}, body.encode())

    def _complete_upload(self, bucket: str, key: str, upload_id: str) -> None:
        """The parts the request lists, in order, joined into the object."""
        owner = self.server.owner
        request = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            listed = [
                (
                    int(part.findtext(f"{{{_S3_NAMESPACE}}}PartNumber") or part.findtext("PartNumber") or 0),
                    (part.findtext(f"{{{_S3_NAMESPACE}}}ETag") or part.findtext("ETag") or "").strip('"'),
                )
                for part in ElementTree.fromstring(request)
            ]
        except (ElementTree.ParseError, ValueError):
            raise S3Error(400, "MalformedXML", "The XML you provided was not well-formed.") from None
        upload = owner.uploads.take(upload_id, bucket, key)
        try:
            _check_parts(upload, listed)
        except S3Error:
            owner.uploads.restore(upload_id, upload)
            raise
        name = uuid.uuid4().hex
        try:
            with open(owner.index.objects / name, "wb") as out:
                for number, _ in listed:
                    part_name, part_size, _ = upload.parts[number]
                    _append(out.fileno(), owner.index.objects / part_name, part_size)
            md5s = [upload.parts[number][2] for number, _ in listed]
            size = sum(upload.parts[number][1] for number, _ in listed)
            stored = StoredObject(
                size, f"{hashlib.md5(b''.join(md5s)).hexdigest()}-{len(md5s)}", int(time.time())
            )
            owner.index.commit(bucket, key, stored, name)
        except BaseException:
            (owner.index.objects / name).unlink(missing_ok=True)
            owner.uploads.discard(upload)
            raise
        owner.uploads.discard(upload)
        body = (
            f'{_XML_DECLARATION}<CompleteMultipartUploadResult xmlns="{_S3_NAMESPACE}">'
            + _element("Location", f"/{bucket}/{key}")
            + _element("Bucket", bucket)
            + _element("Key", key)
            + _element("ETag", f'"{stored.etag}"')
            + "</CompleteMultipartUploadResult>"
        )
        self._reply(200, {"Content-Type": "application/xml"}, body.encode())

    # -- replies ----------------------------------------------------------------

    def _drain(self) -> None:
        """Read and drop a body this server does not use, so the connection
        stays in step for the next request."""
        remaining = int(self.headers.get("Content-Length", 0))
        while remaining:
            chunk = self.rfile.read(min(remaining, _COPY_CHUNK))
            if not chunk:
                self.close_connection = True
                return
            remaining -= len(chunk)

    def _reply(
        self, status: int, headers: dict[str, str], body: bytes = b"", length: int | None = None
    ) -> None:
        """Status and headers, then ``body`` unless this is a HEAD; ``length``
        is the Content-Length of a body the caller sends itself."""
        self.send_response(status)
        self.send_header("x-amz-request-id", uuid.uuid4().hex[:16].upper())
        for name, value in headers.items():
            self.send_header(name, value)
        if status != 304:
            self.send_header("Content-Length", str(len(body) if length is None else length))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, error: S3Error, resource: str) -> None:
        body = (
            _XML_DECLARATION
            + "<Error>"
            + _element("Code", error.code)
            + _element("Message", error.message)
            + _element("Resource", f"/{resource}")
            + "</Error>"
        ).encode()
        self._reply(error.status, {"Content-Type": "application/xml"}, body)


class FileS3Server(CountedServer):
    """The file-backed S3 endpoint on ``host:port`` in a background thread,
    with the counters and latency of ``s3_server.S3TestServer``.

    ``port=0`` picks a free port on the first ``start()``; later starts reuse it.
    """

    def __init__(
        self, root: Path, host: str = DEFAULT_HOST, port: int = 0, latency_seconds: float = 0.0
    ) -> None:
        super().__init__(host, port, latency_seconds)
        self.root = root
        self._index: _Index | None = None
        self._uploads: _Uploads | None = None

    @property
    def index(self) -> _Index:
        if self._index is None:
            raise RuntimeError("FileS3Server is not running")
        return self._index

    @property
    def uploads(self) -> _Uploads:
        if self._uploads is None:
            raise RuntimeError("FileS3Server is not running")
        return self._uploads

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> None:
        if self._server is not None:
            return
        if self._index is None:  # kept across restarts: a request cut off by stop() may still use it
            self._index = _Index(self.root)
            self._uploads = _Uploads(self._index.objects)
        server = _HttpServer(self, (self.host, self.port))
        self._serve(server, server.server_address[1], "file-s3")

    def __enter__(self) -> FileS3Server:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m cachefsd.testing.file_s3",
        description="Serve S3 buckets kept as files under a directory, optionally with a fixed latency.",
    )
    parser.add_argument("--root", type=Path, required=True, help="directory of the index and the objects")
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="delay added to every request")
    args = parser.parse_args(argv)
    serve_in_foreground(
        FileS3Server(args.root, host=args.host, port=args.port, latency_seconds=args.latency_ms / 1000.0)
    )


if __name__ == "__main__":
    main()

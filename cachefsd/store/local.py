"""A local directory as the cold store: the demo's source, and a way to cache
a slow network filesystem (NFS, Lustre) on fast local disk."""

from __future__ import annotations

import asyncio
import errno
import os
import stat
import uuid
from collections.abc import Callable
from pathlib import Path

from cachefsd.errors import ObjectChanged, ObjectNotFound, SourceChanged, SourceUnreadable, StoreError
from cachefsd.store.base import Listing, ListingPage, ObjectInfo
from cachefsd.store.source import SourceFile

# sendfile(2) copies at most this much a call (Linux's own cap, 2 GiB less a page).
_SENDFILE_MAX_BYTES = 0x7FFFF000


def _etag(st: os.stat_result) -> str:
    """A version id for a file: any rewrite changes mtime, size or inode."""
    return f"{st.st_mtime_ns:x}-{st.st_size:x}-{st.st_ino:x}"


def _info(key: str, st: os.stat_result) -> ObjectInfo:
    return ObjectInfo(key=key, size=st.st_size, etag=_etag(st), mtime=st.st_mtime)


class LocalStore:
    """Serves the files under ``root``. Symlinks are followed only when their
    target stays inside ``root``, and a link to a directory only when it
    does not lead back to a directory above it (``latest -> v2`` is shown,
    ``sub/up -> ..`` is not: it would make the tree endless for ``find``,
    ``du`` or a loader's scan); anything else is invisible."""

    def __init__(self, root: Path) -> None:
        self._root = root.resolve()

    @property
    def uri(self) -> str:
        return f"file://{self._root}"

    @property
    def cache_key(self) -> str:
        return self.uri

    @property
    def content_etags(self) -> bool:
        return False  # mtime, size and inode say nothing about content

    def _path(self, key: str) -> Path:
        """The file for ``key``, refusing any key that would leave the root."""
        if "\0" in key or key.startswith("/"):
            raise ObjectNotFound(key)
        try:
            path = (self._root / key).resolve()
        except (RuntimeError, OSError) as exc:  # a symlink loop: RuntimeError before Python 3.13
            raise ObjectNotFound(key) from exc
        if path != self._root and self._root not in path.parents:
            raise ObjectNotFound(key)
        return path

    async def check(self) -> bool:
        if not self._root.is_dir():
            raise ObjectNotFound(f"{self._root} is not a directory")
        if not os.access(self._root, os.R_OK | os.X_OK):
            raise StoreError(f"{self._root} is not readable")
        with os.scandir(self._root) as entries:
            return any(entries)

    async def list_page(self, prefix: str, token: str | None) -> ListingPage:
        """The whole directory in one page."""
        return ListingPage(await asyncio.to_thread(self._list, prefix), None)

    def _list(self, prefix: str) -> Listing:
        directory = self._path(prefix.rstrip("/")) if prefix else self._root
        objects: list[ObjectInfo] = []
        prefixes: list[str] = []
        try:
            entries = sorted(os.scandir(directory), key=lambda entry: entry.name)
        except FileNotFoundError:
            return Listing(objects=(), prefixes=())
        except NotADirectoryError:
            return Listing(objects=(), prefixes=())
        except OSError as exc:
            raise StoreError(f"cannot list {directory}: {exc.strerror}") from exc
        for entry in entries:
            key = prefix + entry.name
            try:
                if entry.is_symlink():
                    target = self._path(key)  # refuses links that leave the root
                    if target.is_dir() and self._leads_back(prefix, target):
                        continue
                st = os.stat(entry.path)
            except (OSError, ObjectNotFound):
                continue
            if stat.S_ISDIR(st.st_mode):
                prefixes.append(key + "/")
            elif stat.S_ISREG(st.st_mode):
                objects.append(_info(key, st))
        return Listing(objects=tuple(objects), prefixes=tuple(prefixes))

    def _leads_back(self, directory: str, target: Path) -> bool:
        """Whether ``target`` is where ``directory`` (a listed prefix) or a
        directory above it really is. Comparing with each ancestor's real
        path, not just the root, also ends loops made of several links
        (``a/x -> b``, ``b/y -> a``) after one turn."""
        parts = [part for part in directory.split("/") if part]
        return any(self._root.joinpath(*parts[:depth]).resolve() == target for depth in range(len(parts) + 1))

    async def head(self, key: str) -> ObjectInfo:
        return await asyncio.to_thread(self._head, key)

    def _head(self, key: str) -> ObjectInfo:
        try:
            st = os.stat(self._path(key))
        except OSError as exc:
            raise ObjectNotFound(key) from exc
        if not stat.S_ISREG(st.st_mode):
            raise ObjectNotFound(key)
        return _info(key, st)

    async def get_range(self, key: str, start: int, end: int, etag: str) -> bytes:
        return await asyncio.to_thread(self._get_range, key, start, end, etag)

    def _get_range(self, key: str, start: int, end: int, etag: str) -> bytes:
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError as exc:
            raise ObjectNotFound(key) from exc
        except OSError as exc:
            raise StoreError(f"cannot open {key}: {exc.strerror}") from exc
        try:
            if _etag(os.fstat(fd)) != etag:
                raise ObjectChanged(key)
            return os.pread(fd, end - start, start)
        except OSError as exc:
            raise StoreError(f"cannot read {key}: {exc.strerror}") from exc
        finally:
            os.close(fd)

    async def get_object(self, key: str) -> bytes:
        return await asyncio.to_thread(self._get_object, key)

    def _get_object(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError) as exc:
            raise ObjectNotFound(key) from exc
        except OSError as exc:
            raise StoreError(f"cannot read {key}: {exc.strerror}") from exc

    async def put_object(self, key: str, data: bytes) -> None:
        await asyncio.to_thread(self._write, key, lambda fd: _write_all(fd, data))

    async def put_file(self, key: str, path: Path) -> ObjectInfo:
        return await asyncio.to_thread(self._put_file, key, path)

    def _put_file(self, key: str, path: Path) -> ObjectInfo:
        source = SourceFile(path)
        try:

            def copy(fd: int) -> None:
                _copy_all(source, fd, path)
                source.check_unchanged()

            return self._write(key, copy)
        finally:
            source.close()

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(self._delete, key)

    def _delete(self, key: str) -> None:
        try:
            path = self._path(key)
        except ObjectNotFound:
            return  # no key outside the root names an object of this store
        try:
            if key.endswith("/"):  # a directory's marker: the directory, if empty, as in a bucket
                if path != self._root:
                    path.rmdir()
            elif stat.S_ISREG(os.stat(path).st_mode):
                path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            if exc.errno == errno.ENOTEMPTY:
                return
            raise StoreError(f"cannot delete {key}: {exc.strerror}") from exc

    async def copy(self, source: str, target: str) -> ObjectInfo:
        return await asyncio.to_thread(self._copy, source, target)

    def _copy(self, source: str, target: str) -> ObjectInfo:
        """A copy of the file (sendfile(2), in the kernel), renamed into place."""
        path = self._path(source)
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):
                raise ObjectNotFound(source)
            return self._put_file(target, path)
        except (OSError, SourceUnreadable) as exc:  # gone before or as it was opened
            raise ObjectNotFound(source) from exc

    def _write(self, key: str, fill: Callable[[int], None]) -> ObjectInfo:
        """A temporary file in the target's directory, filled by ``fill``,
        flushed to disk and renamed over ``key``: a reader sees the old file
        or the whole new one, and after a crash the directory holds one of
        them (and perhaps a temporary file), never a part."""
        if not key or key.endswith("/"):
            raise StoreError(f"cannot write {key!r}: not a file name")
        path = self._path(key)
        temp = path.with_name(f".{path.name[:200]}.{uuid.uuid4().hex}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                fill(fd)
                os.fsync(fd)
                info = _info(key, os.fstat(fd))  # rename keeps the inode and mtime
            finally:
                os.close(fd)
            os.replace(temp, path)
            _fsync_directory(path.parent)
        except OSError as exc:
            temp.unlink(missing_ok=True)
            raise StoreError(f"cannot write {key}: {exc.strerror}") from exc
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        return info

    async def close(self) -> None:
        return None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _copy_all(source: SourceFile, fd: int, path: Path) -> None:
    """All of ``source`` (its size when opened) into ``fd``, in the kernel."""
    offset = 0
    while offset < source.size:
        sent = os.sendfile(fd, source.fd, offset, min(source.size - offset, _SENDFILE_MAX_BYTES))
        if sent == 0:
            break
        offset += sent
    if offset != source.size:
        raise SourceChanged(f"{path} shrank while it was uploaded")


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

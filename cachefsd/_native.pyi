"""The native data plane (``native/``, Rust): the kernel's FUSE requests
served on native threads where the cache already holds the answer.

``Tables`` is what the kernel knows of a mount: the inodes ``fs.py`` hands
it (held with the name that found them), the kernel's references to them
(every FORGET is counted natively), and the verified raw cache files of
their blocks and whole files. ``Session`` serves one mount's connection
on native workers, hands Python the requests only Python answers, and
keeps the passthrough rules of every open (``native/src/opens.rs``).
"""

from collections.abc import Callable
from typing import Literal

# protocol.Attr's fields: ino, size, mtime, mode, nlink, uid, gid.
AttrFields = tuple[int, int, float, int, int, int, int]
# index, path, offset of the block in the file, the file's st_dev, st_ino,
# st_ctime_ns (as verified), and the name of its tier.
BlockFileFields = tuple[int, str, int, int, int, int, str]
# A version's whole file: path, st_dev, st_ino, st_ctime_ns (as verified), tier.
WholeFields = tuple[str, int, int, int, str]
# A listing's entry: name, inode, attributes, cacheable.
ListedFields = tuple[bytes, int, AttrFields, bool]
# inode, offset, size, pid, bytes served by tier, seconds.
ReadFields = tuple[int, int, int, int, list[tuple[str, int]], float]
# inode, pid, tier: an open the kernel now reads from that tier's file.
OpenFields = tuple[int, int, str]

class Tables:
    def __init__(self, ttl_seconds: float) -> None:
        """Names are answered for ``ttl_seconds`` from when Python held them."""

    def hold(
        self, inode: int, parent: int, name: bytes, attributes: AttrFields, cacheable: bool
    ) -> list[int]:
        """The kernel is handed ``inode`` as ``name`` in ``parent``: one
        more reference. Not ``cacheable``: its attributes change under the
        kernel (a staged file), so it is counted but Python answers it.
        The inodes gone: an unreferenced one the name led to before."""

    def forget(self, inode: int, count: int) -> bool:
        """The kernel dropped ``count`` references; whether the inode is now
        gone (unreferenced, and no fresh name keeps it)."""

    def holds(self, inode: int) -> bool:
        """Whether ``inode`` is still known: referenced, or kept by its fresh name."""

    def uncache(self, inode: int) -> None:
        """``inode``'s attributes now change under the kernel: counted
        still, answered by Python only."""

    def drop_name(self, parent: int, name: bytes) -> list[int]:
        """``name`` in ``parent`` is to be asked of Python again; the
        inodes gone with it (one it kept alone)."""

    def set_blocks(
        self,
        inode: int,
        size: int,
        block_size: int,
        first: int,
        last: int,
        files: list[BlockFileFields],
        whole: WholeFields | None,
    ) -> None:
        """The verified raw files of blocks ``first`` to ``last`` of
        ``inode`` (``size`` bytes cut in ``block_size``), replacing what was
        known of those; reads of a block without one are Python's. ``whole``:
        the file of exactly its bytes (for passthrough opens), or None."""

    def set_listing(self, handle: int, directory: int, entries: list[ListedFields]) -> None:
        """Listing ``handle`` of ``directory`` as its OPENDIR found it (``.``
        and ``..`` first), which the native workers read (READDIRPLUS, each
        entry sent held as if looked up) and release (RELEASEDIR). Its
        entries' inodes stay until then."""

    def release_listing(self, handle: int) -> list[int]:
        """Listing ``handle`` is released without the kernel (its OPENDIR was
        interrupted); the inodes gone with it."""

    def drain(
        self, timeout: float
    ) -> tuple[list[ReadFields], list[OpenFields], list[int], list[tuple[str, int]]]:
        """What the native workers did since the last drain: the reads they
        served, the files they opened in passthrough, the inodes gone (by
        their FORGETs, by names that expired), and the requests answered by
        operation; waits up to ``timeout`` seconds for the first."""

class Session:
    def __init__(self, fd: int, tables: Tables, writable: bool, workers: int, request_buffer: int) -> None:
        """Serve the connection of ``fd`` on ``workers`` threads, each on a
        descriptor of its own, reading into ``request_buffer`` bytes.
        ``writable``: a staged file's FLUSH is Python's (a read-only mount
        implements none)."""

    def set_open_mode(self, mode: Literal["python", "through", "cached", "no-open"]) -> None:
        """How the native workers answer an OPEN for reading of a version:
        hand it to Python; in passthrough, on its whole file where named;
        a cached open; ENOSYS (the kernel opens files without asking). In
        the last two, by the passthrough rules while any inode has a
        passthrough open."""

    def open(
        self,
        inode: int,
        find: Callable[[], tuple[int, str] | None],
        staged: bool,
        waiting: Callable[[], None],
    ) -> int | None:
        """Open ``inode`` (a ``staged`` file's, else a version's) by the
        passthrough rules: the backing id to answer with, or None for a
        cached open; OSError EBUSY if the inode is open on the other kind
        of file. ``find()`` is asked for the file of its bytes (descriptor,
        tier) only when the rules need one; the caller closes that
        descriptor. ``waiting()`` is called before this waits for another
        open's find (which may verify a large file)."""

    def begin_writer(self, inode: int) -> bool:
        """An open of ``inode`` is to stage its version to write it: False
        if the version is open on its cache file; else new opens of the
        version are cached ones until ``end_writer``."""

    def end_writer(self, inode: int) -> None: ...
    def release(self, inode: int, through: bool) -> None:
        """An open Python answered was released (``through``: a passthrough one)."""

    def passing_through(self) -> bool:
        """Whether any inode has a passthrough open: until none has, a mount
        that gave passthrough up still answers OPEN by the rules."""

    def check_backing(self, fd: int) -> None:
        """Register ``fd`` as a backing file and close it again; OSError
        if the kernel refuses it."""

    def next_request(self) -> tuple[int, bytes] | None:
        """The next request only Python answers: the descriptor its answer
        goes through, and its bytes. None once the session ended."""

    def stop(self) -> None: ...
    def join(self) -> None: ...
    @property
    def failure(self) -> str | None:
        """Why the session ended, if not by an unmount or ``stop``."""

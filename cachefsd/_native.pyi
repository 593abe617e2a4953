"""The native data plane (``native/``, Rust): the kernel's FUSE requests
served on native threads where the cache already holds the answer.

``Tables`` is what the kernel knows of a mount: the inodes ``fs.py`` hands
it (held with the name that found them), the kernel's references to them
(every FORGET is counted natively), and the verified raw cache files of
their blocks. ``Session`` serves one mount's connection on native workers
and hands Python the requests only Python answers.
"""

# protocol.Attr's fields: ino, size, mtime, mode, nlink, uid, gid.
AttrFields = tuple[int, int, float, int, int, int, int]
# index, path, offset of the block in the file, the file's st_dev, st_ino,
# st_ctime_ns (as verified), and the name of its tier.
BlockFileFields = tuple[int, str, int, int, int, int, str]
# inode, offset, size, pid, bytes served by tier, seconds.
ReadFields = tuple[int, int, int, int, list[tuple[str, int]], float]

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
        self, inode: int, size: int, block_size: int, first: int, last: int, files: list[BlockFileFields]
    ) -> None:
        """The verified raw files of blocks ``first`` to ``last`` of
        ``inode`` (``size`` bytes cut in ``block_size``), replacing what was
        known of those; reads of a block without one are Python's."""

    def drain(self, timeout: float) -> tuple[list[ReadFields], list[int], list[tuple[str, int]]]:
        """What the native workers did since the last drain: the reads they
        served, the inodes gone (by their FORGETs, by names that expired),
        and the requests answered by operation; waits up to ``timeout``
        seconds for the first."""

class Session:
    def __init__(self, fd: int, tables: Tables, workers: int, request_buffer: int) -> None:
        """Serve the connection of ``fd`` on ``workers`` threads, each on a
        descriptor of its own, reading into ``request_buffer`` bytes."""

    def next_request(self) -> tuple[int, bytes] | None:
        """The next request only Python answers: the descriptor its answer
        goes through, and its bytes. None once the session ended."""

    def stop(self) -> None: ...
    def join(self) -> None: ...
    @property
    def failure(self) -> str | None:
        """Why the session ended, if not by an unmount or ``stop``."""

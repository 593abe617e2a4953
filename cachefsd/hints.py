"""The loader's side of hints: tell the daemon the exact read order of an epoch.

With the sampler's order in hand the daemon prefetches exactly what the
loader is about to read and keeps what it has not read yet (NoPFS, SC 2021)
instead of guessing from the access pattern. ``HintingSampler`` wraps any
PyTorch sampler (``RandomSampler``, ``DistributedSampler``, a batch
sampler, or any iterable of indices with a length): each time iteration
starts (once per epoch), it materialises the epoch's indices, maps them to
file paths, sends each mount's share of the order to that mount's daemon,
and yields the same indices unchanged.

Hints are advice. Sending happens on a background thread, so an epoch never
waits on the daemon; a daemon that cannot be reached, or paths that are not
under a cachefsd mount, cost one logged warning and nothing else: the loader
reads exactly as it would without the wrapper, and the daemon falls back to
what it learns from the reads.

This module imports neither torch nor the data path, so it can be imported
in any training environment; it only needs the standard library and
``cachefsd.control``.

Concurrency: ``__iter__`` runs on the loader's thread and starts one sender
thread per epoch, which first waits for the last one (so the mapping state
is only ever used by one thread at a time); the result fields are guarded
by ``_lock``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cachefsd.control.client import CALL_TIMEOUT_SECONDS, ControlClient, client_for
from cachefsd.control.mounts import MountOf, find_mount, not_a_mount
from cachefsd.errors import ControlError

log = logging.getLogger(__name__)


class IndexSampler(Protocol):
    """What is wrapped: iterable (once per epoch) and sized, like every
    ``torch.utils.data.Sampler`` a ``DataLoader`` accepts."""

    def __iter__(self) -> Iterator[Any]: ...

    def __len__(self) -> int: ...


@dataclass(frozen=True, slots=True)
class HintResult:
    """What one mount's daemon answered for one epoch's hint."""

    mountpoint: str
    sent: int
    accepted: int
    unknown: int


class MountPaths:
    """Path -> (mount, mount-relative path), resolving each directory once:
    a dataset of millions of files has only thousands of directories.
    Relative paths are relative to ``base`` (a mount, or a directory in
    one); ``..`` and ``.`` are resolved as the kernel would."""

    def __init__(self, base: MountOf | None) -> None:
        self._base = base
        self._base_prefix = "" if base is None else str(base.mountpoint).rstrip("/") + "/"
        self._by_dir: dict[str, MountOf | None] = {}

    def place(self, path: str) -> tuple[MountOf | None, str]:
        if not os.path.isabs(path):
            if self._base is None:
                path = os.path.abspath(path)
            else:  # under the base directory, where .. may lead out of the mount
                path = f"{self._base_prefix}{self._base.relative.lstrip('/')}/{path}"
        path = os.path.normpath(path)
        if self._base is not None and (path + "/").startswith(self._base_prefix):
            return self._base, "/" + path[len(self._base_prefix) :]
        directory, _, name = path.rpartition("/")
        directory = directory or "/"
        if directory not in self._by_dir:
            self._by_dir[directory] = find_mount(directory)
        mount = self._by_dir[directory]
        if mount is None:
            return None, path
        return mount, (mount.relative.rstrip("/") + "/" + name)


class HintingSampler:
    """Yields what ``sampler`` yields, after sending each epoch's order of
    ``paths[index]`` to the daemons of the mounts holding them.

    ``paths[i]`` is the file of sample ``i``: absolute (under a cachefsd
    mount), or relative to ``mountpoint`` (a mount path, or a directory in
    one). A sampler that yields batches (lists of indices) is hinted in
    flattened order. ``set_epoch`` is passed on, so a ``DistributedSampler``
    wrapped here reshuffles as usual; each rank hints its own share, tagged
    with its rank and the world size, and the daemon merges the shares of
    the ranks on its node into one order (they read side by side)."""

    def __init__(
        self,
        sampler: IndexSampler | Iterable[Any],
        paths: Sequence[str],
        mountpoint: str | os.PathLike[str] | None = None,
        timeout: float = CALL_TIMEOUT_SECONDS,
    ) -> None:
        self.sampler = sampler
        self._paths = paths
        self._mountpoint = None if mountpoint is None else Path(mountpoint)
        self._timeout = timeout
        self._lock = threading.Lock()
        self._mounts: MountPaths | None = None
        self._warned = False
        self._sender: threading.Thread | None = None
        self._results: list[HintResult] = []

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]  # every torch sampler a DataLoader takes is sized

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch on (``DistributedSampler`` seeds its shuffle with it)."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        items = list(self.sampler)
        # Placing a million paths under their mounts takes seconds: that is
        # done on the sender thread too, after the last epoch's sender.
        sender = threading.Thread(
            target=self._send, args=(items, self._sender), name="cachefsd-hint", daemon=True
        )
        self._sender = sender
        sender.start()
        return iter(items)

    @property
    def results(self) -> list[HintResult]:
        """The daemons' answers to the last hint sent (empty until it arrives)."""
        with self._lock:
            return list(self._results)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the last epoch's hint to be sent; True if it was (or none
        was pending). For tests and for callers that want the hint in place
        before the first read."""
        sender = self._sender
        if sender is None:
            return True
        sender.join(timeout)
        return not sender.is_alive()

    # -- plumbing ---------------------------------------------------------

    def _send(self, items: list[Any], previous: threading.Thread | None) -> None:
        """Build each mount's share of the order and deliver it, once the
        previous epoch's hint is out (hints must arrive in epoch order)."""
        if previous is not None:
            previous.join()
        try:
            orders = self._orders(items)
        except Exception as exc:  # a hint must never break the training loop
            self._warn(f"cannot build the read-order hint: {exc}")
            return
        if orders:
            self._deliver(orders)

    def _orders(self, items: list[Any]) -> list[tuple[MountOf, list[str]]]:
        if self._mounts is None:
            base = None
            if self._mountpoint is not None:
                base = find_mount(self._mountpoint)
                if base is None:
                    self._warn(f"{not_a_mount(self._mountpoint)}; no hints are sent")
            self._mounts = MountPaths(base)
        orders: dict[Path, tuple[MountOf, list[str]]] = {}
        outside = 0
        for item in items:
            for index in item if isinstance(item, list | tuple) else (item,):
                mount, relative = self._mounts.place(os.fspath(self._paths[int(index)]))
                if mount is None:
                    outside += 1
                    continue
                orders.setdefault(mount.mountpoint, (mount, []))[1].append(relative)
        if outside:
            self._warn(f"{outside} sample paths are not under a cachefsd mount and are not hinted")
        return list(orders.values())

    def _part(self) -> tuple[int, int] | None:
        """(rank, world size) of a distributed sampler, None otherwise."""
        rank, world = getattr(self.sampler, "rank", None), getattr(self.sampler, "num_replicas", None)
        if isinstance(rank, int) and isinstance(world, int) and world > 1:
            return rank, world
        return None

    def _deliver(self, orders: list[tuple[MountOf, list[str]]]) -> None:
        results = []
        for mount, order in orders:
            try:
                client: ControlClient = client_for(mount, self._timeout)
                accepted, unknown = client.hint(order, self._part())
            except ControlError as exc:
                self._warn(f"hint to {mount.mountpoint} not delivered (reads are unaffected): {exc}")
                continue
            except Exception as exc:
                self._warn(f"hint to {mount.mountpoint} failed (reads are unaffected): {exc}")
                continue
            results.append(HintResult(str(mount.mountpoint), len(order), accepted, unknown))
            log.debug(
                "hinted %d paths to %s: %d accepted, %d unknown",
                len(order),
                mount.mountpoint,
                accepted,
                unknown,
            )
        with self._lock:
            self._results = results

    def _warn(self, message: str) -> None:
        """The first problem is a warning, later ones debug lines: a job of
        a hundred epochs should not log the same unreachable daemon 100 times."""
        with self._lock:
            first, self._warned = not self._warned, True
        log.log(logging.WARNING if first else logging.DEBUG, "cachefsd hints: %s", message)

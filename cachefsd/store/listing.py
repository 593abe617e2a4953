"""Building one level of a delimiter listing from a flat set of keys, shared
by the stores that have no server to do it (memory)."""

from __future__ import annotations

from collections.abc import Iterable

from cachefsd.store.base import Listing, ObjectInfo


def one_level(prefix: str, objects: Iterable[ObjectInfo]) -> Listing:
    """The delimiter-``/`` listing of ``prefix`` over ``objects`` (any order)."""
    direct: list[ObjectInfo] = []
    prefixes: set[str] = set()
    for info in objects:
        if not info.key.startswith(prefix):
            continue
        rest = info.key[len(prefix) :]
        cut = rest.find("/")
        if cut < 0:
            direct.append(info)
        else:
            prefixes.add(prefix + rest[: cut + 1])
    direct.sort(key=lambda info: info.key)
    return Listing(objects=tuple(direct), prefixes=tuple(sorted(prefixes)))

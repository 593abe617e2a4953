"""Building one level of a delimiter listing: from a flat set of keys, for
the stores that have no server to do it (memory), and from its pages."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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


def merged(pages: Sequence[Listing]) -> Listing:
    """The listing whose pages are ``pages``, sorted as a one-page listing is."""
    objects = [info for page in pages for info in page.objects]
    prefixes = sorted({prefix for page in pages for prefix in page.prefixes})
    objects.sort(key=lambda info: info.key)
    return Listing(objects=tuple(objects), prefixes=tuple(prefixes))

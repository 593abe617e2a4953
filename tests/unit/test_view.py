"""The cache as the prefetcher, staging and the filesystem see one source's blocks (``cache.view``)."""

from __future__ import annotations

import dataclasses
import os

from cachefsd.cache.policy import PlannedUse
from tests.unit.conftest import BLOCK_SIZE, RigFactory


def test_the_view_finds_a_versions_blocks_and_plans_and_warms_only_cached_ones(make_rig: RigFactory) -> None:
    planned = PlannedUse()
    rig = make_rig({"f": os.urandom(2 * BLOCK_SIZE)}, planned=planned)
    info = rig.namespace.lookup("/f").info
    assert info is not None
    assert rig.view.digest(info, 0) is None
    assert rig.view.residency(info, 0) is None
    assert rig.view.plan(info, 0, 5.0) is None  # nothing cached: nothing planned
    assert not rig.view.warm(info, 0)
    assert rig.view.usage() == (rig.cache.capacity, 0)
    assert rig.reader.fetch_run_ahead(info, range(2)) == {0, 1}
    digest = rig.view.digest(info, 0)
    assert digest is not None
    assert digest == rig.cache.lookup(rig.reader.ref(info, 0))  # named as the read path names it
    assert rig.view.residency(info, 0) == "hot"
    assert rig.view.digest(dataclasses.replace(info, etag="another version"), 0) is None
    assert rig.view.plan(info, 0, 5.0) == digest
    assert planned.next_use(digest) == 5.0
    rig.view.unplan(digest)
    assert planned.next_use(digest) is None
    assert rig.view.warm(info, 1, hold=True)
    assert rig.view.usage() == (rig.cache.capacity, rig.cache.used_bytes)
    assert rig.view.room() == rig.cache.room()

"""Streams: sequential readers inside large files and the windows ahead of them."""

from __future__ import annotations

from cachefsd.workload.model import WorkloadModel
from cachefsd.workload.streams import (
    MAX_STREAMS_PER_WORKLOAD,
    STREAM_CONFIRM_BYTES,
    STREAM_IDLE_SECONDS,
    STREAM_INITIAL_WINDOW,
    STREAM_MAX_WINDOW,
    Streams,
)
from tests.unit.traces import KIB, MIB, SMALL

SHARD = "shards/shard-000.tar"
HUGE = 1 << 30


def windows(streams: Streams, now: float = 0.0) -> list[tuple[str, int, int]]:
    return list(streams.windows(now))


def test_a_sequential_reader_gets_a_growing_window_after_its_last_read() -> None:
    streams = Streams()
    chunk = 256 * KIB
    offset = 0
    while offset + chunk < STREAM_CONFIRM_BYTES:
        streams.read(SHARD, offset, chunk, HUGE, 0.0)
        offset += chunk
        # A random reader's read-around (several contiguous READs) is not a stream.
        assert windows(streams) == []
    lengths = []
    while offset < 200 * MIB:
        streams.read(SHARD, offset, chunk, HUGE, 0.0)
        offset += chunk
        lengths.append(windows(streams)[0][2])
    # The window doubled each time a whole window was consumed, before the
    # stream was confirmed too (1 + 2 + 4 MiB), up to the maximum.
    assert lengths[0] == 8 * STREAM_INITIAL_WINDOW
    assert sorted(set(lengths)) == [8 * STREAM_INITIAL_WINDOW << k for k in range(4)]
    assert lengths[-1] == STREAM_MAX_WINDOW
    assert lengths == sorted(lengths)


def test_a_seek_resets_the_stream_window() -> None:
    streams = Streams()
    for offset in range(0, 8 * MIB, MIB):
        streams.read(SHARD, offset, MIB, HUGE, 0.0)
    grown = windows(streams)[0][2]
    assert grown > 2 * STREAM_INITIAL_WINDOW
    streams.read(SHARD, 500 * MIB, 256 * KIB, HUGE, 0.0)
    assert windows(streams) == []
    streams.read(SHARD, 500 * MIB + 256 * KIB, STREAM_CONFIRM_BYTES, HUGE, 0.0)
    # Started over from the initial window (doubled once by that long read).
    assert windows(streams) == [
        (SHARD, 500 * MIB + 256 * KIB + STREAM_CONFIRM_BYTES, 2 * STREAM_INITIAL_WINDOW)
    ]


def test_small_gaps_and_reordered_reads_continue_a_stream() -> None:
    streams = Streams()
    streams.read(SHARD, 0, STREAM_CONFIRM_BYTES, HUGE, 0.0)
    end = STREAM_CONFIRM_BYTES + 256 * KIB
    streams.read(SHARD, end - 128 * KIB, 128 * KIB, HUGE, 0.0)  # page cache served the gap
    streams.read(SHARD, end - 256 * KIB, 128 * KIB, HUGE, 0.0)  # a late FUSE thread
    # The same stream: its window grew (a doubling a read that consumed it),
    # where one started over would predict nothing before 8 MiB.
    assert windows(streams) == [(SHARD, end, 2 * STREAM_INITIAL_WINDOW)]


def test_stream_window_is_clipped_to_the_file_and_stops_at_its_end() -> None:
    streams = Streams()
    size = 10 * MIB
    streams.read(SHARD, 0, MIB, size, 0.0)
    streams.read(SHARD, MIB, size - MIB - 100, size, 0.0)
    assert windows(streams) == [(SHARD, size - 100, 100)]
    streams.read(SHARD, size - 100, 100, size, 0.0)
    assert windows(streams) == []


def test_small_files_and_idle_streams_are_not_streamed() -> None:
    streams = Streams()
    streams.read("s/small.bin", 0, 256 * KIB, MIB, 0.0)
    streams.read("s/small.bin", 256 * KIB, STREAM_CONFIRM_BYTES, MIB, 0.0)
    assert windows(streams) == []
    streams.read("s/big.bin", 0, MIB, HUGE, 0.0)
    streams.read("s/big.bin", MIB, STREAM_CONFIRM_BYTES, HUGE, 0.0)
    assert (len(windows(streams)), streams.live(0.0)) == (1, 1)
    idle = STREAM_IDLE_SECONDS + 1.0
    assert (windows(streams, idle), streams.live(idle)) == ([], 0)


def test_the_most_recently_read_streams_are_kept_and_predicted_first() -> None:
    streams = Streams()
    for number in range(MAX_STREAMS_PER_WORKLOAD + 1):
        streams.read(f"s/{number}.bin", 0, STREAM_CONFIRM_BYTES, HUGE, 0.0)
    paths = [path for path, _, _ in windows(streams)]
    assert paths == [f"s/{number}.bin" for number in range(MAX_STREAMS_PER_WORKLOAD, 0, -1)]


def test_the_model_predicts_a_workloads_streams_before_its_files() -> None:
    model = WorkloadModel()
    model.listed("s", {"s/big.bin": HUGE, "s/small.jpg": SMALL}, 0.0)
    model.opened("s/big.bin", HUGE, 1.0)
    model.read("s/big.bin", 0, STREAM_CONFIRM_BYTES, 1.0)
    first, second = model.predict(2)
    assert (first.path, first.offset, first.distance) == ("s/big.bin", STREAM_CONFIRM_BYTES, 0.0)
    assert (second.path, second.offset, second.workload) == ("s/small.jpg", 0, "s")
    assert model.stats()["active_streams"] == 1

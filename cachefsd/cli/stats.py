"""``cachefsd stats``'s presentation: the daemon's ``StatsAnswer``
(``control/answers.py``) drawn as rich tables."""

from __future__ import annotations

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from cachefsd.config import human_bytes
from cachefsd.control.answers import JobActivity, StatsAnswer, ThisMount, WritesAnswer


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.1f} %"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def _uptime(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def render(stats: StatsAnswer, throughput: RenderableType | None = None) -> RenderableType:
    """The stats as tables: tiers, a writable mount's writes, activity (hit
    ratios, latency, stalls, prefetch, dedup, epochs), and residency by
    prefix. ``throughput`` (``top``'s sparkline lines) goes under the header."""

    header = Text()
    header.append(stats.mountpoint, style="bold")
    header.append(f"  <-  {stats.source}")
    header.append(f"   pid {stats.pid}   up {_uptime(stats.uptime_seconds)}   epoch {stats.epoch.current}")
    parts: list[RenderableType] = [header]
    node = stats.node
    others = [mount for mount in node.mounts if mount.mountpoint != stats.mountpoint]
    if others:
        # One cache for every mount of the daemon: the tables below are the node's.
        parts.append(
            Text(
                f"one daemon, one cache ({node.cache_dir}) for this mount and "
                + ", ".join(f"{mount.mountpoint} <- {mount.source}" for mount in others)
                + ": the tables below are all of them together",
                style="dim",
            )
        )
        parts.append(_this_mount(stats.mount))
    if throughput is not None:
        parts.append(throughput)

    tiers = Table(title="tiers", title_justify="left", expand=False)
    for column in ("tier", "used", "capacity", "used %", "blocks"):
        tiers.add_column(column, justify="left" if column == "tier" else "right")
    for tier in stats.tiers:
        capacity = tier.capacity_bytes
        tiers.add_row(
            tier.name,
            human_bytes(tier.used_bytes),
            human_bytes(capacity),
            _percent(tier.used_bytes / capacity if capacity else None),
            str(tier.blocks),
        )
    parts.append(tiers)
    if stats.writes is not None:
        parts.append(_writes(stats.writes))
    parts.append(_activity(stats))
    if stats.jobs:
        parts.append(_jobs(stats.jobs))

    residency = stats.residency
    resident = Table(title="resident", title_justify="left")
    resident.add_column("prefix")
    for name in residency.tiers:
        resident.add_column(name, justify="right")
    resident.add_column("total", justify="right")
    for entry in residency.prefixes:
        resident.add_row(
            Text(entry.prefix),  # a key, not markup: "[v2]imagenet" is a name
            *(human_bytes(entry.bytes.get(name, 0)) for name in residency.tiers),
            human_bytes(entry.total_bytes),
        )
    if not residency.prefixes:
        resident.add_row("(nothing cached)", *("" for _ in residency.tiers), "")
    parts.append(resident)
    age = residency.age_seconds
    if age is not None:
        note = "bytes of each top-level prefix cached on this node"
        if age >= 1:  # a slow count over a huge cache
            note += f", as of {age:.0f} s ago"
        if residency.error:
            note += f"; the last refresh failed: {residency.error}"
        parts.append(Text(note, style="dim"))
    return Group(*parts)


def _this_mount(mount: ThisMount) -> RenderableType:
    table = Table(title="this mount", title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value")
    read_bytes = mount.reads.bytes
    table.add_row("hit ratio since mount", _percent(mount.hit_ratio))
    table.add_row(
        "read from cache / cold", f"{human_bytes(read_bytes.cache)} / {human_bytes(read_bytes.cold)}"
    )
    table.add_row("read stall", _duration(mount.stall_seconds))
    table.add_row("passthrough", Text(mount.passthrough))
    return table


def _writes(writes: WritesAnswer) -> RenderableType:
    """What this mount wrote and has not uploaded yet, and how its uploads go."""
    table = Table(title="writes", title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value")
    table.add_row("staged", f"{human_bytes(writes.staged_bytes)} in {writes.staged_files} files")
    table.add_row("uploads due", due_summary(writes))
    table.add_row(
        "uploaded",
        f"{human_bytes(writes.uploaded_bytes)} in {writes.uploaded_files} files"
        f" ({writes.failed_attempts} failed attempts)",
    )
    rate = writes.upload_bytes_per_second
    table.add_row(
        f"upload rate last {writes.upload_rate_seconds:.0f} s",
        "-" if rate is None else f"{human_bytes(rate)}/s",
    )
    table.add_row(
        "upload time p50 / p99",
        f"{_duration(writes.upload_p50_seconds)} / {_duration(writes.upload_p99_seconds)}",
    )
    failure = writes.oldest_failure
    if failure is not None:
        # A key and a store's message, not markup.
        table.add_row("failing", Text(f"{failure.key}: {failure.error}", style="red"))
    return table


def due_summary(writes: WritesAnswer) -> str:
    """The uploads due, in one line (``stats`` and ``top``)."""
    if not writes.uploads_due:
        return "none"
    return (
        f"{writes.uploads_due} ({writes.uploads_in_flight} uploading, {writes.uploads_failing} failing),"
        f" oldest due {_duration(writes.oldest_due_seconds)}"
    )


def _jobs(jobs: dict[str, JobActivity]) -> RenderableType:
    """The jobs the metrics name: which one waits, on reads and in its loop."""
    table = Table(title="jobs", title_justify="left")
    for column in ("job", "reads", "hit ratio", "read stall", "batches", "data wait"):
        table.add_column(column, justify="left" if column == "job" else "right")
    for name, job in jobs.items():
        metered = job.batches > 0
        table.add_row(
            Text(name),  # a command's name, not markup
            str(job.reads.cache + job.reads.cold),
            _percent(job.hit_ratio),
            _duration(job.stall_seconds),
            str(job.batches) if metered else "-",
            _percent(job.data_wait_fraction) if metered else "-",
        )
    return Group(
        table,
        Text(
            "batches and data wait from a loader meter (cachefsd.diagnose.watch); why: cachefsd doctor",
            style="dim",
        ),
    )


def _activity(stats: StatsAnswer) -> RenderableType:

    # Said on every screen: after a fully cached epoch the hit ratio can
    # read 0 %, because the kernel served the reads without asking.
    table = Table(
        title="activity",
        title_justify="left",
        show_header=False,
        caption="reads the kernel answers from its page cache never reach the daemon and are not counted",
        caption_justify="left",
    )
    table.add_column("what")
    table.add_column("value")
    hit = stats.hit_ratio
    read_bytes = stats.reads.bytes
    fetch = stats.fetch.demand
    prefetch = stats.prefetch
    dedup = stats.dedup
    epoch = stats.epoch
    table.add_row("hit ratio since mount", _percent(hit.since_mount))
    table.add_row(f"hit ratio last {hit.last_minute_seconds:.0f} s", _percent(hit.last_minute))
    table.add_row(
        "read from cache / cold", f"{human_bytes(read_bytes.cache)} / {human_bytes(read_bytes.cold)}"
    )
    table.add_row(
        "served by",
        ", ".join(f"{name} {human_bytes(count)}" for name, count in stats.reads.served_bytes.items() if count)
        or "-",
    )
    table.add_row(
        "fetch latency p50 / p99",
        f"{_duration(fetch.p50_seconds)} / {_duration(fetch.p99_seconds)}"
        f" ({fetch.count} demand GETs, {fetch.errors} failed)",
    )
    table.add_row("read stall", _duration(stats.stall_seconds))
    table.add_row(
        "prefetch",
        f"issued {human_bytes(prefetch.issued_bytes)}, "
        f"used {human_bytes(prefetch.used_bytes)} ({_percent(prefetch.accuracy)}), "
        f"wasted {human_bytes(prefetch.wasted_bytes)}",
    )
    table.add_row(
        "dedup saved",
        f"disk {human_bytes(dedup.disk_saved_bytes)}, wire {human_bytes(dedup.wire_saved_bytes)}",
    )
    each = ", ".join(f"{name or '/'}: {number}" for name, number in epoch.workloads.items())
    table.add_row("epoch", Text(f"{epoch.current}" + (f" ({each})" if each else "")))
    return table


def print_stats(stats: StatsAnswer) -> None:
    """``cachefsd stats`` without ``--json``."""

    Console().print(render(stats))

"""``cachefsd stats``'s presentation: the daemon's stats (stats.py) drawn
as rich tables."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from cachefsd.config import human_bytes


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


def render(stats: dict[str, Any], throughput: RenderableType | None = None) -> RenderableType:
    """The stats JSON as tables: tiers, activity (hit ratios, latency,
    stalls, prefetch, dedup, epochs), and residency by prefix.
    ``throughput`` (``top``'s sparkline line) goes under the header."""

    epoch = stats.get("epoch", {})
    header = Text()
    header.append(str(stats.get("mountpoint", "?")), style="bold")
    header.append(f"  <-  {stats.get('source', '?')}")
    header.append(
        f"   pid {stats.get('pid', '?')}   up {_uptime(stats.get('uptime_seconds', 0.0))}"
        f"   epoch {epoch.get('current', 0)}"
    )
    parts: list[RenderableType] = [header]
    node = stats.get("node", {})
    others = [mount for mount in node.get("mounts", []) if mount["mountpoint"] != stats.get("mountpoint")]
    if others:
        # One cache for every mount of the daemon: the tables below are the node's.
        parts.append(
            Text(
                f"one daemon, one cache ({node.get('cache_dir', '?')}) for this mount and "
                + ", ".join(f"{mount['mountpoint']} <- {mount['source']}" for mount in others)
                + ": the tables below are all of them together",
                style="dim",
            )
        )
        parts.append(_this_mount(stats.get("mount", {})))
    if throughput is not None:
        parts.append(throughput)

    tiers = Table(title="tiers", title_justify="left", expand=False)
    for column in ("tier", "used", "capacity", "used %", "blocks"):
        tiers.add_column(column, justify="left" if column == "tier" else "right")
    for tier in stats.get("tiers", []):
        capacity = tier["capacity_bytes"]
        tiers.add_row(
            tier["name"],
            human_bytes(tier["used_bytes"]),
            human_bytes(capacity),
            _percent(tier["used_bytes"] / capacity if capacity else None),
            str(tier["blocks"]),
        )
    parts.append(tiers)
    parts.append(_activity(stats))
    if stats.get("jobs"):
        parts.append(_jobs(stats["jobs"]))

    residency = stats.get("residency", {})
    tier_names = list(residency.get("tiers", []))
    resident = Table(title="resident", title_justify="left")
    resident.add_column("prefix")
    for name in tier_names:
        resident.add_column(name, justify="right")
    resident.add_column("total", justify="right")
    for entry in residency.get("prefixes", []):
        by_tier = entry["bytes"]
        resident.add_row(
            Text(entry["prefix"]),  # a key, not markup: "[v2]imagenet" is a name
            *(human_bytes(by_tier.get(name, 0)) for name in tier_names),
            human_bytes(entry["total_bytes"]),
        )
    if not residency.get("prefixes"):
        resident.add_row("(nothing cached)", *("" for _ in tier_names), "")
    parts.append(resident)
    age = residency.get("age_seconds")
    if age is not None:
        note = "bytes of each top-level prefix cached on this node"
        if age >= 1:  # a slow count over a huge cache
            note += f", as of {age:.0f} s ago"
        if residency.get("error"):
            note += f"; the last refresh failed: {residency['error']}"
        parts.append(Text(note, style="dim"))
    return Group(*parts)


def _this_mount(mount: dict[str, Any]) -> RenderableType:
    table = Table(title="this mount", title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value")
    read_bytes = mount.get("reads", {}).get("bytes", {})
    table.add_row("hit ratio since mount", _percent(mount.get("hit_ratio")))
    table.add_row(
        "read from cache / cold",
        f"{human_bytes(read_bytes.get('cache', 0))} / {human_bytes(read_bytes.get('cold', 0))}",
    )
    table.add_row("read stall", _duration(mount.get("stall_seconds", 0.0)))
    return table


def _jobs(jobs: dict[str, Any]) -> RenderableType:
    """The jobs the metrics name: which one waits, on reads and in its loop."""
    table = Table(title="jobs", title_justify="left")
    for column in ("job", "reads", "hit ratio", "read stall", "batches", "data wait"):
        table.add_column(column, justify="left" if column == "job" else "right")
    for name, job in jobs.items():
        metered = job["batches"] > 0
        table.add_row(
            Text(name),  # a command's name, not markup
            str(job["reads"]["cache"] + job["reads"]["cold"]),
            _percent(job["hit_ratio"]),
            _duration(job["stall_seconds"]),
            str(job["batches"]) if metered else "-",
            _percent(job["data_wait_fraction"]) if metered else "-",
        )
    return Group(
        table,
        Text(
            "batches and data wait from a loader meter (cachefsd.diagnose.watch); why: cachefsd doctor",
            style="dim",
        ),
    )


def _activity(stats: dict[str, Any]) -> RenderableType:

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
    hit = stats.get("hit_ratio", {})
    reads = stats.get("reads", {})
    read_bytes = reads.get("bytes", {})
    fetch = stats.get("fetch", {}).get("demand", {})
    prefetch = stats.get("prefetch", {})
    dedup = stats.get("dedup", {})
    epoch = stats.get("epoch", {})
    window = hit.get("last_minute_seconds", 0.0)
    table.add_row("hit ratio since mount", _percent(hit.get("since_mount")))
    table.add_row(f"hit ratio last {window:.0f} s", _percent(hit.get("last_minute")))
    table.add_row(
        "read from cache / cold",
        f"{human_bytes(read_bytes.get('cache', 0))} / {human_bytes(read_bytes.get('cold', 0))}",
    )
    served = reads.get("served_bytes", {})
    table.add_row(
        "served by",
        ", ".join(f"{name} {human_bytes(count)}" for name, count in served.items() if count) or "-",
    )
    table.add_row(
        "fetch latency p50 / p99",
        f"{_duration(fetch.get('p50_seconds'))} / {_duration(fetch.get('p99_seconds'))}"
        f" ({fetch.get('count', 0)} demand GETs, {fetch.get('errors', 0)} failed)",
    )
    table.add_row("read stall", _duration(stats.get("stall_seconds", 0.0)))
    table.add_row(
        "prefetch",
        f"issued {human_bytes(prefetch.get('issued_bytes', 0))}, "
        f"used {human_bytes(prefetch.get('used_bytes', 0))} ({_percent(prefetch.get('accuracy'))}), "
        f"wasted {human_bytes(prefetch.get('wasted_bytes', 0))}",
    )
    table.add_row(
        "dedup saved",
        f"disk {human_bytes(dedup.get('disk_saved_bytes', 0))}, "
        f"wire {human_bytes(dedup.get('wire_saved_bytes', 0))}",
    )
    jobs = epoch.get("jobs", {})
    per_job = ", ".join(f"{root or '/'}: {number}" for root, number in jobs.items())
    table.add_row("epoch", Text(f"{epoch.get('current', 0)}" + (f" ({per_job})" if per_job else "")))
    return table


def print_stats(stats: dict[str, Any]) -> None:
    """``cachefsd stats`` without ``--json``."""

    Console().print(render(stats))

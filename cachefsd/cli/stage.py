"""``cachefsd stage``, the command's side: where a stage runs (through a
mount's daemon, offline in this process, or into the shared tier alone),
its progress view (a rich bar on a terminal, a line every few seconds
otherwise), the summary, and the exit code. The staging itself is
``cachefsd.stage``'s, the same in the daemon and here."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from cachefsd.config import Settings, human_bytes
from cachefsd.control.client import ControlClient, client_for
from cachefsd.control.mounts import MountOf, daemon_using, find_mount, foreign_mount, not_a_mount
from cachefsd.errors import CachefsdError
from cachefsd.fleet import stage_fleet
from cachefsd.stage import MAX_LISTED_FAILURES, Report, StageRequest, stage_files

# Without a terminal: one line this often, or whenever another
# PLAIN_STEP_PERCENT of the bytes is done, whichever comes first.
PLAIN_INTERVAL_SECONDS = 5.0


PLAIN_STEP_PERCENT = 10


@dataclass(frozen=True, slots=True)
class Target:
    """Where ``cachefsd stage TARGET`` runs: through ``mount``'s daemon, or
    in this process on ``source``."""

    mount: MountOf | None = None
    source: str | None = None


def resolve_target(target: str) -> Target:
    """A bucket URI is a source; a path under a live mount goes through its
    daemon; a mount whose daemon is gone is an error naming the source to
    stage offline; any other existing directory is a local source."""
    if "://" in target:
        return Target(source=target)
    mount = find_mount(target)
    if mount is not None:
        if not mount.live:
            raise CachefsdError(
                f"{mount.mountpoint} has no running daemon; stage its source into its cache instead: "
                f"cachefsd stage {mount.state.source} --cache-dir {mount.state.cache_dir}"
            )
        return Target(mount=mount)
    foreign = foreign_mount(target)
    if foreign is not None:  # not a local directory to copy through the mount
        raise not_a_mount(target, foreign)
    if not os.path.isdir(target):
        raise CachefsdError(f"{target}: not a bucket URI, a cachefsd mount or a local directory")
    return Target(source=os.path.abspath(target))


def stage_offline(settings: Settings, request: StageRequest, report: Report) -> dict[str, Any]:
    """Stage into ``settings.cache`` from ``settings.source`` in this process."""
    holder = daemon_using(settings.cache.dir)
    if holder is not None:
        raise CachefsdError(
            f"cache directory {settings.cache.dir} is in use by the daemon of {holder.mountpoint} "
            f"(pid {holder.pid}); stage through the mount: cachefsd stage {holder.mountpoint}"
        )
    from cachefsd import engine  # noqa: PLC0415 - the data path: only when staging offline
    from cachefsd.cache.directory import require_cache  # noqa: PLC0415

    if request.check:
        require_cache(settings.cache.dir)
    with engine.open_engine(settings, keep_recorded_layout=True) as parts:
        tiers = [tier.name for tier in parts.cache.tiers]
        return stage_files(parts.namespace, parts.reader, parts.view, tiers, request, report)


def stage_through(mount: MountOf, request: StageRequest, report: Report) -> dict[str, Any]:
    """Stage through the daemon of ``mount``, relaying its events to ``report``."""
    client: ControlClient = client_for(mount)
    for event in client.stage(request):
        if event.get("event") == "summary":
            return {key: value for key, value in event.items() if key != "event"}
        report(event)
    raise CachefsdError("the daemon ended the stage without a summary")  # client.stage raises first


def _percent(part: int, whole: int) -> float:
    return 100.0 if whole == 0 else 100.0 * part / whole


class ProgressView:
    """Shows stage events: a rich progress bar on a terminal, plain lines
    every few seconds otherwise (logs of batch jobs). Keeps the failures for
    the final listing."""

    def __init__(self, stream: IO[str] = sys.stderr, interactive: bool | None = None) -> None:
        self._stream = stream
        self._interactive = stream.isatty() if interactive is None else interactive
        self.failures: list[tuple[str, str]] = []
        self.failed = 0
        self._last_line = 0.0
        self._last_step = -1
        self._phase = ""
        self._progress: Any = None
        self._task: Any = None

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "failure":
            self.failed += 1
            if len(self.failures) < MAX_LISTED_FAILURES:
                self.failures.append((str(event.get("path")), str(event.get("error"))))
        elif kind == "progress":
            if self._interactive:
                self._show_bar(event)
            else:
                self._show_line(event)

    def _show_bar(self, event: dict[str, Any]) -> None:
        if self._progress is None:
            from rich.console import Console  # noqa: PLC0415 - only on a terminal
            from rich.progress import (  # noqa: PLC0415
                BarColumn,
                DownloadColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[files]}"),
                DownloadColumn(binary_units=True),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(file=self._stream),
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("listing", total=None, files="")
        phase = event["phase"]
        files = f"{event['files_done']}/{event['files_total']} files"
        if phase == "select":
            self._progress.update(self._task, description="listing", files=f"{event['files_total']} files")
            return
        self._progress.update(
            self._task,
            description="checking" if phase == "check" else "staging",
            total=max(event["bytes_total"], 1),
            completed=event["bytes_done"] if event["bytes_total"] else 1,
            files=files,
        )

    def _show_line(self, event: dict[str, Any]) -> None:
        now = time.monotonic()
        phase = event["phase"]
        step = int(_percent(event["bytes_done"], event["bytes_total"]) // PLAIN_STEP_PERCENT)
        new_phase = phase != self._phase
        if not new_phase and now - self._last_line < PLAIN_INTERVAL_SECONDS and step == self._last_step:
            return
        self._phase, self._last_line, self._last_step = phase, now, step
        if phase == "select":
            line = f"listing: {event['files_total']} files, {human_bytes(event['bytes_total'])} selected"
        else:
            seconds = max(event["seconds"], 1e-9)
            rate = event["bytes_fetched"] / seconds
            line = (
                f"{'checking' if phase == 'check' else 'staging'}: "
                f"{_percent(event['bytes_done'], event['bytes_total']):.0f}% "
                f"{event['files_done']}/{event['files_total']} files, "
                f"{human_bytes(event['bytes_done'])} of {human_bytes(event['bytes_total'])}"
            )
            if phase == "fetch":
                line += f", {human_bytes(rate)}/s"
                left = event["bytes_total"] - event["bytes_done"]
                if rate > 0 and left > 0:
                    line += f", ETA {left / rate:.0f}s"
        print(line, file=self._stream, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary as the command prints it."""
    total = summary["bytes"]
    if summary["check"]:
        resident = summary["resident"]
        parts = [
            f"{tier} {human_bytes(resident.get(tier, 0))} ({_percent(resident.get(tier, 0), total):.1f}%)"
            for tier in summary["tiers"]
        ]
        missing = summary["missing_bytes"]
        parts.append(f"not cached {human_bytes(missing)} ({_percent(missing, total):.1f}%)")
        return [
            f"resident: {_percent(total - missing, total):.1f}% of {summary['files']} files "
            f"({human_bytes(total)}): " + ", ".join(parts)
        ]
    seconds = summary["seconds"]
    rate = summary["fetched_bytes"] / seconds if seconds > 0 else 0.0
    staged = summary["files"] - summary["failed_files"]
    lines = [
        f"staged {staged} of {summary['files']} files ({human_bytes(total)}): "
        f"fetched {human_bytes(summary['fetched_bytes'])}, "
        f"already cached {human_bytes(summary['cached_bytes'])}, "
        f"{summary['failed']} failed, in {seconds:.1f}s ({human_bytes(rate)}/s)"
    ]
    unkept = summary.get("unkept_bytes", 0)
    if unkept:
        lines.append(
            f"not staged: {human_bytes(unkept)} ({_percent(unkept, total):.1f}%) of the selection, "
            "the cache is full (a larger cache, or a narrower --include)"
        )
    return lines


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on (newline,
    escape sequences) or cannot encode (a surrogate from a name that is not
    UTF-8) written as its Python escape: object names are anyone's bytes,
    and a failure line must stay one line that says what it is."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def run_command(
    target: Target,
    request: StageRequest,
    settings: Callable[[str], Settings],
    as_json: bool,
    interactive: bool | None = None,
    fleet: bool = False,
) -> int:
    """``cachefsd stage``: run, show progress, print the summary and every
    failure (one line each); 1 if anything failed, did not fit in the
    cache, or nothing was selected. ``settings(source)`` builds the
    settings for an offline stage; ``fleet`` stages a source into the
    shared tier alone (``fleet.py``)."""
    if fleet and target.mount is not None:
        raise CachefsdError(
            f"--shared-tier stages a source for the whole fleet, not a mount: a stage through "
            f"{target.mount.mountpoint} reads from the shared tier its daemon was mounted with"
        )
    view = ProgressView(interactive=False if as_json else interactive)
    try:
        if target.mount is not None:
            summary = stage_through(target.mount, request, view)
        else:
            assert target.source is not None
            run = stage_fleet if fleet else stage_offline
            summary = run(settings(target.source), request, view)
    finally:
        view.close()
    nothing_selected = not summary["files"] and not summary["failed"]
    if as_json:
        print(json.dumps(summary))
    elif not nothing_selected:
        for line in summary_lines(summary):
            print(line)
    if nothing_selected:
        # Most likely a mistyped --include or path: a job staged on it would
        # start cold, so this is a failure, not "100 % of 0 files".
        matching = f" matching --include {request.include!r}" if request.include else ""
        print(f"cachefsd: nothing selected: no file under {request.path}{matching}", file=sys.stderr)
        return 1
    for path, error in view.failures:
        print(f"failed: {printable(path)}: {printable(error)}", file=sys.stderr)
    if view.failed > len(view.failures):
        print(f"failed: ... and {view.failed - len(view.failures)} more", file=sys.stderr)
    return 1 if summary["failed"] or summary.get("unkept_bytes") else 0

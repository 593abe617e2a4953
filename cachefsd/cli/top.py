"""``cachefsd top MOUNTPOINT``: ``cachefsd stats``, live.

Polls the daemon's ``GET /stats`` every refresh interval, redraws the same
tables as ``cachefsd stats`` (``stats.render``) on the terminal's
alternate screen, and adds a throughput sparkline: the bytes the daemon
served in each interval of the last ``HISTORY_SECONDS``. Only the daemon
sees those bytes; re-reads the kernel's page cache answers never reach it.
A writable mount gets a second: the bytes it uploaded, beside what is
staged and the uploads due.
Without a terminal (a pipe, a log) each refresh is appended instead.

Quits on ``q`` (or Ctrl-C). Keys are read from stdin in cbreak mode when it
is a terminal (one key at a time, no echo; Ctrl-C still raises SIGINT),
and the terminal's modes are restored in ``finally`` whatever happens.
"""

from __future__ import annotations

import os
import select
import sys
import termios
import time
import tty
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import IO, Any

from cachefsd.cli.stats import due_summary, render
from cachefsd.config import human_bytes
from cachefsd.control.answers import WritesAnswer
from cachefsd.control.client import ControlClient

# A redraw a second: fast enough to watch an epoch's hit ratio move, and a
# stats call costs the daemon one registry collect (about a millisecond).
REFRESH_SECONDS = 1.0
# The sparkline spans about the last minute, the same span as the
# "last minute" hit ratio next to it.
HISTORY_SECONDS = 60.0
# Columns of the sparkline at most: shorter intervals are merged into this
# many columns, so it fits an 80-column terminal beside its label.
SPARKLINE_WIDTH = 60
SPARK_CHARS = "▁▂▃▄▅▆▇█"
# q quits; so does Ctrl-C's byte, should a terminal deliver it as a key.
QUIT_KEYS = frozenset(b"qQ\x03")
# The sparklines' labels are padded to one width, so that their lines align.
LABEL_WIDTH = 10


def sparkline(values: Sequence[float], width: int = SPARKLINE_WIDTH) -> str:
    """One character per value, from ▁ (zero) to █ (the largest), oldest
    first; with more values than ``width``, consecutive values are summed
    into ``width`` columns. Negative values (a restarted daemon's counters)
    count as zero."""
    if not values or width <= 0:
        return ""
    points = [max(0.0, float(value)) for value in values]
    if len(points) > width:
        step = len(points) / width
        points = [sum(points[int(i * step) : int((i + 1) * step)]) for i in range(width)]
    top = max(points)
    if top <= 0:
        return SPARK_CHARS[0] * len(points)
    last = len(SPARK_CHARS) - 1
    return "".join(SPARK_CHARS[min(last, round(point / top * last))] for point in points)


class Throughput:
    """Bytes per refresh, from successive totals of a byte counter of the
    stats (read bytes: ``served``; upload bytes: ``uploaded``); the last
    ``HISTORY_SECONDS`` of them."""

    def __init__(self, interval: float, label: str) -> None:
        self.label = label
        self.history: deque[float] = deque(maxlen=max(1, round(HISTORY_SECONDS / interval)))
        self._last: tuple[float, float] | None = None  # (monotonic time, total bytes)
        self.rate = 0.0  # bytes per second over the last interval

    def add(self, at: float, total_bytes: float) -> None:
        if self._last is not None:
            then, before = self._last
            delta = max(0.0, total_bytes - before)
            self.history.append(delta)
            self.rate = delta / (at - then) if at > then else 0.0
        self._last = (at, total_bytes)

    def line(self) -> Any:
        from rich.text import Text  # noqa: PLC0415

        text = Text(f"{self.label:<{LABEL_WIDTH}}")
        if not self.history:
            text.append("(measuring)", style="dim")
            return text
        text.append(sparkline(list(self.history)), style="cyan")
        text.append(f"  {human_bytes(self.rate)}/s")
        return text


def writes_line(uploaded: Throughput, writes: WritesAnswer) -> Any:
    """The upload sparkline, then what is staged and the uploads due."""
    text = uploaded.line()
    text.append(f"  staged {human_bytes(writes.staged_bytes)}, due {due_summary(writes)}")
    return text


class Keys:
    """Keys typed on ``stream`` while ``top`` runs: cbreak mode on a
    terminal, restored on exit. A stream that is not a terminal (a pipe)
    is still watched for ``q`` until it ends."""

    def __init__(self, stream: IO[str]) -> None:
        self._fd: int | None = None
        self._saved: list[Any] | None = None
        try:
            self._fd = stream.fileno()
        except (OSError, ValueError, AttributeError):  # no descriptor (a test's StringIO)
            self._fd = None

    def __enter__(self) -> Keys:
        if self._fd is not None and os.isatty(self._fd):
            self._saved = termios.tcgetattr(self._fd)
            tty.setcbreak(self._fd)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._saved is not None and self._fd is not None:
            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)
            self._saved = None

    def quit_within(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for a quit key; True if one came."""
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            if self._fd is None:
                time.sleep(remaining)
                return False
            readable, _, _ = select.select([self._fd], [], [], remaining)
            if not readable:
                return False
            data = os.read(self._fd, 64)
            if not data:  # end of input: nothing more to watch
                self._fd = None
            elif any(byte in QUIT_KEYS for byte in data):
                return True
        return False


def run(client: ControlClient, interval: float = REFRESH_SECONDS, console: Any = None) -> int:
    """Show the daemon's stats until ``q`` or Ctrl-C; 0 then. A daemon
    that stops answering ends it with its ``ControlError``, after the
    screen is restored."""
    from rich.console import Console, Group  # noqa: PLC0415 - only when drawing

    console = console or Console()
    served = Throughput(interval, "served")
    uploaded = Throughput(interval, "uploaded")
    try:
        with Keys(sys.stdin) as keys, _screen(console) as show:
            while True:
                stats = client.stats()
                now = time.monotonic()
                served.add(now, stats.reads.bytes.total)
                lines = [served.line()]
                if stats.writes is not None:
                    uploaded.add(now, stats.writes.uploaded_bytes)
                    lines.append(writes_line(uploaded, stats.writes))
                show(render(stats, Group(*lines)))
                if keys.quit_within(interval):
                    return 0
    except KeyboardInterrupt:
        return 0


@contextmanager
def _screen(console: Any) -> Iterator[Callable[[Any], None]]:
    """How each refresh is shown: redrawn in place on a terminal's alternate
    screen; appended, one timestamped snapshot after another, to a pipe or a
    log (``kubectl exec`` without ``-t``, ``| tee``), as ``top -b`` does,
    where a live display would show nothing at all."""
    if not console.is_terminal:

        def append(tables: Any) -> None:
            console.print(time.strftime("%Y-%m-%dT%H:%M:%S%z"))
            console.print(tables)
            console.file.flush()

        yield append
        return
    from rich.live import Live  # noqa: PLC0415

    with Live(console=console, screen=True, auto_refresh=False, redirect_stderr=False) as live:
        yield lambda tables: live.update(tables, refresh=True)

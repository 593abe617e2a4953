"""The ``cachefsd`` command. Thin: parse, call, report one line on failure."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from cachefsd import __version__
from cachefsd.cli.logs import _configure_logging
from cachefsd.cli.supervise import _mount_background, _mount_foreground, unmount
from cachefsd.config import load_mounts, load_settings
from cachefsd.control.mounts import mount_types
from cachefsd.errors import CachefsdError

log = logging.getLogger("cachefsd")

# A refresh interval longer than a day is a typo (and past select()'s range).
MAX_INTERVAL_SECONDS = 86400.0
# Offline-stage flags that a stage through a daemon cannot honour.
_STAGE_CACHE_FLAGS = (
    "config",
    "cache_dir",
    "cache_size",
    "block_size",
    "hot",
    "hot_size",
    "warm",
    "warm_size",
    "endpoint_url",
    "region",
    "fetch_deadline",
    "shared_endpoint_url",
)


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (argparse names the flag on error)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_INTERVAL_SECONDS):
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds above 0 and at most {MAX_INTERVAL_SECONDS:g}, not {text!r}"
        )
    return value


def _count(text: str) -> int:
    """A whole number of at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, not {text!r}")
    return int(text)


def _put(flags: dict[str, Any], section: str, key: str, value: Any) -> None:
    if value is not None:
        flags.setdefault(section, {})[key] = value


def _data_path_flags(args: argparse.Namespace, source: str | None, mountpoint: Any) -> dict[str, Any]:
    """The cache and store flags shared by ``mount`` and an offline ``stage``
    (``source`` and ``mountpoint`` left out when None: a config file's
    ``[[mounts]]`` name them)."""
    named = {"source": source, "mountpoint": mountpoint}
    flags: dict[str, Any] = {key: value for key, value in named.items() if value is not None}
    _put(flags, "cache", "dir", args.cache_dir)
    _put(flags, "cache", "size", args.cache_size)
    _put(flags, "cache", "block_size", args.block_size)
    for tier in ("hot", "warm"):
        tier_dir, tier_size = getattr(args, tier), getattr(args, f"{tier}_size")
        if tier_dir is not None or tier_size is not None:
            tier_flags = {"dir": tier_dir, "size": tier_size}
            flags.setdefault("cache", {})[tier] = {k: v for k, v in tier_flags.items() if v is not None}
    if args.shared_tier is not None:
        shared = {"url": args.shared_tier, "endpoint_url": args.shared_endpoint_url}
        flags.setdefault("cache", {})["shared"] = {k: v for k, v in shared.items() if v is not None}
    _put(flags, "store", "endpoint_url", args.endpoint_url)
    _put(flags, "store", "region", args.region)
    _put(flags, "fetch", "deadline", args.fetch_deadline)
    return flags


def _mount_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The settings tree given on the command line (flags left out are absent)."""
    flags = _data_path_flags(args, args.source, args.mountpoint)

    def put(section: str, key: str, value: Any) -> None:
        _put(flags, section, key, value)

    put("namespace", "metadata_ttl", args.metadata_ttl)
    put("metrics", "addr", args.metrics_addr)
    if args.no_metrics:
        put("metrics", "enabled", False)
    if args.no_prefetch:
        put("prefetch", "enabled", False)
    if args.writable:
        flags["writable"] = True
    for option in args.options:
        for name in option.split(","):
            if name == "allow_other":
                put("fuse", "allow_other", True)
            elif name == "nopassthrough":
                put("fuse", "passthrough", False)
            elif name not in ("ro", ""):
                raise CachefsdError(
                    f"-o {name}: unsupported mount option (supported: allow_other, nopassthrough)"
                )
    if args.log_level is not None:
        flags["log_level"] = args.log_level
    return flags


def _cmd_mount(args: argparse.Namespace, argv: list[str]) -> int:
    flags = _mount_flags(args)
    if args.source is None and args.mountpoint is None:
        mounts = load_mounts(args.config, flags)
    elif args.mountpoint is None:
        raise CachefsdError(
            "mount: give SOURCE and MOUNTPOINT (or neither, with a --config listing [[mounts]])"
        )
    else:
        mounts = [load_settings(args.config, flags)]
    if args.foreground:
        return _mount_foreground(mounts, args.ready_fd)
    return _mount_background(argv, mounts)


def _cmd_unmount(args: argparse.Namespace, argv: list[str]) -> int:
    if (args.mountpoint is None) == (args.config is None):
        raise CachefsdError("unmount: give MOUNTPOINT, or --config FILE for each of its [[mounts]]")
    if args.mountpoint is not None:
        unmount(args.mountpoint)
        print(f"cachefsd: unmounted {args.mountpoint.resolve()}")
        return 0
    # Each of the file's mounts that is mounted (a supervisor's clean-up,
    # before a start and after a stop: a crashed daemon's are detached).
    mounted = set(mount_types())
    for settings in reversed(load_mounts(args.config, {})):
        mountpoint = settings.mountpoint
        if str(mountpoint) in mounted:
            unmount(mountpoint)
            print(f"cachefsd: unmounted {mountpoint}")
    return 0


def _cmd_verify(args: argparse.Namespace, argv: list[str]) -> int:
    from cachefsd.cache import directory  # noqa: PLC0415 - keep `cachefsd --help` light

    report = directory.verify(_cache_dir(args), args.repair)
    bad = report.corrupt + report.missing
    print(f"checked {report.checked} blocks: {len(report.corrupt)} corrupt, {len(report.missing)} missing")
    if report.orphans:
        what = "removed" if args.repair else "left (verify --repair, gc and the next mount remove them)"
        print(f"{report.orphans} files that are no cached block: {what}")
    for digest in report.corrupt:
        print(f"corrupt {digest}")
    for digest in report.missing:
        print(f"missing {digest}")
    if bad and args.repair:
        dropped = len(bad) - len(report.unrepaired)
        print(f"repaired: dropped {dropped} blocks; they are fetched again on their next read")
        if report.unrepaired:
            print(
                f"not repaired: {len(report.unrepaired)} blocks could not be dropped from the index "
                "(is its disk full?); free some space and run verify --repair again"
            )
            return 1
        return 0
    return 1 if bad else 0


def _cmd_gc(args: argparse.Namespace, argv: list[str]) -> int:
    from cachefsd.cache import directory  # noqa: PLC0415 - keep `cachefsd --help` light

    for tier in directory.gc(_cache_dir(args)):
        used = f"{tier.used_bytes} of {tier.capacity} bytes"
        print(f"{tier.name}: {tier.block_count} blocks, {used} ({tier.root})")
    return 0


def _cache_dir(args: argparse.Namespace) -> Path:
    """The flag, else the config's: either made absolute as the settings make it."""
    flags: dict[str, Any] = {"source": ".", "mountpoint": "."}
    if args.cache_dir is not None:
        flags["cache"] = {"dir": args.cache_dir}
    return load_settings(args.config, flags).cache.dir


def _stage_flags(args: argparse.Namespace, source: str) -> dict[str, Any]:
    """The settings of an offline stage: the mount's cache and store flags
    (a mountpoint is required by the settings tree but unused here)."""
    return _data_path_flags(args, source, ".")


def _cmd_stage(args: argparse.Namespace, argv: list[str]) -> int:
    from cachefsd.cli.stage import resolve_target, run_command  # noqa: PLC0415 - keep `cachefsd --help` light
    from cachefsd.stage import StageRequest  # noqa: PLC0415

    # Progress is drawn on stderr; library chatter (cache reconcile at info)
    # would break the bar, so only warnings show unless asked for.
    _configure_logging(args.log_level or "warning")
    target = resolve_target(args.target)
    if target.mount is not None:
        ignored = [name for name in _STAGE_CACHE_FLAGS if getattr(args, name) is not None]
        if ignored:
            print(
                f"cachefsd: note: staging through the daemon of {target.mount.mountpoint}; "
                f"its own settings apply (ignored: {', '.join('--' + n.replace('_', '-') for n in ignored)})",
                file=sys.stderr,
            )
    request = StageRequest(
        path="/" if target.mount is None else target.mount.relative,
        include=args.include,
        tier=args.tier,
        check=args.check,
    )
    return run_command(
        target,
        request,
        lambda source: load_settings(args.config, _stage_flags(args, source)),
        args.json,
        fleet=args.shared_tier is not None,
    )


def _cmd_hint(args: argparse.Namespace, argv: list[str]) -> int:
    from cachefsd import hints  # noqa: PLC0415 - keep `cachefsd --help` light
    from cachefsd.control.client import client_for  # noqa: PLC0415
    from cachefsd.control.mounts import find_mount, not_a_mount  # noqa: PLC0415

    mount = find_mount(args.mountpoint)
    if mount is None:
        raise not_a_mount(args.mountpoint)
    try:
        text = args.order.read_bytes()
    except OSError as exc:
        raise CachefsdError(f"cannot read {args.order}: {exc.strerror}") from exc
    paths = hints.MountPaths(mount)  # as the Python helper places them
    order = []
    # One path a line, exactly: a name may hold spaces (kept) or any other
    # character but a newline; a CRLF file's \r is dropped; bytes that are
    # not UTF-8 name the file as the filesystem does (os.fsdecode).
    for line in text.split(b"\n"):
        path = os.fsdecode(line.removesuffix(b"\r"))
        if not path.strip():  # a blank line; a name is kept as written
            continue
        placed, relative = paths.place(path)
        if placed is None or placed.mountpoint != mount.mountpoint:
            raise CachefsdError(f"{args.order}: {path} is not under {mount.mountpoint}")
        order.append(relative)
    accepted, unknown = client_for(mount).hint(order)
    print(f"hinted {len(order)} paths to {mount.mountpoint}: {accepted} accepted, {unknown} unknown")
    return 0


def _daemon_of(mountpoint: Path) -> Any:
    """A control client for the daemon serving ``mountpoint`` (or a path in it)."""
    from cachefsd.control.client import client_for  # noqa: PLC0415 - keep `cachefsd --help` light
    from cachefsd.control.mounts import find_mount, not_a_mount  # noqa: PLC0415

    mount = find_mount(mountpoint)
    if mount is None:
        raise not_a_mount(mountpoint)
    return client_for(mount)


def _cmd_stats(args: argparse.Namespace, argv: list[str]) -> int:
    snapshot = _daemon_of(args.mountpoint).stats()
    if args.json:
        print(json.dumps(snapshot.model_dump(mode="json"), indent=2))
        return 0
    from cachefsd.cli import stats  # noqa: PLC0415 - rich only when drawing

    stats.print_stats(snapshot)
    return 0


def _cmd_sync(args: argparse.Namespace, argv: list[str]) -> int:
    answer = _daemon_of(args.mountpoint).sync(args.timeout)
    failed: dict[str, str] = answer["failed"]
    for key, why in sorted(failed.items()):
        print(f"cachefsd sync: not in the bucket: {key}: {why}", file=sys.stderr)
    if failed:
        print(f"cachefsd sync: {len(failed)} files are not in the bucket (they stay staged)", file=sys.stderr)
        return 1
    print(f"{answer['uploaded']} files uploaded; everything closed on {args.mountpoint} is in the bucket")
    return 0


def _cmd_top(args: argparse.Namespace, argv: list[str]) -> int:
    from cachefsd.cli import top  # noqa: PLC0415 - rich only when drawing

    interval = top.REFRESH_SECONDS if args.interval is None else args.interval
    return top.run(_daemon_of(args.mountpoint), interval)


def _cmd_doctor(args: argparse.Namespace, argv: list[str]) -> int:
    from cachefsd.cli import doctor  # noqa: PLC0415 - the what-if replay loads the policies

    return doctor.run(_daemon_of(args.mountpoint).diagnose(), args.json)


def _cmd_bench(args: argparse.Namespace, argv: list[str]) -> int:
    from cachefsd.cli import bench  # noqa: PLC0415 - multiprocessing and rich only when measuring

    return bench.run(
        args.target,
        args.workers,
        args.epochs,
        args.seed,
        args.shards,
        args.local,
        args.cache_dir,
        args.cache_size,
        args.json,
    )


def _add_observe_parsers(commands: Any) -> None:
    stats_cmd = commands.add_parser(
        "stats",
        help="tiers, hit ratios, fetch latency, prefetch, epochs, residency and uploads of a mount",
    )
    stats_cmd.add_argument("mountpoint", type=Path)
    stats_cmd.add_argument("--json", action="store_true", help="print what the daemon's GET /stats returns")
    stats_cmd.set_defaults(handler=_cmd_stats)
    top_cmd = commands.add_parser("top", help="cachefsd stats, live (q or Ctrl-C quits)")
    top_cmd.add_argument("mountpoint", type=Path)
    top_cmd.add_argument("--interval", type=_seconds, help="seconds between refreshes (default 1)")
    top_cmd.set_defaults(handler=_cmd_top)
    doctor_cmd = commands.add_parser(
        "doctor",
        help="per job: does it wait for data, is it the storage or the preprocessing, what to change",
    )
    doctor_cmd.add_argument("mountpoint", type=Path)
    doctor_cmd.add_argument("--json", action="store_true", help="the report as JSON")
    doctor_cmd.set_defaults(handler=_cmd_doctor)
    bench_cmd = commands.add_parser(
        "bench", help="read a mount (or a source, mounted for it) the way training does, epoch by epoch"
    )
    bench_cmd.add_argument("target", help="a cachefsd mount (or a directory in one), or a SOURCE to mount")
    bench_cmd.add_argument("--workers", type=_count, default=4, help="reader processes (default 4)")
    bench_cmd.add_argument("--epochs", type=_count, default=3, help="passes over the files (default 3)")
    bench_cmd.add_argument("--seed", type=int, default=0, help="seed of the shuffles (default 0)")
    bench_cmd.add_argument(
        "--shards", action="store_true", help="read each file front to back in 1 MiB reads"
    )
    bench_cmd.add_argument("--local", type=Path, help="also read the same files of this local copy")
    bench_cmd.add_argument("--cache-dir", type=Path, help="cache of a SOURCE mounted for it (default: fresh)")
    bench_cmd.add_argument("--cache-size", help="capacity of that cache, e.g. 20G")
    bench_cmd.add_argument("--json", action="store_true", help="the epochs as JSON")
    bench_cmd.set_defaults(handler=_cmd_bench)


def _cmd_demo(args: argparse.Namespace, argv: list[str]) -> int:
    from cachefsd.cli import demo  # noqa: PLC0415 - the demo pulls in multiprocessing and rich

    return demo.run(workers=args.workers, keep=args.keep)


def _add_stage_parser(commands: Any) -> None:
    stage_cmd = commands.add_parser(
        "stage",
        help="load a dataset (or part of it) into the cache before a job",
        description=(
            "Stage TARGET into the cache. TARGET is a path in a cachefsd mount (staged by its "
            "daemon) or a SOURCE (s3://bucket[/prefix], gs://..., az://..., a local directory) staged into "
            "--cache-dir in this process when no daemon uses that cache; give it the same cache "
            "settings (--block-size, tiers) as the mount that will use it. Rerunning skips what is "
            "cached."
        ),
    )
    stage_cmd.add_argument("target", help="a path in a mount, or a SOURCE to stage offline")
    stage_cmd.add_argument(
        "--include",
        help="glob on mount-relative paths: * and ? stay within a directory, ** spans directories, "
        "a pattern without / matches file names at any depth (e.g. '*.tar', 'train/**')",
    )
    stage_cmd.add_argument("--tier", choices=["hot", "warm"], help="the tier to place blocks in")
    stage_cmd.add_argument("--check", action="store_true", help="only report how much is cached, by tier")
    stage_cmd.add_argument(
        "--json",
        action="store_true",
        help="print the summary as JSON on stdout (progress: plain lines on stderr)",
    )
    _add_data_path_arguments(stage_cmd)
    stage_cmd.set_defaults(handler=_cmd_stage)


def _add_data_path_arguments(parser: argparse.ArgumentParser) -> None:
    """The cache and store flags of ``mount`` and of an offline ``stage``
    (read back by ``_data_path_flags``)."""
    parser.add_argument("--config", type=Path, help="TOML settings file")
    parser.add_argument("--cache-dir", help="where the index (and, without tiers, the blocks) live")
    parser.add_argument("--cache-size", help="byte capacity of the cache, e.g. 20G")
    parser.add_argument(
        "--block-size",
        help="block size, e.g. 4M (64K to 64M); a stage must match the mount's "
        "(it refuses a cache filled at another size, where a mount drops the blocks)",
    )
    parser.add_argument("--hot", help="directory of the hot tier (fast local disk; raw blocks)")
    parser.add_argument("--hot-size", help="capacity of the hot tier, e.g. 200G or 50%% of its filesystem")
    parser.add_argument("--warm", help="directory of the warm tier (larger disk; lz4 blocks)")
    parser.add_argument("--warm-size", help="capacity of the warm tier, e.g. 2T or 80%%")
    parser.add_argument(
        "--shared-tier",
        help="bucket of the tier all nodes share, e.g. s3://fleet-cache/blocks or az://fleet-cache/blocks",
    )
    parser.add_argument(
        "--shared-endpoint-url", help="S3-compatible or Azure Blob endpoint of the shared tier"
    )
    parser.add_argument(
        "--endpoint-url",
        help="S3-compatible endpoint, e.g. http://127.0.0.1:9000, or an Azure account's blob endpoint "
        "(Azurite: http://127.0.0.1:10000/devstoreaccount1)",
    )
    parser.add_argument("--region", help="S3 region")
    parser.add_argument(
        "--fetch-deadline", help="how long a block may wait on the store before EIO, e.g. 30s"
    )
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"])


def _add_hint_parser(commands: Any) -> None:
    hint = commands.add_parser("hint", help="tell the daemon of MOUNTPOINT the order files will be read in")
    hint.add_argument("mountpoint", type=Path)
    hint.add_argument(
        "--order", type=Path, required=True, help="file with one path a line (absolute or mount-relative)"
    )
    hint.set_defaults(handler=_cmd_hint)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cachefsd",
        description="Mount a bucket, cache it on local disk for training, and write checkpoints into it.",
    )
    parser.add_argument("--version", action="version", version=f"cachefsd {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    mount = commands.add_parser(
        "mount",
        help="mount SOURCE on MOUNTPOINT (or every [[mounts]] of --config); "
        "joins the daemon already serving the cache directory",
    )
    mount.add_argument(
        "source",
        nargs="?",
        help="s3://bucket[/prefix], gs://bucket[/prefix], az://container[/prefix] "
        "(the account from AZURE_STORAGE_ACCOUNT_NAME; or "
        "https://ACCOUNT.blob.core.windows.net/CONTAINER/PREFIX, "
        "abfss://CONTAINER@ACCOUNT.dfs.core.windows.net/PREFIX), /a/dir or file:///a/dir",
    )
    mount.add_argument("mountpoint", nargs="?", type=Path)
    _add_data_path_arguments(mount)
    mount.add_argument("--metadata-ttl", help="how long listings and attributes are trusted, e.g. 60s, 1h")
    mount.add_argument("--metrics-addr", help="HOST:PORT of the Prometheus endpoint (default 127.0.0.1:9468)")
    mount.add_argument("--no-metrics", action="store_true", help="serve no metrics endpoint")
    mount.add_argument("--no-prefetch", action="store_true", help="fetch only what readers ask for")
    mount.add_argument(
        "--writable",
        action="store_true",
        help="let processes write files (staged on the hot tier, uploaded in the background)",
    )
    mount.add_argument("--foreground", action="store_true", help="stay in the foreground (systemd)")
    mount.add_argument(
        "-o", dest="options", action="append", default=[], help="mount options: allow_other, nopassthrough"
    )
    mount.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    mount.set_defaults(handler=_cmd_mount)

    sync_cmd = commands.add_parser(
        "sync",
        help="wait until every file closed on a writable mount is in the bucket (exit 1 naming any not)",
    )
    sync_cmd.add_argument("mountpoint", type=Path)
    sync_cmd.add_argument(
        "--timeout", type=_seconds, help="seconds to wait at most (default: each upload's own bound)"
    )
    sync_cmd.set_defaults(handler=_cmd_sync)

    unmount_cmd = commands.add_parser(
        "unmount", help="unmount MOUNTPOINT (its daemon stops with its last mount)"
    )
    unmount_cmd.add_argument("mountpoint", nargs="?", type=Path)
    unmount_cmd.add_argument("--config", type=Path, help="unmount each of the [[mounts]] of this TOML file")
    unmount_cmd.set_defaults(handler=_cmd_unmount)

    for name, handler, summary in (
        ("verify", _cmd_verify, "check every cached block's hash (and --repair: drop bad ones)"),
        ("gc", _cmd_gc, "remove orphans and unreferenced blocks, trim tiers to capacity"),
    ):
        maintenance = commands.add_parser(name, help=summary)
        maintenance.add_argument("--cache-dir", help="the cache directory (default: from config)")
        maintenance.add_argument("--config", type=Path, help="TOML settings file")
        if name == "verify":
            maintenance.add_argument("--repair", action="store_true", help="drop corrupt or missing blocks")
        maintenance.set_defaults(handler=handler)

    _add_stage_parser(commands)
    _add_hint_parser(commands)
    _add_observe_parsers(commands)

    demo = commands.add_parser("demo", help="mount a generated local dataset and read two shuffled epochs")
    demo.add_argument("--workers", type=_count, default=4, help="reader processes")
    demo.add_argument("--keep", action="store_true", help="keep the demo directory")
    demo.set_defaults(handler=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Whatever a command creates (cache files, the index, the log, runtime
    # state) is owner-only: the log and the index name every key read.
    os.umask(0o077)
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    try:
        return int(args.handler(args, argv))
    except CachefsdError as exc:
        print(f"cachefsd: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        with contextlib.suppress(Exception):
            sys.stderr.write("cachefsd: interrupted\n")
        return 130

"""One settings tree for the whole daemon, from TOML, environment and flags.

Precedence, lowest first: defaults, the TOML file, ``CACHEFSD_*`` environment
variables (``CACHEFSD_CACHE__SIZE=20G`` sets ``cache.size``), command-line
flags. Unknown keys are rejected, and every error names the field it is
about. Each component receives only its own slice (``settings.fetch``, ...).
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from cachefsd.errors import ConfigError

ENV_PREFIX = "CACHEFSD_"

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tib": 1 << 40,
}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER_WITH_UNIT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any) -> int:
    """``20G``, ``512MiB``, ``4096`` -> bytes. Units are binary (G = 2**30), as in
    rclone and JuiceFS, because users size caches against disks in GiB."""
    if isinstance(value, bool):
        raise ValueError("expected a size like 20G")
    if isinstance(value, int):
        return value
    match = _NUMBER_WITH_UNIT.match(str(value))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"invalid size {value!r}: use a number with an optional unit, like 20G or 512MiB")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def human_bytes(count: float) -> str:
    """Binary units, as cache sizes are given (``4.0 MiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def parse_duration(value: Any) -> float:
    """``30``, ``30s``, ``5m``, ``1h``, ``1d`` -> seconds; finite (TOML
    has ``inf``: a deadline of it would let a read hang for good)."""
    if isinstance(value, bool):
        raise ValueError("expected a duration like 30s or 1h")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError(f"invalid duration {value!r}: must be finite")
        return float(value)
    match = _NUMBER_WITH_UNIT.match(str(value))
    if not match or match.group(2).lower() not in _DURATION_UNITS:
        raise ValueError(f"invalid duration {value!r}: use seconds or a unit, like 30s, 5m or 1h")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]


ByteSize = Annotated[int, BeforeValidator(parse_size), Field(ge=0)]
Duration = Annotated[float, BeforeValidator(parse_duration), Field(ge=0)]


def parse_tier_size(value: Any) -> int | str:
    """A tier size: bytes (``200G``) or a share of its filesystem (``50%``),
    resolved when the tier's directory is known (``resolve_tier_size``)."""
    if isinstance(value, str) and value.strip().endswith("%"):
        number = value.strip()[:-1]
        try:
            percent = float(number)
        except ValueError:
            raise ValueError(f"invalid share {value!r}: expected a percentage like 50%") from None
        if not 0 < percent <= 100:
            raise ValueError(f"invalid share {value!r}: must be more than 0% and at most 100%")
        return f"{percent:g}%"
    size = parse_size(value)
    if size <= 0:
        raise ValueError(f"invalid size {value!r}: must be positive")
    return size


TierSize = Annotated[int | str, BeforeValidator(parse_tier_size)]


def _not_a_bool(value: Any) -> Any:
    """TOML ``true`` is not a count (pydantic would read it as 1)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a whole number, not {str(value).lower()}")
    return value


Count = Annotated[int, BeforeValidator(_not_a_bool)]


def _absolute(path: Path) -> Path:
    """Made absolute when the settings are read: the daemon serves from /,
    so a relative cache directory would name a different place (and
    nothing would be cached) once it runs."""
    try:
        return path.expanduser().resolve()
    except RuntimeError as exc:  # ~nosuchuser, or a symlink loop
        raise ValueError(f"cannot resolve {path}: {exc}") from exc


Directory = Annotated[Path, AfterValidator(_absolute)]


def resolve_tier_size(size: int | str, directory: Path) -> int:
    """Bytes for a tier size, a percentage meaning of the total size of the
    filesystem that holds ``directory`` (as ``df`` shows it)."""
    if isinstance(size, int):
        return size
    stats = os.statvfs(directory)
    return int(stats.f_blocks * stats.f_frsize * float(size[:-1]) / 100)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _default_cache_dir() -> Path:
    """Root daemons cache under /var/cache like other system services; users
    under their XDG cache directory."""
    if os.geteuid() == 0:
        return Path("/var/cache/cachefsd")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return (Path(base) / "cachefsd").resolve()  # a default is not validated: made absolute here


Codec = Literal["raw", "lz4"]


class TierSettings(_Section):
    dir: Directory
    size: TierSize
    codec: Codec


class SharedSettings(_Section):
    """The shared tier (``cache/shared.py``): a bucket every node's daemon
    reads below its local tiers and fills after an origin fetch."""

    # s3://bucket[/prefix], gs://bucket[/prefix], an Azure container
    # (az://container[/prefix] and the forms store.azure_location reads).
    url: str = Field(pattern=r"^((s3|gs|az|azure|abfss?)://[^/]+|https://[^/]+\.blob\.[^/]+/[^/]+)")
    endpoint_url: str | None = None  # an S3-compatible endpoint (MinIO, Ceph), Azurite, a sovereign cloud
    # Credentials of its own, from <prefix>AWS_ACCESS_KEY_ID, <prefix>AWS_SECRET_ACCESS_KEY
    # (and <prefix>AWS_SESSION_TOKEN) in the environment: a name here, never a secret.
    credentials_env_prefix: str | None = Field(default=None, pattern=r"^[A-Z][A-Z0-9_]*$")


class CacheSettings(_Section):
    """Where blocks live. Without ``hot`` or ``warm``, one raw tier of
    ``size`` bytes under ``dir``; with them, those tiers (``dir`` then only
    holds the index)."""

    dir: Directory = Field(default_factory=_default_cache_dir)
    # 10 GiB fits a real dataset shard set on any GPU node's local disk.
    size: TierSize = Field(default=10 << 30)
    # 4 MiB blocks: large enough that a GET's latency is amortised (S3
    # first-byte latency ~20 ms vs ~40 ms to move 4 MiB at 100 MB/s), small
    # enough that a random read into a large file does not fetch much waste.
    block_size: ByteSize = Field(default=4 << 20, ge=64 << 10, le=64 << 20)
    hot: TierSettings | None = None
    warm: TierSettings | None = None
    shared: SharedSettings | None = None
    policy: Literal["epoch-aware", "lru", "2-random", "minio"] = "epoch-aware"
    # Reuse cached blocks of another object with the same etag and size
    # instead of downloading (S3 etags of single-part uploads are content
    # MD5s). Only stores whose etags identify content take part.
    dedup_by_etag: bool = True

    @field_validator("hot", "warm", mode="before")
    @classmethod
    def _tier_defaults(cls, value: Any, info: Any) -> Any:
        """``--hot DIR`` alone is a whole tier: raw for hot, lz4 for warm."""
        if isinstance(value, Mapping):
            codec = "raw" if info.field_name == "hot" else "lz4"
            return {"codec": codec, **value}
        return value

    @model_validator(mode="after")
    def _tiers_apart(self) -> CacheSettings:
        """Both tiers name a block file by its hash: in one directory, a
        demotion's warm copy would be the hot copy it then deletes."""
        if self.hot is not None and self.warm is not None and self.hot.dir == self.warm.dir:
            raise ValueError(f"cache.hot.dir and cache.warm.dir are the same directory ({self.hot.dir})")
        return self

    def directories(self) -> list[tuple[str, Path]]:
        """Every directory the cache writes to, by the setting naming it:
        the cache directory (index, log) and each tier's."""
        tiers = [(self.tier_setting(name), tier.dir) for name, tier in self.tiers()]
        return [("cache.dir", self.dir), *(entry for entry in tiers if entry[0] != "cache.dir")]

    def tier_setting(self, name: str, field: str = "dir") -> str:
        """The setting of tier ``name``'s ``field`` (``dir``, ``size``):
        ``cache.dir`` for the single tier of a cache without
        ``[cache.hot]``/``[cache.warm]``, else ``cache.hot.dir``."""
        return f"cache.{field}" if self.hot is None and self.warm is None else f"cache.{name}.{field}"

    def tiers(self) -> list[tuple[str, TierSettings]]:
        """The tiers in order, fastest first."""
        if self.hot is None and self.warm is None:
            return [("hot", TierSettings(dir=self.dir, size=self.size, codec="raw"))]
        return [(name, tier) for name, tier in (("hot", self.hot), ("warm", self.warm)) if tier is not None]


class StoreSettings(_Section):
    endpoint_url: str | None = None
    region: str | None = None
    # A TCP connect to a reachable endpoint takes milliseconds; 5 s lets a
    # wrong endpoint fail the mount quickly without tripping on a busy network.
    connect_timeout: Duration = Field(default=5.0, gt=0)
    max_connections: Count = Field(default=64, ge=1, le=1024)

    @field_validator("endpoint_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        """Checked here, so that no mount gets as far as the store with it;
        the URL is echoed only when it cannot hold a credential."""
        if value is None:
            return value
        shown = repr(value) if "@" not in value else "(not shown: it holds an @)"
        if not re.match(r"^https?://[^/\s]+", value):
            raise ValueError(f"invalid URL {shown}: expected http://host[:port] or https://host[:port]")
        try:
            parts = urlsplit(value)  # "http://[::1" raises here,
            parts.port  # noqa: B018 - and "host:notaport" or ":99999" here
        except ValueError as exc:
            raise ValueError(f"invalid URL {shown}: {exc}") from None
        if parts.username is not None or parts.password is not None:
            raise ValueError(
                "credentials in the URL are not used: give them as AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, a profile or an instance role"
            )
        return value


class FetchSettings(_Section):
    # Total time a read may wait for one block, retries included, before EIO.
    deadline: Duration = Field(default=30.0, gt=0)
    # One attempt at a listing or a HEAD, and the longest a transfer may
    # stall: abandoned and retried after this (a transfer whose bytes flow
    # runs on, within the deadline).
    attempt_timeout: Duration = Field(default=10.0, gt=0)
    # Parallel GETs: enough to fill a 10 Gb/s link with 4 MiB blocks at
    # ~50 ms each, few enough not to trip S3 request-rate limits per prefix.
    concurrency: Count = Field(default=32, ge=1, le=1024)
    backoff_initial: Duration = 0.05
    backoff_max: Duration = 2.0


class PrefetchSettings(_Section):
    """Read-ahead of the loader: sequential streams inside files, the
    unread files of the epoch, or a hinted order. One global budget, however
    many files are open (per-handle windows drove Mountpoint for S3 to
    out-of-memory kills)."""

    enabled: bool = True
    # Parallel prefetch GETs: at 20 ms a request, 24 keep a store near its
    # request ceiling. Demand reads always go first (fetch.py), and
    # fetch.concurrency must leave room for them.
    concurrency: Count = Field(default=24, ge=1, le=512)
    # Bytes fetched ahead and not yet read, at most: the prefetcher's whole
    # footprint in the cache. 2 GiB is a few seconds of a fast link.
    lookahead: ByteSize = Field(default=2 << 30, gt=0)
    # Bytes per second for prefetch traffic; 0 means no cap.
    bandwidth: ByteSize = 0


class NamespaceSettings(_Section):
    # Datasets are immutable in practice; an hour keeps `ls` and `stat` off
    # the network for a whole training run while still noticing re-uploads.
    # At least a second: at 0 every lookup lists its directory again, and
    # `ls -l` of 300 files took 70 s.
    metadata_ttl: Duration = Field(default=3600.0, ge=1.0)
    # A mount lists each directory again before it serves the listing an
    # earlier mount saved, so nothing overwritten meanwhile is missed. True
    # serves saved listings younger than metadata_ttl unchecked: a remount
    # of millions of objects lists nothing, and misses what changed.
    trust_saved_listings: bool = False


class MetricsSettings(_Section):
    enabled: bool = True
    # Loopback only: metrics reveal dataset sizes and access patterns.
    addr: str = "127.0.0.1:9468"

    @field_validator("addr")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"invalid address {value!r}: expected HOST:PORT, like 127.0.0.1:9468")
        return value


class FuseSettings(_Section):
    allow_other: bool = False
    # Serve files cached whole in the hot tier through the kernel (FUSE
    # passthrough, Linux 6.9+, as root): off makes the daemon serve every read.
    passthrough: bool = True


class Settings(_Section):
    """The whole settings tree: what to mount where, and one slice for each component."""

    source: str
    mountpoint: Directory
    # Processes may write through the mount: files are staged on the hot
    # tier and uploaded in the background (SEMANTICS.md).
    writable: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    cache: CacheSettings = Field(default_factory=CacheSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    fetch: FetchSettings = Field(default_factory=FetchSettings)
    namespace: NamespaceSettings = Field(default_factory=NamespaceSettings)
    prefetch: PrefetchSettings = Field(default_factory=PrefetchSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    fuse: FuseSettings = Field(default_factory=FuseSettings)

    @field_validator("source")
    @classmethod
    def _source_names_a_place(cls, value: str) -> str:
        """A local source is made absolute here, like the cache directories
        (the daemon serves from /). An empty one would be the current
        directory: ``/`` itself under systemd or in a container, served
        whole, which an unset variable in a unit must not do."""
        if not value.strip():
            raise ValueError("empty: give s3://bucket, gs://bucket, az://container, file:///a/dir or /a/dir")
        scheme, sep, rest = value.partition("://")
        if not sep:
            return str(_absolute(Path(value)))
        if scheme == "file" and not rest.startswith("/"):
            raise ValueError(f"{value!r}: a file:// URL needs an absolute path (file:///a/dir)")
        return value

    @model_validator(mode="after")
    def _demand_keeps_slots(self) -> Settings:
        if self.prefetch.concurrency >= self.fetch.concurrency:
            raise ValueError(
                f"prefetch.concurrency ({self.prefetch.concurrency}) must be below fetch.concurrency "
                f"({self.fetch.concurrency}): prefetch runs must leave demand reads connections to wait for"
            )
        return self


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """``override`` over ``base``; a table of settings given where a value
    is (``cache = 5`` in the file, ``--cache-dir`` on the command line) is an
    error naming it, not a silent replacement."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and key in merged:
            if not isinstance(merged[key], dict):
                raise ConfigError(f"{where}{key}: expected a table of settings, not {merged[key]!r}")
            merged[key] = _deep_merge(merged[key], value, f"{where}{key}.")
        else:
            merged[key] = value
    return merged


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``CACHEFSD_CACHE__SIZE=20G`` -> ``{"cache": {"size": "20G"}}``."""
    tree: dict[str, Any] = {}
    for name, path in _env_settings(environ).items():
        table = tree
        for part in path[:-1]:
            table = table.setdefault(part, {})
        table[path[-1]] = environ[name]
    return tree


def _env_settings(environ: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """Each ``CACHEFSD_*`` variable and the settings path it sets."""
    return {
        name: tuple(name[len(ENV_PREFIX) :].lower().split("__"))
        for name in environ
        if name.startswith(ENV_PREFIX)
    }


def _set_in(tree: Mapping[str, Any], path: tuple[str, ...]) -> bool:
    for part in path:
        if not isinstance(tree, Mapping) or part not in tree:
            return False
        tree = tree[part]
    return True


def _describe(error: ValidationError, env_origins: Mapping[tuple[str, ...], str]) -> str:
    """Every bad field, by its settings path, and by its variable when an
    environment variable set it: ``cache.siz`` alone did not say it came
    from a stray ``CACHEFSD_CACHE__SIZ`` in a pod spec."""
    lines = []
    for item in error.errors():
        loc = tuple(str(part) for part in item["loc"])
        field = ".".join(loc) or "config"
        origin = next((name for path, name in env_origins.items() if loc[: len(path)] == path), None)
        if origin is not None:
            field += f" (from {origin})"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown setting"
        lines.append(f"{field}: {message}" if item["loc"] else message)
    return "; ".join(lines)


def _read_config(config_file: Path | None) -> dict[str, Any]:
    if config_file is None:
        return {}
    try:
        return tomllib.loads(config_file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {config_file}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {config_file} is not UTF-8 text (byte {exc.start})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {config_file} is not valid TOML: {exc}") from exc


def _validated(
    tree: dict[str, Any], flags: Mapping[str, Any], environ: Mapping[str, str], where: str
) -> Settings:
    tree = _deep_merge(tree, env_overrides(environ))
    tree = _deep_merge(tree, flags)
    try:
        return Settings.model_validate(tree)
    except ValidationError as exc:
        env_settings = _env_settings(environ).items()
        env_origins = {path: name for name, path in env_settings if not _set_in(flags, path)}
        raise ConfigError(where + _describe(exc, env_origins)) from exc


def load_settings(
    config_file: Path | None,
    flags: Mapping[str, Any],
    environ: Mapping[str, str] = os.environ,
) -> Settings:
    """The validated settings of one mount (or an offline stage), or
    ``ConfigError`` naming every bad field. A config file's ``[[mounts]]``
    play no part: the command names its source."""
    tree = _read_config(config_file)
    tree.pop("mounts", None)
    return _validated(tree, flags, environ, "")


# What belongs to the daemon, not to one of its mounts: the cache it
# serves from, its metrics endpoint and its log. Every mount of a daemon
# has the daemon's (``node_conflicts``).
NODE_SETTINGS = ("cache", "metrics", "log_level")


def load_mounts(
    config_file: Path | None,
    flags: Mapping[str, Any],
    environ: Mapping[str, str] = os.environ,
) -> list[Settings]:
    """The settings of each ``[[mounts]]`` entry of the config file (its
    ``source``, ``mountpoint`` and any per-mount section, over the file's
    top level), for a daemon that serves them all; ``ConfigError`` naming
    the entry and field at fault."""
    tree = _read_config(config_file)
    entries = tree.pop("mounts", None)
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(
            "mounts: give SOURCE and MOUNTPOINT, or a config file that lists them as [[mounts]] tables"
        )
    named = [name for name, path in _env_settings(environ).items() if path in (("source",), ("mountpoint",))]
    named += [key.upper() for key in ("source", "mountpoint") if key in flags]
    if named:
        raise ConfigError(
            f"mounts: the config file lists the mounts, so {' and '.join(named)} must not name one"
        )
    mounts = []
    for number, entry in enumerate(entries):
        where = f"mounts[{number}]."
        for key in NODE_SETTINGS:
            if key in entry:
                raise ConfigError(
                    f"{where}{key}: belongs to the daemon all its mounts share: set it at the top level"
                )
        mounts.append(_validated(_deep_merge(tree, entry, where), flags, environ, where))
    seen: dict[Path, int] = {}
    for number, settings in enumerate(mounts):
        first = seen.setdefault(settings.mountpoint, number)
        if first != number:
            raise ConfigError(f"mounts[{number}].mountpoint: {settings.mountpoint} is mounts[{first}]'s too")
    return mounts


def node_conflicts(daemon: Settings, mount: Settings) -> list[str]:
    """The daemon's settings that ``mount`` asks for differently, each as
    ``field: asked, daemon's``: a mount joining a running daemon gets the
    daemon's cache, metrics and log, so a difference the user asked for
    (not a default left alone) is refused rather than ignored."""
    asked = mount.model_dump(mode="json", include=set(NODE_SETTINGS), exclude_unset=True)
    has = daemon.model_dump(mode="json", include=set(NODE_SETTINGS))
    return list(_differences(asked, has, ""))


def _differences(asked: Mapping[str, Any], has: Mapping[str, Any], where: str) -> Iterator[str]:
    for key, value in asked.items():
        theirs = has.get(key)
        if isinstance(value, Mapping) and isinstance(theirs, Mapping):
            yield from _differences(value, theirs, f"{where}{key}.")
        elif value != theirs:
            yield f"{where}{key}: {_shown(value, key)} here, {_shown(theirs, key)} in the daemon"


def _shown(value: Any, key: str) -> str:
    if value is None:
        return "none"
    if key.endswith("size") and isinstance(value, int):
        return human_bytes(value)
    return str(value)


def validated_settings(tree: Mapping[str, Any]) -> Settings:
    """Settings sent as a tree (``Settings.model_dump``, the unset fields
    left out), validated again; ``ConfigError`` naming every bad field."""
    return _validated(dict(tree), {}, {}, "")

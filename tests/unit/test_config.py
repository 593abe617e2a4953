"""Settings: units, precedence, and errors that name the field."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from cachefsd.cache.directory import tier_specs
from cachefsd.config import (
    FetchSettings,
    SharedSettings,
    StoreSettings,
    load_mounts,
    load_settings,
    node_conflicts,
    parse_duration,
    parse_size,
    validated_settings,
)
from cachefsd.errors import ConfigError
from cachefsd.store import open_store
from cachefsd.store.base import redact_url

REQUIRED = {"source": "/data", "mountpoint": "/mnt"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("4K", 4096), ("4KiB", 4096), ("20G", 20 << 30), ("1.5M", 3 << 19), (7, 7)],
)
def test_sizes(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"), [("30", 30.0), ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0), (2, 2.0)]
)
def test_durations(text: object, expected: float) -> None:
    assert parse_duration(text) == expected


def test_precedence_is_defaults_then_file_then_env_then_flags(tmp_path: Path) -> None:
    config = tmp_path / "cachefsd.toml"
    config.write_text('[cache]\nsize = "1G"\nblock_size = "1M"\n[namespace]\nmetadata_ttl = "5m"\n')
    settings = load_settings(
        config,
        {**REQUIRED, "cache": {"size": "3G"}},
        environ={"CACHEFSD_CACHE__SIZE": "2G", "CACHEFSD_CACHE__BLOCK_SIZE": "2M", "HOME": "/root"},
    )
    assert settings.cache.size == 3 << 30  # flag beats env and file
    assert settings.cache.block_size == 2 << 20  # env beats file
    assert settings.namespace.metadata_ttl == 300.0  # file beats default
    assert settings.fetch.deadline == 30.0  # default


@pytest.mark.parametrize(
    ("flags", "environ", "field"),
    [
        ({"cache": {"size": "abc"}}, {}, "cache.size"),
        ({}, {"CACHEFSD_CACHE__SIZE": "-5"}, "cache.size"),
        ({"cache": {"block_size": "1K"}}, {}, "cache.block_size"),
        ({"metrics": {"addr": "nowhere"}}, {}, "metrics.addr"),
        ({"store": {"endpoint_url": "ftp://x"}}, {}, "store.endpoint_url"),
        ({"store": {"endpoint_url": "http://127.0.0.1:notaport"}}, {}, "store.endpoint_url: invalid URL"),
        ({"store": {"endpoint_url": "http://127.0.0.1:99999"}}, {}, "store.endpoint_url: invalid URL"),
        ({"store": {"endpoint_url": "http://[::1"}}, {}, "store.endpoint_url: invalid URL"),
        (
            {"store": {"endpoint_url": "http://u:pw@minio:9000"}},
            {},
            "store.endpoint_url: credentials in the URL",
        ),
        ({}, {"CACHEFSD_CACHE__SZIE": "1G"}, "cache.szie (from CACHEFSD_CACHE__SZIE): unknown setting"),
        ({}, {"CACHEFSD_CACHE__SIZE": "lots"}, "cache.size (from CACHEFSD_CACHE__SIZE): invalid size 'lots'"),
        ({}, {"CACHEFSD_FETCH": "fast"}, "fetch (from CACHEFSD_FETCH): Input should be a valid dictionary"),
        ({"namespace": {"metadata_ttl": "soon"}}, {}, "namespace.metadata_ttl"),
        ({"namespace": {"metadata_ttl": "0"}}, {}, "namespace.metadata_ttl: Input should be greater"),
        ({"fetch": {"concurrency": True}}, {}, "fetch.concurrency: expected a whole number"),
        ({"fetch": {"deadline": float("inf")}}, {}, "fetch.deadline: invalid duration inf: must be finite"),
        ({"store": {"connect_timeout": "0s"}}, {}, "store.connect_timeout: Input should be greater than 0"),
        ({"cache": {"dir": "~no-such-user-here/c"}}, {}, "cache.dir: cannot resolve"),
        ({"source": ""}, {}, "source: empty"),
        ({"source": "file://data"}, {}, "source: 'file://data': a file:// URL needs an absolute path"),
        (
            {"cache": {"hot": {"dir": "/c/t", "size": "1G"}, "warm": {"dir": "/c/t", "size": "1G"}}},
            {},
            "cache.hot.dir and cache.warm.dir are the same directory",
        ),
    ],
)
def test_bad_values_name_their_field(flags: dict[str, object], environ: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(field)) as refused:
        load_settings(None, {**REQUIRED, **flags}, environ=environ)
    assert "pw" not in str(refused.value)  # a credential is never echoed


def test_a_bad_flag_is_not_blamed_on_the_variable_it_overrides() -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(None, {**REQUIRED, "cache": {"size": "lots"}}, environ={"CACHEFSD_CACHE__SIZE": "20G"})
    assert str(refused.value).startswith("cache.size: invalid size 'lots'")


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (b"[cache]\ncolour = 'blue'\n", r"cache\.colour: unknown setting"),
        (b"[cache\n", r"bad\.toml is not valid TOML"),
        ('[cache]\ndir = "/caf\xe9"\n'.encode("latin-1"), r"bad\.toml is not UTF-8 text"),
    ],
    ids=["unknown key", "invalid TOML", "not UTF-8"],
)
def test_a_bad_config_file_is_named_with_what_is_wrong(tmp_path: Path, content: bytes, error: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_bytes(content)
    with pytest.raises(ConfigError, match=error):
        load_settings(config, REQUIRED, environ={})


def test_a_value_where_a_table_belongs_is_named_even_under_a_flag(tmp_path: Path) -> None:
    """``cache = 5`` in the file must not vanish because ``--cache-dir`` was given."""
    config = tmp_path / "flat.toml"
    config.write_text("cache = 5\n")
    with pytest.raises(ConfigError, match=r"cache: expected a table of settings, not 5"):
        load_settings(config, {**REQUIRED, "cache": {"dir": "/c"}}, environ={})


def test_cache_directories_are_absolute_whatever_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon serves from /: a relative cache directory would name
    another place once it runs, and nothing would be cached."""
    monkeypatch.chdir(tmp_path)
    settings = load_settings(
        None, {**REQUIRED, "cache": {"dir": "c", "hot": {"dir": "hot", "size": "1G"}}}, environ={}
    )
    assert settings.cache.dir == tmp_path / "c"
    assert settings.cache.tiers()[0][1].dir == tmp_path / "hot"


def test_a_local_source_is_absolute_whatever_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert load_settings(None, {**REQUIRED, "source": "data"}, environ={}).source == str(tmp_path / "data")
    assert load_settings(None, {**REQUIRED, "source": "s3://b/p"}, environ={}).source == "s3://b/p"


def test_the_default_cache_directory_is_the_one_its_tier_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A home reached through a symlink (/home/u -> /data/u): were the
    default left as spelled, the tier's (resolved) directory would differ
    from it, and the daemon would wait on its own lock."""
    (tmp_path / "real").mkdir()
    (tmp_path / "home").symlink_to(tmp_path / "real")
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home" / ".cache"))
    settings = load_settings(None, REQUIRED, environ={})
    assert settings.cache.dir == tmp_path / "real" / ".cache" / "cachefsd"
    assert settings.cache.tiers()[0][1].dir == settings.cache.dir


@pytest.mark.parametrize(
    "source",
    [
        "s3://Legacy_Bucket",
        "s3://b" + "x" * 253,
        "gs://datasets.team-vision.research.example.com.images-2024.shards",
    ],
)
def test_bucket_names_the_services_have_allowed_are_accepted(source: str) -> None:
    """Legacy us-east-1 buckets may have capitals, underscores and 255
    characters; dotted GCS names up to 222: the service says if they exist."""
    store = open_store(source, StoreSettings(), FetchSettings(attempt_timeout=1.0))
    assert store.uri == source


@pytest.mark.parametrize(
    "source", ["s3://ab", "s3://-bucket", "s3://bucket-", "gs://b" + "x" * 255, "s3://a b"]
)
def test_bucket_names_no_service_allows_name_the_source(source: str) -> None:
    with pytest.raises(ConfigError, match=r"source: invalid bucket name"):
        open_store(source, StoreSettings(), FetchSettings(attempt_timeout=1.0))


@pytest.mark.parametrize(
    ("endpoint", "key"),
    [
        (None, "s3://data/p"),  # AWS: bucket names are global
        ("https://s3.eu-west-1.amazonaws.com", "s3://data/p"),  # still AWS: the cache stays valid
        ("http://minio:9000/", "s3://data/p@http://minio:9000"),
        ("https://gateway.example/s3?x=1", "s3://data/p@https://gateway.example/s3"),
    ],
)
def test_a_source_is_keyed_by_its_endpoint(endpoint: str | None, key: str) -> None:
    settings = StoreSettings(endpoint_url=endpoint)
    store = open_store("s3://data/p", settings, FetchSettings(attempt_timeout=1.0))
    assert store.cache_key == key
    assert store.uri == "s3://data/p"


@pytest.mark.parametrize(
    ("source", "endpoint", "uri", "key"),
    [
        (
            "az://data/train/",
            None,
            "az://data/train",
            "az://data/train@https://envacct.blob.core.windows.net",
        ),
        ("azure://data", None, "az://data", "az://data@https://envacct.blob.core.windows.net"),
        ("abfs://data/p", None, "az://data/p", "az://data/p@https://envacct.blob.core.windows.net"),
        (
            "abfss://data@urlacct.dfs.core.windows.net/p",
            None,
            "az://data/p",
            "az://data/p@https://urlacct.blob.core.windows.net",
        ),
        (
            "abfss://data@urlacct.dfs.core.chinacloudapi.cn/p",
            None,
            "az://data/p",
            "az://data/p@https://urlacct.blob.core.chinacloudapi.cn",
        ),
        (
            "https://urlacct.blob.core.windows.net/data/p/q",
            None,
            "az://data/p/q",
            "az://data/p/q@https://urlacct.blob.core.windows.net",
        ),
        (
            "az://data/p",
            "http://127.0.0.1:10000/devstoreaccount1/",
            "az://data/p",
            "az://data/p@http://127.0.0.1:10000/devstoreaccount1",
        ),
    ],
)
def test_azure_sources_in_every_form(
    source: str, endpoint: str | None, uri: str, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container is unique within its account only: the cache keys it by the account's endpoint."""
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "envacct")
    store = open_store(source, StoreSettings(endpoint_url=endpoint), FetchSettings(attempt_timeout=1.0))
    assert (store.uri, store.cache_key) == (uri, key)
    assert store.content_etags is False


def test_an_azure_account_comes_from_the_endpoint_when_the_environment_has_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME", raising=False)
    settings = StoreSettings(endpoint_url="http://127.0.0.1:10000/devstoreaccount1")
    store = open_store("az://data", settings, FetchSettings(attempt_timeout=1.0))
    assert store.cache_key == "az://data@http://127.0.0.1:10000/devstoreaccount1"
    with pytest.raises(ConfigError, match="names no storage account: set AZURE_STORAGE_ACCOUNT_NAME"):
        open_store("az://data", StoreSettings(), FetchSettings(attempt_timeout=1.0))


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("az://ab", "invalid container name 'ab'"),
        ("az://Data", "invalid container name 'Data'"),
        ("az://da--ta", "invalid container name 'da--ta'"),
        ("az://-data", "invalid container name '-data'"),
        ("https://Bad_Acct.blob.core.windows.net/data", "invalid storage account name 'Bad_Acct'"),
    ],
)
def test_azure_names_azure_refuses_name_the_source(
    source: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    with pytest.raises(ConfigError, match=re.escape(message)):
        open_store(source, StoreSettings(), FetchSettings(attempt_timeout=1.0))


@pytest.mark.parametrize(
    "url",
    [
        "s3://fleet/blocks",
        "gs://fleet/blocks",
        "az://fleet/blocks",
        "abfss://fleet@acct.dfs.core.windows.net/blocks",
        "https://acct.blob.core.windows.net/fleet/blocks",
    ],
)
def test_a_shared_tier_may_be_any_bucket(url: str) -> None:
    assert SharedSettings(url=url).url == url


def test_a_shared_tier_is_not_a_web_page() -> None:
    with pytest.raises(ValueError, match="url"):
        SharedSettings(url="https://example.com/blocks")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        # botocore's own settings (AWS_ENDPOINT_URL, a profile) may hold credentials; the flag refuses them.
        ("http://key:secret@minio:9000/", "http://minio:9000"),
        ("https://Gateway.example/s3/?x=1#y", "https://gateway.example/s3"),
        ("http://[::1]:9000", "http://[::1]:9000"),
        ("user:secret@127.0.0.1:4443", "127.0.0.1:4443"),  # STORAGE_EMULATOR_HOST may omit the scheme
        ("http://127.0.0.1:notaport", "http://127.0.0.1"),  # never an error: it only names an endpoint
    ],
)
def test_urls_are_shown_and_keyed_without_credentials(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize("size_given", [True, False])
def test_a_cache_size_beside_tiers_is_warned_of_not_silently_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, size_given: bool
) -> None:
    cache: dict[str, object] = {"hot": {"dir": str(tmp_path / "hot"), "size": "1G"}}
    if size_given:
        cache["size"] = "20G"
    settings = load_settings(None, {**REQUIRED, "cache": cache}, environ={})
    with caplog.at_level(logging.WARNING, logger="cachefsd.cache.directory"):
        specs = tier_specs(settings.cache)
    assert [spec.capacity for spec in specs] == [1 << 30]
    # Only when it was given: its default is no mistake of the user's.
    assert ("cache.size is not used with hot or warm tiers" in caplog.text) == size_given


def test_a_tier_smaller_than_a_block_is_warned_of_and_one_without_a_unit_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    small = load_settings(None, {**REQUIRED, "cache": {"dir": str(tmp_path), "size": "1M"}}, environ={})
    with caplog.at_level(logging.WARNING, logger="cachefsd.cache.directory"):
        assert [spec.capacity for spec in tier_specs(small.cache)] == [1 << 20]
    assert "cache.size: 1.0 MiB holds not even one 4.0 MiB block" in caplog.text
    typo = load_settings(None, {**REQUIRED, "cache": {"dir": str(tmp_path), "size": "500"}}, environ={})
    with pytest.raises(ConfigError, match=r"^cache\.size: 500 B is too small for a cache \(no unit\?\)$"):
        tier_specs(typo.cache)


# -- a daemon's mounts ----------------------------------------------------------------------


def _node_file(tmp_path: Path, text: str) -> Path:
    config = tmp_path / "node.toml"
    config.write_text('[cache]\ndir = "/var/tmp/node-cache"\nsize = "50G"\n' + text)
    return config


def test_mounts_of_a_config_file_share_its_top_level_and_keep_their_own_sections(tmp_path: Path) -> None:
    config = _node_file(
        tmp_path,
        '[fetch]\ndeadline = "20s"\n'
        '[[mounts]]\nsource = "s3://a/train"\nmountpoint = "/mnt/a"\n'
        '[[mounts]]\nsource = "/data/b"\nmountpoint = "/mnt/b"\n[mounts.fetch]\ndeadline = "5s"\n',
    )
    first, second = load_mounts(config, {"log_level": "debug"}, environ={})
    assert (first.source, first.mountpoint, second.source) == ("s3://a/train", Path("/mnt/a"), "/data/b")
    assert first.cache == second.cache
    assert first.cache.size == 50 << 30
    assert (first.fetch.deadline, second.fetch.deadline) == (20.0, 5.0)
    assert first.log_level == second.log_level == "debug"  # a flag applies to every mount


@pytest.mark.parametrize(
    ("entries", "flags", "environ", "message"),
    [
        (
            '[[mounts]]\nsource = "/d"\nmountpoint = "/m"\n[mounts.cache]\nsize = "1G"\n',
            {},
            {},
            "mounts[0].cache: belongs to the daemon",
        ),
        (
            '[[mounts]]\nsource = "/d"\nmountpoint = "/m"\nlog_level = "debug"\n',
            {},
            {},
            "mounts[0].log_level: belongs to the daemon",
        ),
        (
            '[[mounts]]\nsource = "/d"\nmountpoint = "/m"\n[[mounts]]\nsource = "/e"\nmountpoint = "/m"\n',
            {},
            {},
            "mounts[1].mountpoint: /m is mounts[0]'s too",
        ),
        (
            '[[mounts]]\nsource = "/d"\nmountpoint = "/m"\n[[mounts]]\nsource = ""\nmountpoint = "/n"\n',
            {},
            {},
            "mounts[1].source: empty",
        ),
        (
            '[[mounts]]\nsource = "/d"\nmountpoint = "/m"\n[mounts.fetch]\ndeadlin = "1s"\n',
            {},
            {},
            "mounts[0].fetch.deadlin: unknown setting",
        ),
        (
            '[[mounts]]\nsource = "/d"\nmountpoint = "/m"\n',
            {"source": "/x"},
            {},
            "so SOURCE must not name one",
        ),
        (
            '[[mounts]]\nsource = "/d"\nmountpoint = "/m"\n',
            {},
            {"CACHEFSD_MOUNTPOINT": "/x"},
            "so CACHEFSD_MOUNTPOINT must",
        ),
        ("", {}, {}, "mounts: give SOURCE and MOUNTPOINT, or a config file that lists them"),
    ],
)
def test_a_bad_list_of_mounts_is_named(
    tmp_path: Path, entries: str, flags: dict[str, str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_mounts(_node_file(tmp_path, entries), flags, environ=environ)


def test_a_command_that_names_its_source_ignores_the_files_mounts(tmp_path: Path) -> None:
    config = _node_file(tmp_path, '[[mounts]]\nsource = "/d"\nmountpoint = "/m"\n')
    settings = load_settings(config, {"source": "/other", "mountpoint": "/mnt/other"}, environ={})
    assert (settings.source, settings.cache.size) == ("/other", 50 << 30)


def test_only_daemon_settings_a_joining_mount_sets_differently_conflict() -> None:
    daemon = load_settings(None, {**REQUIRED, "cache": {"dir": "/c", "size": "10G"}}, environ={})

    def conflicts(flags: dict[str, object]) -> list[str]:
        return node_conflicts(daemon, load_settings(None, {"source": "/e", "mountpoint": "/n", **flags}, {}))

    assert conflicts({"cache": {"dir": "/c"}}) == []  # the size left at its default is the daemon's
    assert conflicts({"cache": {"dir": "/c", "size": "10G"}, "fetch": {"deadline": "1s"}}) == []
    assert conflicts({"cache": {"dir": "/c", "size": "20G"}}) == [
        "cache.size: 20.0 GiB here, 10.0 GiB in the daemon"
    ]
    assert conflicts({"cache": {"dir": "/c", "hot": {"dir": "/h", "size": "1G"}}}) == [
        "cache.hot: {'dir': '/h', 'size': 1073741824, 'codec': 'raw'} here, none in the daemon"
    ]
    assert conflicts({"metrics": {"enabled": False}, "log_level": "debug"}) == [
        "log_level: debug here, info in the daemon",
        "metrics.enabled: False here, True in the daemon",
    ]


def test_settings_sent_to_a_daemon_come_back_the_same_with_what_was_set() -> None:
    settings = load_settings(
        None, {**REQUIRED, "cache": {"dir": "/c", "size": "2G"}, "fetch": {"deadline": "3s"}}, {}
    )
    again = validated_settings(settings.model_dump(mode="json", exclude_unset=True))
    assert again == settings
    assert again.cache.model_fields_set == {"dir", "size"}
    with pytest.raises(ConfigError, match=re.escape("fetch.deadline: Input should be greater than 0")):
        validated_settings({**REQUIRED, "fetch": {"deadline": 0}})

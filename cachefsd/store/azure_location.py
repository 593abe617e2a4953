"""Where an Azure source is, from the URL forms users name it by: read
without loading an Azure SDK, so that ``open_store`` can tell an Azure
source from the others."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from cachefsd.errors import ConfigError

ACCOUNT_ENV = "AZURE_STORAGE_ACCOUNT_NAME"
# Azure's names: an account is 3-24 lowercase letters and digits; a
# container 3-63 lowercase letters, digits and single dashes, or $root.
_ACCOUNT = re.compile(r"^[a-z0-9]{3,24}$")
_CONTAINER = re.compile(r"^(\$root|[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62})$")
_AZURE_SCHEMES = ("az", "azure", "abfs", "abfss")


@dataclass(frozen=True, slots=True)
class AzureLocation:
    """Where an Azure source is: the account, the container, the prefix in
    it, and the account's blob endpoint (``https://ACCOUNT.blob.core.windows.net``,
    or the one configured: Azurite's ``http://127.0.0.1:10000/devstoreaccount1``,
    a sovereign cloud's)."""

    account: str
    container: str
    prefix: str
    account_url: str


def is_azure_source(source: str) -> bool:
    """Whether ``source`` names an Azure container (any form ``parse_source`` reads)."""
    scheme, sep, rest = source.partition("://")
    if not sep:
        return False
    if scheme in _AZURE_SCHEMES:
        return True
    return scheme == "https" and ".blob." in rest.partition("/")[0]


def parse_source(source: str, endpoint_url: str | None, environ: Mapping[str, str]) -> AzureLocation:
    """The account, container and prefix of ``az://container/prefix`` and
    ``azure://``, ``abfs[s]://container[@account.dfs.core.windows.net]/prefix``
    and ``https://account.blob.core.windows.net/container/prefix``. The
    account is the URL's, else ``AZURE_STORAGE_ACCOUNT_NAME``, else the
    path of ``endpoint_url`` (Azurite's are ``http://host:port/ACCOUNT``);
    ``ConfigError`` naming ``source`` when there is none, or a name Azure
    would refuse."""
    scheme, _, rest = source.partition("://")
    account: str | None = None
    blob_host: str | None = None
    if scheme == "https":
        blob_host, _, path = rest.partition("/")
        account = blob_host.partition(".")[0]
        container, _, prefix = path.partition("/")
    else:
        container_part, _, prefix = rest.partition("/")
        container, at, host = container_part.partition("@")
        if at:
            account, _, domain = host.partition(".")
            # The Data Lake endpoint's blob twin (dfs.core.windows.net ->
            # blob.core.windows.net, sovereign clouds alike).
            blob_host = f"{account}.blob.{domain.removeprefix('dfs.')}"
    if account is None:
        account = environ.get(ACCOUNT_ENV) or None
    if account is None and endpoint_url is not None:
        account = urlsplit(endpoint_url).path.strip("/").rpartition("/")[2] or None
    if account is None:
        raise ConfigError(
            f"source: {source!r} names no storage account: set {ACCOUNT_ENV} "
            "or use https://ACCOUNT.blob.core.windows.net/CONTAINER/PREFIX"
        )
    if not _ACCOUNT.match(account):
        raise ConfigError(f"source: invalid storage account name {account!r} in {source!r}")
    if not _CONTAINER.match(container):
        raise ConfigError(f"source: invalid container name {container!r} in {source!r}")
    if endpoint_url is not None:
        account_url = endpoint_url.rstrip("/")
    elif blob_host is not None:
        account_url = f"https://{blob_host}"
    else:
        account_url = f"https://{account}.blob.core.windows.net"
    return AzureLocation(account, container, prefix.strip("/"), account_url)

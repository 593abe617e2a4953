"""The S3 store's fast timestamp parser answers what botocore's would."""

from __future__ import annotations

import pytest
from botocore.utils import parse_timestamp

from cachefsd.store.s3 import _parse_timestamp


@pytest.mark.parametrize(
    "value",
    [
        "2024-05-01T12:34:56.000Z",  # ListObjectsV2 LastModified
        "2024-05-01T12:34:56Z",
        "2024-05-01T12:34:56.123456+02:00",
        "Wed, 01 May 2024 12:34:56 GMT",  # HEAD's Last-Modified header
        "2024-05-01T12:34:56",  # no zone: botocore decides
        "1714566896",
    ],
)
def test_same_as_botocore(value: str) -> None:
    # The same instant (the store keeps only ``.timestamp()``), zone-aware as botocore's.
    assert _parse_timestamp(value).timestamp() == parse_timestamp(value).timestamp()
    assert (_parse_timestamp(value).tzinfo is None) == (parse_timestamp(value).tzinfo is None)

"""The file-backed S3 endpoint (``cachefsd.testing.file_s3``) answers as moto
does, through real clients.

The same calls go to moto and to file_s3 through boto3, and their answers
(bodies, etags, ranges, error codes and statuses, listing pages with
continuation tokens left out, since those are opaque) must be equal. obstore
(the daemon's data client) and plain HTTP check what boto3 cannot show:
obstore's ranges, preconditions and full listings, and the keys this server
refuses. The store contract (``test_store.py``) runs S3Store over it too.
"""

from __future__ import annotations

import http.client
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import obstore
import pytest
from botocore.exceptions import ClientError
from obstore.exceptions import PreconditionError
from obstore.store import S3Store as ObstoreS3

from cachefsd.testing.counting import GET_OBJECT, HEAD_OBJECT, LIST, PUT_OBJECT
from cachefsd.testing.file_s3 import FileS3Server

# More than a page (1,000 keys), so listings must page.
MANY = 1100
BIG = 3 << 20
SEED_THREADS = 16


def _seed() -> dict[str, bytes]:
    objects = {
        "top.txt": b"top\n",
        "empty.bin": b"",
        "big.bin": bytes(range(256)) * (BIG // 256),
        "x": b"object x\n",
        "x/y": b"object x/y\n",
        "dir/": b"",
        "dir/inside.txt": b"inside\n",
        "a/b/c/deep.txt": b"deep\n",
        "a/first.txt": b"first\n",
        "spaces/a b+c.txt": b"spaces and a plus\n",
        "unicode/naïve-数据.txt": "unicode ✓\n".encode(),
        "zz~tilde": b"last in byte order\n",
    }
    for i in range(MANY):
        objects[f"many/{i:05d}"] = f"{i}\n".encode()
    return objects


SEED = _seed()


@pytest.fixture(name="clients", scope="module")
def fixture_clients(s3_client: Any, file_s3_client: Any) -> dict[str, tuple[Any, str]]:
    """moto's client and file_s3's, each with a bucket seeded alike."""
    bucket = f"same-{uuid.uuid4().hex[:12]}"
    seeded = {}
    for name, client in (("moto", s3_client), ("file_s3", file_s3_client)):
        client.create_bucket(Bucket=bucket)
        with ThreadPoolExecutor(SEED_THREADS) as pool:
            puts = [
                pool.submit(client.put_object, Bucket=bucket, Key=key, Body=data)
                for key, data in SEED.items()
            ]
            for future in puts:
                future.result()
        seeded[name] = (client, bucket)
    return seeded


def _outcome(call: Callable[[], dict[str, Any]], fields: tuple[str, ...]) -> Any:
    """The fields of a response (a streamed body read), or its error code and status."""
    try:
        response = call()
    except ClientError as exc:
        return ("error", exc.response["Error"]["Code"], exc.response["ResponseMetadata"]["HTTPStatusCode"])
    return {field: response[field].read() if field == "Body" else response.get(field) for field in fields}


def _same_from_both(clients: dict[str, tuple[Any, str]], ask: Callable[[Any, str], Any]) -> Any:
    answers = {name: ask(client, bucket) for name, (client, bucket) in clients.items()}
    assert answers["file_s3"] == answers["moto"]
    return answers["moto"]


GET_FIELDS = ("Body", "ETag", "ContentLength", "ContentRange")


@pytest.mark.parametrize(
    "request_args",
    [
        {"Key": "big.bin"},
        {"Key": "big.bin", "Range": "bytes=0-0"},
        {"Key": "big.bin", "Range": f"bytes={1 << 20}-{(2 << 20) - 1}"},
        {"Key": "big.bin", "Range": f"bytes={BIG - 10}-{BIG + 100}"},
        {"Key": "big.bin", "Range": f"bytes={BIG - 10}-"},
        {"Key": "big.bin", "Range": "bytes=-7"},
        {"Key": "big.bin", "Range": "bytes=-0"},
        {"Key": "big.bin", "Range": "bytes=-99999999"},
        {"Key": "top.txt", "Range": "bytes=3-2"},  # not a range: the whole object
        {"Key": "top.txt", "Range": "bytes=0-0,2-3"},  # several ranges: the whole object
        {"Key": "big.bin", "Range": f"bytes={BIG}-{BIG + 10}"},  # past the end: 416
        {"Key": "empty.bin"},
        {"Key": "empty.bin", "Range": "bytes=0-9"},
        {"Key": "spaces/a b+c.txt"},
        {"Key": "unicode/naïve-数据.txt", "Range": "bytes=2-"},
        {"Key": "dir/"},
        {"Key": "x"},
        {"Key": "missing"},
        {"Key": "big.bin", "IfMatch": '"0123"'},
        {"Key": "big.bin", "IfMatch": '"0123"', "Range": f"bytes={BIG}-"},  # If-Match comes first
    ],
)
def test_get_answers_as_moto_does(clients: dict[str, tuple[Any, str]], request_args: dict[str, str]) -> None:
    _same_from_both(
        clients,
        lambda client, bucket: _outcome(lambda: client.get_object(Bucket=bucket, **request_args), GET_FIELDS),
    )


def test_preconditions_on_the_current_etag(clients: dict[str, tuple[Any, str]]) -> None:
    def ask(client: Any, bucket: str) -> Any:
        etag = client.head_object(Bucket=bucket, Key="top.txt")["ETag"]
        return [
            _outcome(lambda: client.get_object(Bucket=bucket, Key="top.txt", IfMatch=etag), GET_FIELDS),
            _outcome(lambda: client.get_object(Bucket=bucket, Key="top.txt", IfNoneMatch=etag), GET_FIELDS),
            _outcome(lambda: client.head_object(Bucket=bucket, Key="top.txt", IfMatch='"0"'), ()),
        ]

    assert _same_from_both(clients, ask)[2] == ("error", "412", 412)


@pytest.mark.parametrize("key", ["big.bin", "empty.bin", "dir/", "missing"])
def test_head_answers_as_moto_does(clients: dict[str, tuple[Any, str]], key: str) -> None:
    _same_from_both(
        clients,
        lambda client, bucket: _outcome(
            lambda: client.head_object(Bucket=bucket, Key=key), ("ETag", "ContentLength")
        ),
    )


def test_missing_bucket_is_no_such_bucket(clients: dict[str, tuple[Any, str]]) -> None:
    def ask(client: Any, bucket: str) -> Any:
        missing = f"{bucket}-missing"
        return [
            _outcome(lambda: client.get_object(Bucket=missing, Key="k"), ()),
            _outcome(lambda: client.list_objects_v2(Bucket=missing), ()),
            _outcome(lambda: client.put_object(Bucket=missing, Key="k", Body=b"x"), ()),
            _outcome(lambda: client.head_bucket(Bucket=missing), ()),
        ]

    assert _same_from_both(clients, ask)[0] == ("error", "NoSuchBucket", 404)


def _pages(client: Any, bucket: str, **request: Any) -> list[dict[str, Any]]:
    """Every page of a listing, its opaque continuation tokens left out."""
    pages = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, **request):
        pages.append(
            {
                "KeyCount": page["KeyCount"],
                "IsTruncated": page["IsTruncated"],
                "Prefix": page.get("Prefix"),
                "Delimiter": page.get("Delimiter"),
                "MaxKeys": page["MaxKeys"],
                "Contents": [(o["Key"], o["Size"], o["ETag"]) for o in page.get("Contents", [])],
                "CommonPrefixes": [p["Prefix"] for p in page.get("CommonPrefixes", [])],
            }
        )
    return pages


@pytest.mark.parametrize(
    "request_args",
    [
        {},
        {"Delimiter": "/"},
        {"Delimiter": "/", "PaginationConfig": {"PageSize": 3}},
        {"Prefix": "many/"},
        {"Prefix": "many/", "Delimiter": "/"},
        {"Prefix": "a/", "Delimiter": "/"},
        {"Prefix": "x", "Delimiter": "/"},
        {"Prefix": "x/", "Delimiter": "/"},
        {"Prefix": "dir/", "Delimiter": "/"},
        {"Prefix": "unicode/", "Delimiter": "/"},
        {"Prefix": "nope/", "Delimiter": "/"},
        {"Prefix": "a/", "PaginationConfig": {"PageSize": 1}},
        {"StartAfter": "many/01000", "Prefix": "many/"},
        {"MaxKeys": 0},
        {"Delimiter": "-"},
        {"Prefix": "a/", "Delimiter": "b", "PaginationConfig": {"PageSize": 1}},
    ],
)
def test_listing_pages_as_moto_does(
    clients: dict[str, tuple[Any, str]], request_args: dict[str, Any]
) -> None:
    pages = _same_from_both(clients, lambda client, bucket: _pages(client, bucket, **request_args))
    assert pages


def test_a_large_directory_takes_two_pages(clients: dict[str, tuple[Any, str]]) -> None:
    client, bucket = clients["file_s3"]
    pages = _pages(client, bucket, Prefix="many/", Delimiter="/")
    assert [page["KeyCount"] for page in pages] == [1000, MANY - 1000]


def test_delete_answers_as_moto_does(clients: dict[str, tuple[Any, str]]) -> None:
    def ask(client: Any, bucket: str) -> Any:
        client.put_object(Bucket=bucket, Key="scratch/gone", Body=b"soon gone")
        return [
            _outcome(lambda: client.delete_object(Bucket=bucket, Key="scratch/gone"), ()),
            _outcome(lambda: client.get_object(Bucket=bucket, Key="scratch/gone"), ()),
            _outcome(lambda: client.delete_object(Bucket=bucket, Key="scratch/never"), ()),
        ]

    assert _same_from_both(clients, ask)[1] == ("error", "NoSuchKey", 404)


# -- obstore ------------------------------------------------------------------------


@pytest.fixture(name="data_client", scope="module")
def fixture_data_client(file_s3_server: FileS3Server, clients: dict[str, tuple[Any, str]]) -> ObstoreS3:
    """obstore, as the daemon makes it, on the seeded file_s3 bucket."""
    _, bucket = clients["file_s3"]
    return ObstoreS3(
        bucket,
        endpoint=file_s3_server.endpoint_url,
        region="us-east-1",
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
        access_key_id="testing",
        secret_access_key="testing",
    )


# S3's smallest part but the last.
SMALLEST_PART = 5 << 20


def _etag_of(call: Callable[[], dict[str, Any]], *path: str) -> Any:
    """The etag a response holds at ``path``, or its error code and status."""
    try:
        response = call()
    except ClientError as exc:
        return ("error", exc.response["Error"]["Code"], exc.response["ResponseMetadata"]["HTTPStatusCode"])
    for name in path:
        response = response[name]
    return response["ETag"]


def test_multipart_uploads_answer_as_moto_does(clients: dict[str, tuple[Any, str]]) -> None:
    """Completion's rules (a small part but the last, a wrong etag), a
    refused completion that can be retried, the joined object."""
    big_part = bytes(range(256)) * (SMALLEST_PART // 256)

    def ask(client: Any, bucket: str) -> list[Any]:
        key = f"mpu/{uuid.uuid4().hex}"
        upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

        def part(number: int, body: bytes) -> Any:
            return _etag_of(
                lambda: client.upload_part(
                    Bucket=bucket, Key=key, UploadId=upload, PartNumber=number, Body=body
                )
            )

        def complete(parts: list[tuple[int, Any]]) -> Any:
            listed = {"Parts": [{"PartNumber": number, "ETag": etag} for number, etag in parts]}
            return _etag_of(
                lambda: client.complete_multipart_upload(
                    Bucket=bucket, Key=key, UploadId=upload, MultipartUpload=listed
                )
            )

        small, last = part(1, b"small"), part(2, b"last")
        answers = [small, last, complete([(1, small), (2, last)]), complete([(1, small), (2, '"0123"')])]
        big = part(1, big_part)
        answers += [big, complete([(1, big), (2, last)])]
        answers.append(_outcome(lambda: client.get_object(Bucket=bucket, Key=key), GET_FIELDS))
        return answers

    answers = _same_from_both(clients, ask)
    assert answers[5].endswith('-2"')


def test_copies_answer_as_moto_does(clients: dict[str, tuple[Any, str]]) -> None:
    """CopyObject, pinned or not, and UploadPartCopy of a range."""

    def ask(client: Any, bucket: str) -> list[Any]:
        source = {"Bucket": bucket, "Key": "big.bin"}
        etag = client.head_object(Bucket=bucket, Key="big.bin")["ETag"]
        key = f"copies/{uuid.uuid4().hex}"
        answers = [
            _etag_of(
                lambda: client.copy_object(Bucket=bucket, Key=key, CopySource=source), "CopyObjectResult"
            ),
            _etag_of(
                lambda: client.copy_object(Bucket=bucket, Key=key, CopySource=source, CopySourceIfMatch=etag),
                "CopyObjectResult",
            ),
            _etag_of(
                lambda: client.copy_object(
                    Bucket=bucket, Key=key, CopySource={"Bucket": bucket, "Key": "missing"}
                ),
                "CopyObjectResult",
            ),
        ]
        answers.append(_outcome(lambda: client.get_object(Bucket=bucket, Key=key), GET_FIELDS))
        upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        answers.append(
            _etag_of(
                lambda: client.upload_part_copy(
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload,
                    PartNumber=1,
                    CopySource=source,
                    CopySourceRange="bytes=10-1000",
                ),
                "CopyPartResult",
            )
        )
        client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
        return answers

    _same_from_both(clients, ask)


def test_refuses_as_s3_does_where_moto_does_not(clients: dict[str, tuple[Any, str]]) -> None:
    """A copy pinned to another version (moto 5 copies all the same) and a
    part of an aborted upload (moto answers 500)."""
    client, bucket = clients["file_s3"]
    source = {"Bucket": bucket, "Key": "big.bin"}
    upload = client.create_multipart_upload(Bucket=bucket, Key="aborted")["UploadId"]
    client.upload_part(Bucket=bucket, Key="aborted", UploadId=upload, PartNumber=1, Body=b"doomed")
    client.abort_multipart_upload(Bucket=bucket, Key="aborted", UploadId=upload)

    pinned = _etag_of(
        lambda: client.copy_object(Bucket=bucket, Key="pinned", CopySource=source, CopySourceIfMatch='"0"'),
        "CopyObjectResult",
    )
    aborted = _etag_of(
        lambda: client.upload_part(Bucket=bucket, Key="aborted", UploadId=upload, PartNumber=1, Body=b"x")
    )

    assert pinned == ("error", "PreconditionFailed", 412)
    assert aborted == ("error", "NoSuchUpload", 404)


def test_obstore_reads_whole_and_ranged(data_client: ObstoreS3) -> None:
    big = SEED["big.bin"]
    whole = obstore.get(data_client, "big.bin")
    etag = whole.meta["e_tag"]
    assert bytes(whole.bytes()) == big
    part = obstore.get(data_client, "big.bin", options={"range": (1 << 20, 2 << 20), "if_match": etag})
    assert bytes(part.bytes()) == big[1 << 20 : 2 << 20]
    assert bytes(obstore.get_range(data_client, "big.bin", start=BIG - 5, end=BIG)) == big[-5:]
    assert obstore.head(data_client, "big.bin")["size"] == BIG


def test_obstore_sees_preconditions_and_missing_keys(data_client: ObstoreS3) -> None:
    with pytest.raises(PreconditionError):
        obstore.get(data_client, "big.bin", options={"if_match": '"0123"'})
    with pytest.raises(FileNotFoundError):  # obstore raises Python's for 404
        obstore.get(data_client, "missing")
    with pytest.raises(FileNotFoundError):  # obstore raises Python's for 404
        obstore.head(data_client, "missing")


def test_obstore_lists_past_a_page_and_writes(data_client: ObstoreS3) -> None:
    listed = [meta["path"] for batch in obstore.list(data_client, "many/") for meta in batch]
    assert listed == [f"many/{i:05d}" for i in range(MANY)]
    obstore.put(data_client, "scratch/obstore.bin", b"written by obstore")
    assert bytes(obstore.get(data_client, "scratch/obstore.bin").bytes()) == b"written by obstore"


# -- what only plain HTTP shows -----------------------------------------------------------


def _http(server: FileS3Server, method: str, path: str, headers: dict[str, str] | None = None) -> Any:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        connection.request(method, path, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


@pytest.mark.parametrize("path", ["a/../b", "..", "a/./b", "/abs", "nul%00byte", "k" * 1025])
def test_keys_that_could_not_be_file_names_are_refused(
    file_s3_server: FileS3Server, clients: dict[str, tuple[Any, str]], path: str
) -> None:
    _, bucket = clients["file_s3"]
    for method in ("PUT", "GET"):
        status, _, body = _http(file_s3_server, method, f"/{bucket}/{path}", {"Content-Length": "0"})
        assert status == 400
        assert b"<Code>InvalidArgument</Code>" in body


def test_ranges_are_answered_with_their_bytes(
    file_s3_server: FileS3Server, clients: dict[str, tuple[Any, str]]
) -> None:
    _, bucket = clients["file_s3"]
    status, headers, body = _http(file_s3_server, "GET", f"/{bucket}/big.bin", {"Range": "bytes=100-199"})
    assert (status, headers["Content-Range"], body) == (206, f"bytes 100-199/{BIG}", SEED["big.bin"][100:200])
    status, _, body = _http(file_s3_server, "GET", f"/{bucket}/big.bin", {"Range": f"bytes={BIG}-"})
    assert status == 416
    assert b"<Code>InvalidRange</Code>" in body


def test_one_connection_serves_many_requests(
    file_s3_server: FileS3Server, clients: dict[str, tuple[Any, str]]
) -> None:
    _, bucket = clients["file_s3"]
    connection = http.client.HTTPConnection(file_s3_server.host, file_s3_server.port, timeout=10)
    try:
        for start in range(0, 1 << 20, 1 << 18):
            connection.request("GET", f"/{bucket}/big.bin", headers={"Range": f"bytes={start}-{start + 9}"})
            assert connection.getresponse().read() == SEED["big.bin"][start : start + 10]
        connection.request("GET", f"/{bucket}/missing")
        assert connection.getresponse().read().startswith(b"<?xml")
        connection.request("GET", f"/{bucket}/top.txt")
        assert connection.getresponse().read() == SEED["top.txt"]
    finally:
        connection.close()


# -- the server's own API -------------------------------------------------------------------


@pytest.fixture(name="own_server")
def fixture_own_server(tmp_path: Path) -> Iterator[FileS3Server]:
    server = FileS3Server(tmp_path / "root")
    server.start()
    yield server
    server.stop()


def test_counts_by_kind_as_the_moto_server_does(own_server: FileS3Server) -> None:
    client = boto3.client("s3", endpoint_url=own_server.endpoint_url, region_name="us-east-1")
    client.create_bucket(Bucket="counted")
    own_server.reset_counts()
    client.put_object(Bucket="counted", Key="k", Body=b"v")
    client.head_object(Bucket="counted", Key="k")
    client.get_object(Bucket="counted", Key="k")["Body"].read()
    client.list_objects_v2(Bucket="counted")

    assert own_server.counts() == {PUT_OBJECT: 1, HEAD_OBJECT: 1, GET_OBJECT: 1, LIST: 1, "total": 4}
    assert own_server.get_object_count == 1
    assert own_server.request_count == 4
    assert own_server.peak_in_flight(GET_OBJECT) == 1


def test_injects_latency(own_server: FileS3Server) -> None:
    latency = 0.3
    own_server.latency_seconds = latency
    began = time.monotonic()
    status, _, _ = _http(own_server, "HEAD", "/no-such-bucket")
    assert status == 404
    assert time.monotonic() - began >= latency


def test_objects_outlive_a_restart_and_a_new_server(own_server: FileS3Server) -> None:
    client = boto3.client("s3", endpoint_url=own_server.endpoint_url, region_name="us-east-1")
    client.create_bucket(Bucket="kept")
    client.put_object(Bucket="kept", Key="k", Body=b"version one")
    client.put_object(Bucket="kept", Key="k", Body=b"version two")
    own_server.stop()
    own_server.start()
    assert client.get_object(Bucket="kept", Key="k")["Body"].read() == b"version two"
    own_server.stop()

    objects = own_server.root / "objects"
    (objects / "left-by-a-crash").write_bytes(b"orphan")
    with FileS3Server(own_server.root) as again:
        other = boto3.client("s3", endpoint_url=again.endpoint_url, region_name="us-east-1")
        assert other.get_object(Bucket="kept", Key="k")["Body"].read() == b"version two"
    assert len(list(objects.iterdir())) == 1  # the current version's file alone

"""The S3 server the object-storage tests use is real and answers like S3: signed requests only,
byte ranges, 404 for a missing key, and it stops without leaving a process."""

from __future__ import annotations

import os

import obstore
import pytest

from tests.support.processes import group_pids

pytestmark = [pytest.mark.slow, pytest.mark.parallel]  # a real SeaweedFS: about 2 s to start, 2 s to stop


def test_s3_answers_signed_requests_with_ranges(s3):
    store = s3.store()
    data = os.urandom(3 << 20)
    obstore.put(store, "check/blob.bin", data)
    assert bytes(obstore.get_range(store, "check/blob.bin", start=1000, end=1000 + (1 << 20))) == \
        data[1000:1000 + (1 << 20)]
    with pytest.raises(FileNotFoundError):
        obstore.get(store, "check/missing.bin")


def test_s3_refuses_wrong_keys(s3):
    from obstore.store import S3Store
    wrong = S3Store(s3.bucket, endpoint=s3.endpoint, access_key_id=s3.access_key, secret_access_key="wrong" * 8,
                    region="us-east-1", virtual_hosted_style_request=False,
                    client_options={"allow_http": True}, retry_config={"max_retries": 0})
    with pytest.raises(Exception, match="403|SignatureDoesNotMatch|AccessDenied"):
        obstore.put(wrong, "check/denied.bin", b"x")


def test_stop_leaves_no_process_and_no_socket(tmp_path):
    """weed leaves its UNIX sockets: those it lets us place in a directory of the server's, its
    gRPC ones in /tmp, named by the server's ports; all go with it."""
    from tests.support.s3_server import SeaweedS3
    server = SeaweedS3(tmp_path).start()
    pgid, tmp, grpc = server.proc.pid, server.tmp, server.grpc_sockets()
    try:
        assert sorted(p.name for p in tmp.iterdir() if p.is_socket()) == ["filer.sock", "s3.sock"]
        assert [p for p in grpc if p.is_socket()], f"none of {grpc} made: weed names them otherwise now"
    finally:
        server.stop()
    assert group_pids(pgid) == []
    assert not tmp.exists() and not [p for p in grpc if p.exists()]

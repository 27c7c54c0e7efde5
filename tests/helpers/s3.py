"""An S3-compatible server (moto) on loopback, for the store's object-store tests; the
fixtures `s3_endpoint` and `emulator` (tests/conftest.py) start it."""

from __future__ import annotations

import logging
import os
import socket

CREDENTIALS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_ENDPOINT_URL",
    "AWS_DEFAULT_REGION",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_s3(bucket: str):
    """A moto S3 server on a free loopback port holding an empty `bucket`, and s3fs's
    credentials and endpoint in this process's environment (inherited by the processes it
    starts). Returns (server, endpoint); `server.stop()` ends it. Used by the tests'
    `s3_endpoint` fixture and by the benchmarks that run on an object store."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ACCESS_KEY_ID="test",
        AWS_SECRET_ACCESS_KEY="test",
        AWS_ENDPOINT_URL=endpoint,
        AWS_DEFAULT_REGION="us-east-1",
    )
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return server, endpoint


class Emulator:
    """A moto server on a fixed loopback port that can go away and come back (its
    buckets live in this process, so they survive a restart)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()

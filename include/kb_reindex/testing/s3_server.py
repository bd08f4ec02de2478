"""moto's S3 server (`ThreadedMotoServer`, real HTTP on 127.0.0.1, a free port) with what the tests need around it:
every request recorded (method, bucket, key, query, status), and the credentials it accepts.

moto itself accepts any key; here a request signed with an access key id outside `access_keys` is answered as
S3 answers it, 403 `InvalidAccessKeyId`, so a wrong key is refused over the wire. The product never imports this.

    with MotoS3Server(access_keys={"kb-test"}) as s3:
        s3.client().create_bucket(Bucket="knowledge")
        ...
        s3.object_gets()   # GETs of objects (not listings)
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from moto.server import ThreadedMotoServer

REGION = "us-east-1"
_CREDENTIAL = re.compile(r"Credential=([^/]+)/")


@dataclass(frozen=True)
class S3Request:
    method: str
    bucket: str
    key: str  # '' for a request to the bucket itself (a listing, a HEAD of the bucket)
    query: str
    status: int
    #: the access key id the request was signed with ('' unsigned)
    access_key: str = ""

    @property
    def object_get(self) -> bool:
        """A GET of an object's content (a listing is a GET of the bucket)."""
        return self.method == "GET" and bool(self.key)


class MotoS3Server:
    def __init__(self, *, access_keys: Iterable[str] = ("kb-test",)) -> None:
        self.access_keys = set(access_keys)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._requests: list[S3Request] = []
        self._guard = threading.Lock()
        self.url = ""

    def __enter__(self) -> MotoS3Server:
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.url = f"http://{host}:{port}"
        wsgi = self._server._server
        assert wsgi is not None
        wsgi.app = self._recording(wsgi.app)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop()

    def _recording(self, app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
        def handle(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            # WSGI's PATH_INFO: percent-decoded, its UTF-8 bytes as latin-1 characters
            path = environ.get("PATH_INFO", "").encode("latin-1").decode("utf-8", "replace")
            bucket, _, key = path.lstrip("/").partition("/")
            method, query = environ["REQUEST_METHOD"], environ.get("QUERY_STRING", "")
            signed = _CREDENTIAL.search(environ.get("HTTP_AUTHORIZATION", ""))
            access_key = signed.group(1) if signed else ""
            if not bucket.startswith("moto-api") and access_key not in self.access_keys:
                self._record(S3Request(method, bucket, key, query, 403, access_key))
                body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidAccessKeyId</Code><Message>The AWS '
                        b'Access Key Id you provided does not exist in our records.</Message></Error>')
                start_response("403 Forbidden", [("Content-Type", "application/xml"),
                                                  ("Content-Length", str(len(body)))])
                return [body]
            status: list[int] = []

            def start(line: str, headers: list[tuple[str, str]], *rest: Any) -> Any:
                status.append(int(line.split()[0]))
                return start_response(line, headers, *rest)

            answer = app(environ, start)
            self._record(S3Request(method, bucket, key, query, status[0] if status else 0, access_key))
            return answer

        return handle

    def _record(self, request: S3Request) -> None:
        with self._guard:
            self._requests.append(request)

    def requests(self) -> list[S3Request]:
        with self._guard:
            return list(self._requests)

    def clear_requests(self) -> None:
        with self._guard:
            self._requests.clear()

    def object_gets(self) -> list[S3Request]:
        return [r for r in self.requests() if r.object_get]

    def env(self, access_key: str | None = None, secret: str = "kb-test-secret") -> dict[str, str]:
        """The standard AWS environment that points boto3, s3fs and the CLI at this server."""
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": access_key or sorted(self.access_keys)[0],
                "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": REGION}

    def client(self) -> Any:
        """A boto3 S3 client of an accepted key, for a test to create buckets and put objects."""
        import boto3

        env = self.env()
        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=REGION)


def upload_folder(client: Any, bucket: str, prefix: str, files: Iterator[tuple[str, bytes]]) -> None:
    """Put each (name, bytes) under `prefix/`."""
    for name, data in files:
        client.put_object(Bucket=bucket, Key=f"{prefix.strip('/')}/{name}" if prefix else name, Body=data)

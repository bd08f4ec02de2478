"""Knowledge in object storage: `s3://bucket/prefix` sources, the CLI's filesystem from the standard AWS
environment, and what a failing bucket means, in one line.

fsspec's filesystem API is the one way documents are listed and read (`sources.KnowledgeSource`). A DAG task
hands down the filesystem of Airflow's `ObjectStoragePath` (the Amazon provider's s3fs, credentials from an
Airflow Connection); the CLI makes s3fs's own from `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION` (botocore's usual chain). Nothing here imports Airflow.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kb_reindex.domain.errors import (
    ConfigError,
    KbError,
    KnowledgeFolderMissing,
    SourceRefused,
    SourceUnreachable,
    causes,
    connect_failure,
)

#: the schemes a source URI may have: the Amazon provider's filesystem (and s3fs) serve them
REMOTE_SCHEMES = ("s3",)
#: S3's bucket naming rules (3-63 of lower-case letters, digits, dots and hyphens)
BUCKET_PATTERN = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
#: the answers of a store that refuses the credentials (or their permission) rather than the request
REFUSED_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
                           "InvalidToken", "InvalidClientTokenId", "AllAccessDisabled", "AccountProblem",
                           "403", "401"})
MISSING_BUCKET_CODES = frozenset({"NoSuchBucket"})
#: botocore's names for a request that never got an answer (no import of botocore needed to tell them)
UNANSWERED = frozenset({"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
                        "ClientConnectorError", "ServerTimeoutError", "ServerDisconnectedError"})
CLI_CREDENTIALS = "the AWS environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL)"


@dataclass(frozen=True)
class BucketLocation:
    """`s3://bucket/prefix` taken apart: the prefix without leading or trailing `/` ('' for the whole bucket)."""

    scheme: str
    bucket: str
    prefix: str

    @property
    def uri(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}" if self.prefix else f"{self.scheme}://{self.bucket}"

    @property
    def root(self) -> str:
        """The folder in fsspec's terms: `bucket/prefix`."""
        return f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket


@dataclass(frozen=True)
class BucketAccess:
    """How a bucket is reached when the caller (an Airflow task) has its own way: the filesystem for a URI
    (ObjectStoragePath's, credentials from a Connection), made when first needed, and the words a refusal
    names those credentials by."""

    filesystem: Callable[[str], Any]
    credentials: str


def is_uri(value: str) -> bool:
    """A source given as `<scheme>://...` rather than a local path."""
    return re.match(r"^[A-Za-z][A-Za-z0-9+.\-]*://", value.strip()) is not None


def parse_bucket_uri(value: str, *, setting: str = "KB_KNOWLEDGE_DIR") -> BucketLocation:
    """`s3://bucket[/prefix]`, checked; every mistake names the setting and the value (never credentials)."""
    raw = value.strip()
    scheme = raw.split("://", 1)[0].lower()
    if scheme not in REMOTE_SCHEMES:
        raise ConfigError(f"{setting}={raw.split('@')[-1]!r}: a knowledge source is a local folder or "
                          f"{' or '.join(s + '://bucket/prefix' for s in REMOTE_SCHEMES)}, not {scheme}://")
    parts = urlsplit(raw)
    if "@" in parts.netloc:
        raise ConfigError(f"{setting}: the URI {scheme}://...@{parts.netloc.split('@')[-1]} holds credentials; put "
                          "them in the Airflow Connection (aws_conn_id) or the AWS environment, not the URI")
    if parts.query or parts.fragment:
        raise ConfigError(f"{setting}={raw!r}: a bucket URI takes no ?query or #fragment")
    bucket = parts.netloc
    if not BUCKET_PATTERN.match(bucket) or ".." in bucket:
        raise ConfigError(f"{setting}={raw!r}: {bucket!r} is not an S3 bucket name (3-63 lower-case letters, "
                          "digits, '.' or '-')")
    return BucketLocation(scheme=scheme, bucket=bucket, prefix=parts.path.strip("/"))


def env_filesystem(env: Mapping[str, str] | None = None) -> Any:
    """s3fs's filesystem for the CLI: endpoint from AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, credentials and
    region by botocore's chain (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, profiles). A new
    instance each time: credentials are read when it first connects, never from an older process state."""
    env = os.environ if env is None else env
    try:
        import s3fs
    except ImportError:
        raise ConfigError("an s3:// knowledge source needs s3fs: pip install 'kb-reindex[s3]' (or the "
                          "airflow extra, whose Amazon provider brings it)") from None
    endpoint = (env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or "").strip() or None
    return s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)


def endpoint_of(fs: Any) -> str:
    """The endpoint a filesystem talks to, for messages: its configured URL, or AWS's own."""
    url = getattr(fs, "endpoint_url", None) or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
    return str(url).split("@")[-1] if url else "AWS's S3 endpoint"


def _code(exc: BaseException) -> str | None:
    """botocore's error code (or HTTP status, for an answer without a body such as HEAD's)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    code = (response.get("Error") or {}).get("Code")
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return str(code or status or "") or None


def bucket_failure(exc: BaseException, *, location: BucketLocation, fs: Any, credentials: str) -> KbError | None:
    """What a failed listing or read of the bucket means, in one line naming the source, the bucket and the
    cause (never a secret), as the error to raise: a missing bucket or refused credentials is a setting to
    fix (exit 2), an endpoint that does not answer is unavailable (exit 3). None: not the bucket's failure
    (an object gone since the listing, a bug): the caller decides."""
    where = f"knowledge source {location.uri}"
    for cause in causes(exc):
        code = _code(cause)
        if code in MISSING_BUCKET_CODES:
            return KnowledgeFolderMissing(f"{where}: bucket {location.bucket} does not exist at {endpoint_of(fs)}; "
                                          "check the bucket name (KB_KNOWLEDGE_DIR, or the registry entry's source)")
        if code in REFUSED_CODES:
            return SourceRefused(f"{where}: bucket {location.bucket} refused the credentials of {credentials} "
                                 f"({code}); check the key and its permission to list and read the bucket")
    for cause in causes(exc):
        if type(cause).__name__ in UNANSWERED or isinstance(cause, (ConnectionError, TimeoutError)):
            what = connect_failure(exc) or "no answer"
            return SourceUnreachable(f"{where}: the S3 endpoint {endpoint_of(fs)} does not answer ({what}); bucket "
                                     f"{location.bucket} was not read, nothing was planned and the live alias "
                                     "was not touched")
    return None

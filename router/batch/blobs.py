"""Where the bytes of files live: a local directory or a bucket, through obstore.

`batch.storage` in regions.yaml names the place (`open_blob_store`):

    local                   $GLOBALPOOL_FILES_DIR, else ~/.local/share/globalpool/files
    file:///absolute/path   that directory (shared storage: every replica mounts it)
    s3://bucket[/prefix]    credentials, region and endpoint from AWS_* variables
    gs://bucket[/prefix]    credentials from GOOGLE_* variables

obstore (Rust's object_store) runs every call on its own threads: the async variants
used here never block the event loop. A backend's failure is raised as `BlobStoreError`,
whose message is fit for a client (it names no path, bucket or backend text); the
backend's own error is logged for the operator.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import obstore
from obstore.exceptions import NotFoundError
from obstore.store import GCSStore, LocalStore, S3Store

if TYPE_CHECKING:
    from obstore.store import ObjectStore, RetryConfig

log = logging.getLogger("globalpool.files")

FILES_DIR_ENV = "GLOBALPOOL_FILES_DIR"
DEFAULT_FILES_DIR = Path("~/.local/share/globalpool/files")
# A streamed upload goes to the backend in parts of this size (S3's smallest part is
# 5 MiB), at most this many at once: an upload holds at most ~15 MiB of memory (the part
# being filled, and those being sent), whatever its size.
PART_BYTES = 5 * 1024 * 1024
PARTS_AT_ONCE = 2
# A blob is read in ranges of this size, one request each: a bucket's request must end
# within obstore's timeout (30 s), whatever the file's size and however slowly the client
# reading it takes each range. (Its other client settings are left as the environment
# sets them: AWS_ALLOW_HTTP and the like; passing any would replace them all.)
READ_RANGE_BYTES = 4 * 1024 * 1024
# A bucket that is down is given up on after ~20 s of retries, not obstore's 3 minutes.
_RETRIES: RetryConfig = {"max_retries": 3, "retry_timeout": timedelta(seconds=20)}

T = TypeVar("T")


class BlobStoreError(Exception):
    """The blob store failed (unreachable, refused, misconfigured). The message is safe to
    show a client; the cause was logged."""


class BlobNotFound(BlobStoreError):
    """No blob at that key (a record whose content was lost, or storage not shared)."""


def open_blob_store(storage: str) -> BlobStore:
    """The blob store that `batch.storage` names (see the module doc). A local directory
    is created (mode 0700) if missing; a bucket is not contacted until first used."""
    if storage == "local":
        directory = Path(os.environ.get(FILES_DIR_ENV) or DEFAULT_FILES_DIR).expanduser()
        return BlobStore(_local_store(directory), where="local")
    if storage.startswith("file:///"):
        return BlobStore(_local_store(Path(storage.removeprefix("file://"))), where="file")
    scheme, _, rest = storage.partition("://")
    bucket, _, path = rest.partition("/")
    prefix = path.strip("/") or None
    if scheme == "s3" and bucket:
        return BlobStore(S3Store(bucket, prefix=prefix, retry_config=_RETRIES), where="s3")
    if scheme == "gs" and bucket:
        return BlobStore(GCSStore(bucket, prefix=prefix, retry_config=_RETRIES), where="gs")
    raise ValueError(f"batch.storage: {storage[:80]!r} is not 'local', file:///absolute/path, "
                     "s3://bucket[/prefix] or gs://bucket[/prefix]")


def _local_store(directory: Path) -> LocalStore:
    """A directory only this user can read (the files are tenants' data)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return LocalStore(directory)


class BlobStore:
    """Bytes by key. `where` names the kind of backend in logs ("local", "s3", ...)."""

    def __init__(self, store: ObjectStore, *, where: str) -> None:
        self._store = store
        self.where = where

    async def put_stream(self, key: str, chunks: AsyncIterable[bytes]) -> int:
        """Write what `chunks` yields to `key` as it comes (a multipart upload: never the
        whole in memory); the number of bytes written. Atomic: on failure nothing is left
        at `key`. An exception raised by `chunks` itself (an upload over its limit, a
        client gone) propagates as it is; the backend's as BlobStoreError."""
        source = _CountedSource(chunks)
        try:
            await obstore.put_async(self._store, key, source.chunks(),
                                    use_multipart=True, chunk_size=PART_BYTES,
                                    max_concurrency=PARTS_AT_ONCE)
        except Exception as exc:
            if exc is source.failure:
                raise
            raise self._failure("write", key, exc) from None
        return source.bytes

    async def put(self, key: str, data: bytes) -> None:
        """Write `data` to `key` (replacing what was there)."""
        await self._call("write", key, lambda: obstore.put_async(
            self._store, key, data, chunk_size=PART_BYTES, max_concurrency=PARTS_AT_ONCE))

    async def get(self, key: str) -> bytes:
        """The whole blob at `key`. Raises BlobNotFound, BlobStoreError."""
        return b"".join([chunk async for chunk in await self.stream(key)])

    async def stream(self, key: str) -> AsyncIterator[bytes]:
        """The blob at `key` in chunks of READ_RANGE_BYTES, found before this returns (so
        that a missing blob raises BlobNotFound here, before an answer has started); a
        failure later raises BlobStoreError from the iterator."""
        meta = await self._call("read", key, lambda: obstore.head_async(self._store, key))
        return self._ranges(key, meta["size"])

    async def _ranges(self, key: str, size_bytes: int) -> AsyncIterator[bytes]:
        for start in range(0, size_bytes, READ_RANGE_BYTES):
            end = min(start + READ_RANGE_BYTES, size_bytes)
            piece = await self._call("read", key, functools.partial(
                obstore.get_range_async, self._store, key, start=start, end=end))
            yield bytes(piece)

    async def delete(self, key: str) -> None:
        """Remove the blob at `key`; one that is not there is no error."""
        with contextlib.suppress(BlobNotFound):
            await self._call("delete", key, lambda: obstore.delete_async(self._store, key))

    async def _call(self, action: str, key: str, call: Callable[[], Awaitable[T]]) -> T:
        """`call()` awaited, its failure raised as BlobStoreError (or BlobNotFound); made
        inside the `try`: obstore checks a key as the call is made (a `..` segment)."""
        try:
            return await call()
        except Exception as exc:
            raise self._failure(action, key, exc) from None

    def _failure(self, action: str, key: str, exc: Exception) -> BlobStoreError:
        if isinstance(exc, FileNotFoundError | NotFoundError):
            return BlobNotFound(f"the stored content of {_file_name(key)} is missing")
        log.warning("file storage (%s): %s of %s failed: %s", self.where, action, key,
                    str(exc).split("\n", 1)[0][:500])
        return BlobStoreError(f"file storage is unavailable ({action} failed)")


def _file_name(key: str) -> str:
    """The file id in a key (`files/<id>`), never a path."""
    return key.rpartition("/")[2]


class _CountedSource:
    """An upload's chunks on their way to the backend: counted, and the exception the
    source raised remembered (to tell it from the backend's own)."""

    def __init__(self, chunks: AsyncIterable[bytes]) -> None:
        self._chunks = chunks
        self.bytes = 0
        self.failure: BaseException | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._chunks:
                self.bytes += len(chunk)
                yield chunk
        except BaseException as exc:
            self.failure = exc
            raise

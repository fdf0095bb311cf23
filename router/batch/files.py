"""Files: their records in Redis, their bytes in the blob store (`router.batch.blobs`).

    <prefix>:file:<id>        JSON record {id, owner, filename, purpose, bytes, created_at}
    <prefix>:files:<owner>    sorted set of the owner's file ids, scored by creation time in
                              microseconds (files made within one second keep their
                              order); owner "-": no API keys configured

A file belongs to the tenant of the API key that uploaded it (None when the router has no
keys): every lookup takes the owner, and a file of someone else is, to the caller, a file
that does not exist. The bytes live at `files/<id>` in the blob store, written before the
record (a record never names content that is not there yet) and deleted before it (a
delete that fails halfway can be retried, and leaves no content without its record).

The record is also kept beside the bytes (`records/<id>.json`, signed alike): a Redis
back empty (no persistence, a failover to an empty replica) lost every record, and a file
looked up by id is then found there and put back in Redis (`get`; its owner's listing
regains it then), so that a finished batch's output stays readable.

Redis being unreachable raises `FilesUnavailable` (the client is told to retry); the blob
store failing raises `router.batch.blobs.BlobStoreError`.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypeVar, cast

from pydantic import TypeAdapter, ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from router.batch.blobs import BlobNotFound, BlobStore, BlobStoreError
from worker.redis_client import raise_if_cancelling
from worker.signing import document_signed_by, sign_document

log = logging.getLogger("globalpool.files")

# What a client may upload with (OpenAI's list); they are all stored alike.
UPLOAD_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
# The batch runner's output and error files: clients read and delete them, never upload.
BATCH_OUTPUT = "batch_output"
MAX_FILENAME_CHARS = 255
MAX_LIST_LIMIT = 10_000  # OpenAI's bound (and default) for GET /v1/files?limit=
_ID_CHARS = 24  # after "file-": url-safe base64 of 18 random bytes
_VALID_ID = re.compile(rf"file-[A-Za-z0-9_-]{{{_ID_CHARS}}}")
_NO_OWNER = "-"
_MAX_RECORD_BYTES = 4096  # a record is ~250 bytes (filename included); larger is not ours
_LIST_BATCH = 500  # ids read from the sorted set at a time while filtering by purpose

Order = Literal["asc", "desc"]
T = TypeVar("T")


class FilesUnavailable(Exception):
    """Redis could not be asked: the file may well exist; retry later."""


class FileTooLarge(Exception):
    """An upload passed `max_bytes`; reading stopped there and nothing was kept."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"the file is larger than {max_bytes} bytes")
        self.max_bytes = max_bytes


class UnknownCursor(Exception):
    """`after` names no file of this owner (deleted meanwhile, or never theirs)."""


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One stored file. `owner`: the tenant that uploaded it (None: no API keys);
    `created_at`: Unix seconds."""

    id: str
    owner: str | None
    filename: str
    purpose: str
    size_bytes: int
    created_at: int
    lines: int = 0  # lines of text (a batch's requests are one a line), counted as it came

    def to_openai(self) -> dict[str, Any]:
        """The File object as OpenAI's API shows it (the owner is not shown)."""
        return {"id": self.id, "object": "file", "bytes": self.size_bytes,
                "created_at": self.created_at, "filename": self.filename,
                "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}

    def encode(self, key: tuple[str, bytes] | None = None) -> bytes:
        """The record as Redis keeps it; signed with `key` (id, secret) when given: its
        id and every field, owner included, under an HMAC-SHA256."""
        document: dict[str, Any] = asdict(self)
        if key is not None:
            sign_document(document, key)
        return json.dumps(document, separators=(",", ":")).encode()

    @staticmethod
    def decode(raw: bytes | str, keys: Mapping[str, bytes] | None = None
               ) -> FileRecord | None:
        """The record in `raw`, or None if it is not one of ours, well formed; with
        `keys` (heartbeat signing on), also signed by one of them: whoever can write to
        Redis could otherwise give a file another owner, who could then read it."""
        if len(raw) > _MAX_RECORD_BYTES:
            return None
        try:
            document = json.loads(raw)
        except (ValueError, RecursionError):
            return None
        if not isinstance(document, dict):
            return None
        if keys and not document_signed_by(document, keys):
            return None
        document.pop("key_id", None)
        document.pop("signature", None)
        try:  # (strict: JSON's types as they are, none coerced)
            return _RECORDS.validate_json(json.dumps(document), strict=True)
        except ValidationError:
            return None


_RECORDS = TypeAdapter(FileRecord)


@dataclass(frozen=True, slots=True)
class FilePage:
    """One page of an owner's files, and whether more follow it."""

    records: tuple[FileRecord, ...]
    has_more: bool

    def to_openai(self) -> dict[str, Any]:
        data = [record.to_openai() for record in self.records]
        return {"object": "list", "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": self.has_more}


@dataclass(frozen=True, slots=True)
class StagedFile:
    """Content written to the blob store that no record names yet (`FileStore.upload`):
    `commit` it, or `discard` it."""

    id: str
    size_bytes: int
    lines: int = 0


def line_count(data: bytes) -> int:
    """Lines in `data`: its newlines, and one more for a last line without one."""
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def new_file_id() -> str:
    return "file-" + secrets.token_urlsafe(_ID_CHARS * 3 // 4)


def valid_file_id(file_id: str) -> bool:
    return _VALID_ID.fullmatch(file_id) is not None


def clean_filename(filename: str | None) -> str:
    """The name a client gave its file, fit to keep and show: its last path component,
    without control characters, at most MAX_FILENAME_CHARS (the extension kept); "upload"
    when nothing is left."""
    name = (filename or "").replace("\\", "/").rpartition("/")[2]
    name = "".join(char for char in name if char.isprintable()).strip()
    if len(name) > MAX_FILENAME_CHARS:
        stem, dot, extension = name.rpartition(".")
        if dot and stem and len(extension) <= 16:
            name = stem[: MAX_FILENAME_CHARS - len(extension) - 1] + "." + extension
        else:
            name = name[:MAX_FILENAME_CHARS]
    return name if name not in ("", ".", "..") else "upload"


def record_blob_key(file_id: str) -> str:
    """Where a file's record is kept beside its bytes (see the module doc)."""
    return f"records/{blob_key(file_id).removeprefix('files/')}.json"


def blob_key(file_id: str) -> str:
    """Where a file's bytes are in the blob store. Raises BlobNotFound for an id that is
    not one this router makes (one read from Redis, which anyone who can write there can
    forge: never a path handed to the store)."""
    if not valid_file_id(file_id):
        raise BlobNotFound("no such file")
    return f"files/{file_id}"


class _Limited:
    """`chunks`, until they pass `max_bytes`: then FileTooLarge (nothing more is read);
    counting their lines as they pass."""

    def __init__(self, chunks: AsyncIterable[bytes], max_bytes: int) -> None:
        self._chunks = chunks
        self._max_bytes = max_bytes
        self.newlines = 0
        self.ends_with_newline = True

    async def __aiter__(self) -> AsyncIterator[bytes]:
        total = 0
        async for chunk in self._chunks:
            total += len(chunk)
            if total > self._max_bytes:
                raise FileTooLarge(self._max_bytes)
            if chunk:
                self.newlines += chunk.count(b"\n")
                self.ends_with_newline = chunk.endswith(b"\n")
            yield chunk

    @property
    def lines(self) -> int:
        return self.newlines + (0 if self.ends_with_newline else 1)


class FileStore:
    """Files by id and by owner (see the module doc). `clock`: Unix seconds."""

    def __init__(self, redis: Redis, prefix: str, blobs: BlobStore, *,
                 clock: Callable[[], float] = time.time,
                 keys: Mapping[str, bytes] | None = None) -> None:
        """`keys`: the heartbeat keys, when heartbeats are signed: records are signed with
        the first, and one none of them signed is not found (FileRecord.decode)."""
        self._redis = redis
        self._keys = dict(keys or {})
        self._signing_key = next(iter(self._keys.items()), None)
        self._prefix = prefix
        self.blobs = blobs
        self._clock = clock

    def record_key(self, file_id: str) -> str:
        return f"{self._prefix}:file:{file_id}"

    def owner_key(self, owner: str | None) -> str:
        return f"{self._prefix}:files:{_NO_OWNER if owner is None else owner}"

    async def count(self, owner: str | None) -> int:
        """How many files `owner` keeps (batch output included). Raises FilesUnavailable."""
        return int(await self._redis_call(self._redis.zcard(self.owner_key(owner))))

    async def create(self, owner: str | None, filename: str | None, purpose: str,
                     chunks: AsyncIterable[bytes], max_bytes: int) -> FileRecord:
        """Store what `chunks` yields as a new file of `owner`. Raises FileTooLarge past
        `max_bytes`, BlobStoreError, FilesUnavailable; on any failure nothing is kept."""
        staged = await self.upload(chunks, max_bytes)
        return await self.commit(staged, owner, filename, purpose)

    async def create_bytes(self, owner: str | None, filename: str, purpose: str,
                           data: bytes) -> FileRecord:
        """Store `data` as a new file of `owner` (the batch runner's output and error
        files). Raises BlobStoreError, FilesUnavailable; on failure nothing is kept."""
        file_id = new_file_id()
        await self.blobs.put(blob_key(file_id), data)
        return await self.commit(StagedFile(file_id, len(data), line_count(data)), owner,
                                 filename, purpose)

    async def upload(self, chunks: AsyncIterable[bytes], max_bytes: int) -> StagedFile:
        """Write `chunks` to a new blob, as they come (for an upload whose purpose is not
        known yet). Raises FileTooLarge past `max_bytes` and BlobStoreError, leaving no
        blob; whatever `chunks` raises (a client gone) propagates, leaving none either."""
        file_id = new_file_id()
        limited = _Limited(chunks, max_bytes)
        size = await self.blobs.put_stream(blob_key(file_id), aiter(limited))
        return StagedFile(file_id, size, limited.lines)

    async def commit(self, staged: StagedFile, owner: str | None, filename: str | None,
                     purpose: str) -> FileRecord:
        """The record of uploaded content: the file exists from here on. Raises
        FilesUnavailable (the content is then discarded)."""
        now_s = self._clock()
        record = FileRecord(staged.id, owner, clean_filename(filename), purpose,
                            staged.size_bytes, int(now_s), staged.lines)
        encoded = record.encode(self._signing_key)
        try:
            await self.blobs.put(record_blob_key(record.id), encoded)
            await self._index(record, encoded, int(now_s * 1_000_000))
        except (BlobStoreError, FilesUnavailable):
            await self.discard(staged)
            raise
        return record

    async def _index(self, record: FileRecord, encoded: bytes, at_us: int) -> None:
        """Put `record` in Redis: its key, and its place in its owner's listing."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self.record_key(record.id), encoded)
            pipe.zadd(self.owner_key(record.owner), {record.id: at_us})
            await self._redis_call(pipe.execute())

    async def discard(self, staged: StagedFile) -> None:
        """Remove uploaded content that will have no record (a failure is logged: the
        blob is then left behind, named by no record)."""
        try:
            await self.blobs.delete(blob_key(staged.id))
            await self.blobs.delete(record_blob_key(staged.id))
        except BlobStoreError:
            log.warning("file %s: its content could not be removed after a failed upload",
                        staged.id)

    async def get(self, file_id: str, owner: str | None) -> FileRecord | None:
        """The file `file_id` if it exists and is `owner`'s, else None."""
        if not valid_file_id(file_id):
            return None
        raw = await self._redis_call(self._redis.get(self.record_key(file_id)))
        record = (await self._restored(file_id) if raw is None
                  else FileRecord.decode(raw, self._keys))
        return record if record is not None and record.owner == owner else None

    async def _restored(self, file_id: str) -> FileRecord | None:
        """The record kept beside a file's bytes, put back in Redis (see the module doc);
        None if none, or not ours. FilesUnavailable: the blob store cannot be read now."""
        try:
            raw = await self.blobs.get(record_blob_key(file_id))
        except BlobNotFound:
            return None
        except BlobStoreError as exc:
            raise FilesUnavailable(str(exc)) from None
        if (record := FileRecord.decode(raw, self._keys)) is None or record.id != file_id:
            return None
        await self._index(record, raw, record.created_at * 1_000_000)
        log.info("file %s: its record, lost by Redis, restored from the blob store", file_id)
        return record

    async def read(self, file_id: str) -> bytes:
        """A file's whole content (the batch runner's input files, whose owner it has
        checked). Raises BlobNotFound, BlobStoreError."""
        return await self.blobs.get(blob_key(file_id))

    async def open(self, file_id: str) -> AsyncIterator[bytes]:
        """A file's content in chunks, opened before this returns. Raises BlobNotFound,
        BlobStoreError."""
        return await self.blobs.stream(blob_key(file_id))

    async def delete(self, file_id: str, owner: str | None) -> bool:
        """Delete `owner`'s file `file_id`: False if there is none. Its content goes
        first, then its record. Raises FilesUnavailable, BlobStoreError (retry: a
        delete cut short completes then)."""
        record = await self.get(file_id, owner)
        if record is None:
            return False
        await self.blobs.delete(blob_key(file_id))
        await self.blobs.delete(record_blob_key(file_id))
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.record_key(file_id))
            pipe.zrem(self.owner_key(owner), file_id)
            deleted, _ = await self._redis_call(pipe.execute())
        return bool(deleted)

    async def list(self, owner: str | None, *, purpose: str | None = None,
                   limit: int = MAX_LIST_LIMIT, after: str | None = None,
                   order: Order = "desc") -> FilePage:
        """`owner`'s files by creation time (ties by id), `limit` of them after the file
        `after` (None: from the start), those of `purpose` only if given. Raises
        UnknownCursor if `after` is not one of the owner's files, FilesUnavailable."""
        key = self.owner_key(owner)
        descending = order == "desc"
        start = 0
        if after is not None:
            rank = await self._redis_call(self._redis.zrevrank(key, after) if descending
                                          else self._redis.zrank(key, after))
            if not isinstance(rank, int):
                raise UnknownCursor(after)
            start = rank + 1
        wanted = limit + 1  # one more than the page: whether more follow
        batch = wanted if purpose is None else max(wanted, _LIST_BATCH)
        found: list[FileRecord] = []
        while len(found) < wanted:  # ends: `start` moves on through a finite set
            ids = cast(list[bytes], await self._redis_call(self._redis.zrange(
                key, start, start + batch - 1, desc=descending)))
            if not ids:
                break
            start += len(ids)
            found.extend(record for record in await self._records(ids)
                         if record.owner == owner
                         and (purpose is None or record.purpose == purpose))
            if len(ids) < batch:
                break
        return FilePage(tuple(found[:limit]), has_more=len(found) > limit)

    async def _records(self, ids: Sequence[bytes]) -> tuple[FileRecord, ...]:
        raws = await self._redis_call(self._redis.mget(
            [self.record_key(file_id.decode()) for file_id in ids]))
        records = (FileRecord.decode(raw, self._keys) for raw in raws if raw is not None)
        return tuple(record for record in records if record is not None)

    async def _redis_call(self, call: Awaitable[T]) -> T:
        """Await a Redis call; FilesUnavailable if Redis cannot be asked."""
        try:
            return await call
        except (RedisError, OSError) as exc:
            raise_if_cancelling()
            raise FilesUnavailable(str(exc)) from None

"""The Files API's pure parts: file names as clients send them, ids, records as Redis
keeps them, and the list's shape (router.batch.files)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from router.batch.files import (
    MAX_FILENAME_CHARS,
    FilePage,
    FileRecord,
    clean_filename,
    new_file_id,
    valid_file_id,
)

RECORDS = st.builds(FileRecord, id=st.text(max_size=40), owner=st.none() | st.text(max_size=40),
                    filename=st.text(max_size=MAX_FILENAME_CHARS), purpose=st.text(max_size=20),
                    size_bytes=st.integers(0, 1 << 40), created_at=st.integers(0, 1 << 40))


@given(st.none() | st.text())
def test_a_kept_filename_is_one_short_printable_path_component(sent: str | None) -> None:
    name = clean_filename(sent)
    assert 0 < len(name) <= MAX_FILENAME_CHARS
    assert "/" not in name and "\\" not in name and name not in (".", "..")
    assert name.isprintable() and name == name.strip()


def test_a_filename_loses_its_path_and_keeps_its_extension() -> None:
    assert clean_filename("../../etc/passwd") == "passwd"
    assert clean_filename("C:\\Users\\me\\batch.jsonl") == "batch.jsonl"
    assert clean_filename("in\x00put\n.jsonl") == "input.jsonl"
    assert clean_filename("dir/") == clean_filename("..") == clean_filename(None) == "upload"
    long = clean_filename("x" * 1000 + ".jsonl")
    assert len(long) == MAX_FILENAME_CHARS and long.endswith("x.jsonl")


def test_ids_are_new_and_only_their_own_shape_is_valid() -> None:
    ids = {new_file_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(valid_file_id(file_id) for file_id in ids)
    file_id = next(iter(ids))
    for other in (file_id + "x", file_id[:-1], "file-", "file-" + "a" * 23 + "/",
                  file_id.replace("file-", "resp_"), "file-../../../etc/passwd0000"):
        assert not valid_file_id(other), other


@given(RECORDS)
def test_a_record_comes_back_from_redis_as_it_went(record: FileRecord) -> None:
    assert FileRecord.decode(record.encode()) == record


WRONG_TYPES: st.SearchStrategy[tuple[str, object]] = (
    st.tuples(st.sampled_from(["id", "filename", "purpose"]),
              st.sampled_from([None, 7, True, [], {}]))
    | st.tuples(st.sampled_from(["size_bytes", "created_at"]),
                st.sampled_from([None, True, 1.5, "7", [], {}]))
    | st.tuples(st.just("owner"), st.sampled_from([7, False, ["acme"]])))


@given(RECORDS, WRONG_TYPES)
def test_a_record_with_a_field_of_the_wrong_type_is_not_believed(
        record: FileRecord, wrong: tuple[str, object]) -> None:
    fields = json.loads(record.encode())
    name, value = wrong
    fields[name] = value
    assert FileRecord.decode(json.dumps(fields)) is None


@given(st.binary(max_size=200) | st.text(max_size=200).map(lambda text: '{"id": ' + text))
def test_garbage_in_redis_is_no_record_and_never_an_exception(raw: bytes | str) -> None:
    assert FileRecord.decode(raw) is None
    assert FileRecord.decode(b"{" * 5000) is None  # (longer than any record: not parsed)


def test_the_openai_shapes() -> None:
    first = FileRecord("file-a", "acme", "in.jsonl", "batch", 12, 1_700_000_000)
    second = FileRecord("file-b", "acme", "out.jsonl", "batch_output", 3, 1_700_000_001)
    assert first.to_openai() == {
        "id": "file-a", "object": "file", "bytes": 12, "created_at": 1_700_000_000,
        "filename": "in.jsonl", "purpose": "batch", "status": "processed",
        "expires_at": None, "status_details": None}
    assert FilePage((first, second), has_more=True).to_openai() == {
        "object": "list", "data": [first.to_openai(), second.to_openai()],
        "first_id": "file-a", "last_id": "file-b", "has_more": True}
    assert FilePage((), has_more=False).to_openai() == {
        "object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


def test_with_keys_only_a_record_signed_by_one_is_believed() -> None:
    keys = {"k1": b"0123456789abcdef0123", "k2": b"fedcba9876543210fedc"}
    record = FileRecord("file-a", "acme", "in.jsonl", "batch", 12, 1_700_000_000, 3)
    signed = record.encode(("k2", keys["k2"]))
    assert FileRecord.decode(signed, keys) == record
    assert FileRecord.decode(signed) == record  # (no keys: signatures are not asked for)
    assert FileRecord.decode(record.encode(), keys) is None  # unsigned
    fields = json.loads(signed)
    fields["owner"] = "other"  # another tenant's now, says whoever wrote to Redis
    assert FileRecord.decode(json.dumps(fields), keys) is None
    fields = json.loads(signed)
    fields["key_id"] = "k1"  # a signature of one key passed off as another's
    assert FileRecord.decode(json.dumps(fields), keys) is None
    assert FileRecord.decode(record.encode(("k9", b"x" * 20)), keys) is None  # unknown key

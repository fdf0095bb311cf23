"""One batch as Redis holds it (router.batch.state), and as OpenAI's API shows it."""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.batch_config import MAX_LINES

TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
              "cancelling_at", "cancelled_at")


@dataclass(frozen=True)
class Batch:
    """One batch as Redis has it."""

    id: str
    doc: Mapping[str, Any]  # endpoint, input_file_id, completion_window, created_at,
    #                         expires_at, metadata, owner, key_id
    status: str
    fields: Mapping[str, str]

    @property
    def owner(self) -> str | None:
        owner = self.doc.get("owner")
        return owner if isinstance(owner, str) else None

    @property
    def key_id(self) -> str | None:
        key_id = self.doc.get("key_id")
        return key_id if isinstance(key_id, str) else None

    @property
    def endpoint(self) -> str:
        return str(self.doc["endpoint"])

    @property
    def input_file_id(self) -> str:
        return str(self.doc["input_file_id"])

    @property
    def expires_at(self) -> int:
        return int(self.doc["expires_at"])

    @property
    def model(self) -> str | None:
        return self.fields.get("model") or None

    @property
    def end(self) -> str:
        return self.fields.get("end", "completed")

    def count(self, name: str) -> int:
        return int(self.fields.get(name, 0))

    @property
    def total(self) -> int:
        return self.count("total")

    def to_openai(self) -> dict[str, Any]:
        """The batch as OpenAI's API shows it."""
        doc = self.doc
        errors = self.fields.get("errors")
        answer: dict[str, Any] = {
            "id": self.id, "object": "batch", "endpoint": doc["endpoint"],
            "model": self.model,
            "errors": None if not errors else {"object": "list", "data": json.loads(errors)},
            "input_file_id": doc["input_file_id"],
            "completion_window": doc["completion_window"],
            "status": self.status,
            "output_file_id": self.fields.get("output_file_id") or None,
            "error_file_id": self.fields.get("error_file_id") or None,
            "created_at": doc["created_at"],
            "expires_at": doc["expires_at"],
        }
        for name in TIMESTAMPS:
            value = self.fields.get(name)
            answer[name] = int(value) if value else None
        answer["request_counts"] = {"total": self.total, "completed": self.count("completed"),
                                    "failed": self.count("failed")}
        answer["metadata"] = doc.get("metadata")
        return answer


_COUNTS = ("total", "completed", "failed", "reruns", "takeovers")


def well_formed(doc: object, fields: Mapping[str, str]) -> bool:
    """Whether a batch record read from Redis has every part `Batch` reads, of its type:
    one written by this router always does; one that does not was damaged or forged by
    someone who can write to Redis, and is left out rather than trusted."""
    if not isinstance(doc, dict):
        return False
    if not all(isinstance(doc.get(name), str)
               for name in ("endpoint", "input_file_id", "completion_window")):
        return False
    if not all(type(doc.get(name)) is int for name in ("created_at", "expires_at")):
        return False
    if not isinstance(doc.get("owner"), str | None) or not isinstance(
            doc.get("metadata"), dict | None):
        return False
    for name in (*_COUNTS, *TIMESTAMPS):
        value = fields.get(name)
        if value is not None and not (value.isdigit() and len(value) <= 19):  # (int64)
            return False
    if int(fields.get("total", 0)) > MAX_LINES:  # finalizing would walk every line
        return False
    errors = fields.get("errors")
    if errors:
        try:
            if not isinstance(json.loads(errors), list):
                return False
        except (ValueError, RecursionError):
            return False
    return True


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(16)

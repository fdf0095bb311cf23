"""Signed heartbeats: HMAC-SHA256 over the canonical heartbeat, with a key id for rotation.

Anybody who can write to Redis could otherwise publish a heartbeat that points routers at
an address of their choosing. A worker signs every heartbeat with a shared secret; a
router that has signing keys configured drops every heartbeat it cannot verify.

- The canonical form is the heartbeat as JSON with sorted keys and no whitespace,
  *without* the `signature` field (but with `key_id`, `seq` and `sent_at_s`, so none of
  them can be changed or swapped without breaking the signature).
- Keys are `key_id:secret` pairs, from `GLOBALPOOL_HEARTBEAT_KEYS="kid1:s1,kid2:s2"` or a
  file named by `GLOBALPOOL_HEARTBEAT_KEYS_FILE` (same format, commas or newlines). A
  router accepts every listed key, so two can be valid at once during a rotation; a
  worker signs with `GLOBALPOOL_HEARTBEAT_KEY_ID` (or `--signing-key-id`), by default the
  first key listed.

This module is shared: workers sign with it and routers verify with it (`router` may
import from `worker`, never the reverse).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.load_records import LoadRecord
from worker.schema import Heartbeat

KEYS_ENV = "GLOBALPOOL_HEARTBEAT_KEYS"
KEYS_FILE_ENV = "GLOBALPOOL_HEARTBEAT_KEYS_FILE"
KEY_ID_ENV = "GLOBALPOOL_HEARTBEAT_KEY_ID"
_KEY_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
MIN_SECRET_BYTES = 16


class SigningKeyError(ValueError):
    """The configured signing keys cannot be used. The message never contains a secret."""


def parse_keys(spec: str, source: str = KEYS_ENV) -> dict[str, bytes]:
    """`"kid1:secret1,kid2:secret2"` (commas or newlines; `#` starts a comment line) ->
    {key_id: secret}, in the order given. Raises SigningKeyError."""
    keys: dict[str, bytes] = {}
    entries = [e.strip() for line in spec.splitlines() if not line.lstrip().startswith("#")
               for e in line.split(",")]
    for number, entry in enumerate((e for e in entries if e), start=1):
        key_id, sep, secret = entry.partition(":")
        key_id = key_id.strip()
        if not sep or not key_id or not set(key_id) <= _KEY_ID_CHARS:
            raise SigningKeyError(f"{source}: entry {number}: expected key_id:secret with a "
                                  "key id of letters, digits and ._-")
        if len(secret.encode()) < MIN_SECRET_BYTES:
            raise SigningKeyError(f"{source}: key {key_id!r}: the secret must be at least "
                                  f"{MIN_SECRET_BYTES} bytes")
        if key_id in keys:
            raise SigningKeyError(f"{source}: key {key_id!r} is listed twice")
        keys[key_id] = secret.encode()
    return keys


def keys_from_environ(environ: Mapping[str, str]) -> dict[str, bytes]:
    """The heartbeat keys named by the environment ({} when none). Raises SigningKeyError."""
    keys: dict[str, bytes] = {}
    path = environ.get(KEYS_FILE_ENV)
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise SigningKeyError(f"{KEYS_FILE_ENV}={path}: cannot read: "
                                  f"{exc.strerror or exc}") from None
        keys.update(parse_keys(text, path))
    spec = environ.get(KEYS_ENV)
    if spec:
        for key_id, secret in parse_keys(spec).items():
            if key_id in keys:
                raise SigningKeyError(f"{KEYS_ENV}: key {key_id!r} is also in {KEYS_FILE_ENV}")
            keys[key_id] = secret
    return keys


_TRANS_5C = bytes(x ^ 0x5C for x in range(256))
_TRANS_36 = bytes(x ^ 0x36 for x in range(256))
_PREPARED: dict[bytes, tuple[hashlib._Hash, hashlib._Hash]] = {}


def hmac_sha256_hex(secret: bytes, message: bytes) -> str:
    """`hmac.new(secret, message, sha256).hexdigest()`, from SHA-256 states keyed once
    per secret (RFC 2104): ~1.5 us instead of ~3.5 us (routers check a record or a
    heartbeat per worker per read; agents sign two a heartbeat)."""
    prepared = _PREPARED.get(secret)
    if prepared is None:
        key = hashlib.sha256(secret).digest() if len(secret) > 64 else secret
        key = key.ljust(64, b"\0")
        prepared = (hashlib.sha256(key.translate(_TRANS_36)),
                    hashlib.sha256(key.translate(_TRANS_5C)))
        if len(_PREPARED) < 64:  # a router has a handful of keys; never grows without bound
            _PREPARED[secret] = prepared
    inner, outer = prepared[0].copy(), prepared[1].copy()
    inner.update(message)
    outer.update(inner.digest())
    return outer.hexdigest()


# How `HeartbeatSigner.signed_payload` appends the signature to the canonical bytes.
SIGNATURE_FIELD = b',"signature":"'



def sign_document(document: dict[str, Any], key: tuple[str, bytes]) -> None:
    """Sign a JSON record in place with `key` (id, secret): its `key_id`, then its
    `signature`, an HMAC over every other field as canonical JSON (the router's drain
    flags and file records)."""
    document["key_id"] = key[0]
    document["signature"] = hmac_sha256_hex(key[1], _document_bytes(document))


def document_signed_by(document: Mapping[str, Any], keys: Mapping[str, bytes]) -> bool:
    """Whether `sign_document` signed `document` with one of `keys`, as it is now."""
    key_id, signature = document.get("key_id"), document.get("signature")
    secret = keys.get(key_id) if isinstance(key_id, str) else None
    if secret is None or not isinstance(signature, str):
        return False
    expected = hmac_sha256_hex(secret, _document_bytes(document))
    return hmac.compare_digest(expected.encode(), signature.encode())


def _document_bytes(document: Mapping[str, Any]) -> bytes:
    signed = {name: value for name, value in document.items() if name != "signature"}
    return json.dumps(signed, sort_keys=True, separators=(",", ":")).encode()

def canonical_bytes(heartbeat: Heartbeat) -> bytes:
    """What is signed: the heartbeat without `signature`, as compact JSON with sorted keys."""
    document = heartbeat.model_dump(mode="json", exclude={"signature"})
    return json.dumps(document, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True, allow_nan=False).encode()


def signature_of(heartbeat: Heartbeat, secret: bytes) -> str:
    """Hex HMAC-SHA256 of the canonical heartbeat (whose `key_id` is already set)."""
    return hmac_sha256_hex(secret, canonical_bytes(heartbeat))


@dataclass(frozen=True)
class HeartbeatSigner:
    """Signs heartbeats with one key. `repr` never shows the secret."""

    key_id: str
    secret: bytes

    def __repr__(self) -> str:
        return f"HeartbeatSigner(key_id={self.key_id!r})"

    def sign(self, heartbeat: Heartbeat) -> Heartbeat:
        return self.signed_payload(heartbeat)[0]

    def signed_payload(self, heartbeat: Heartbeat) -> tuple[Heartbeat, bytes]:
        """The signed heartbeat, and the bytes to publish: exactly what was signed (the
        canonical heartbeat) with `"signature"` as one more, last field. A router checks
        that with one HMAC over the bytes as they came (`verify_payload`), instead of
        serializing the heartbeat again; it is still an ordinary heartbeat JSON."""
        unsigned = heartbeat.model_copy(update={"key_id": self.key_id, "signature": None})
        canonical = canonical_bytes(unsigned)
        signature = hmac_sha256_hex(self.secret, canonical)
        signed = unsigned.model_copy(update={"signature": signature})
        return signed, canonical[:-1] + SIGNATURE_FIELD + signature.encode() + b'"}'

    def signed_record(self, record: bytes) -> bytes:
        """A load record (worker.load_records.load_record) signed: the key id appended to the
        array, an HMAC over those bytes, and the signature as its last item."""
        body = record[:-1] + b',"' + self.key_id.encode() + b'"'
        signature = hmac_sha256_hex(self.secret, body)
        return body + b',"' + signature.encode() + b'"]'

    @classmethod
    def from_environ(
        cls, environ: Mapping[str, str], key_id: str | None = None
    ) -> HeartbeatSigner | None:
        """The signer the environment asks for: `key_id` (or $GLOBALPOOL_HEARTBEAT_KEY_ID,
        or the first key) of the configured keys; None when no keys are configured.
        Raises SigningKeyError when the key id names no configured key."""
        keys = keys_from_environ(environ)
        wanted = key_id or environ.get(KEY_ID_ENV) or None
        if not keys:
            if wanted:
                raise SigningKeyError(f"signing key {wanted!r} requested but no keys are set "
                                      f"(set {KEYS_ENV} or {KEYS_FILE_ENV})")
            return None
        chosen = wanted or next(iter(keys))
        if chosen not in keys:
            raise SigningKeyError(f"signing key {chosen!r} is not among the configured keys "
                                  f"({', '.join(keys)})")
        return cls(chosen, keys[chosen])


class Verdict:
    """Why a heartbeat was refused (the values are counter labels)."""

    UNSIGNED = "unsigned"
    UNKNOWN_KEY = "unknown_key"
    BAD_SIGNATURE = "bad_signature"


def verify_signature(heartbeat: Heartbeat, keys: Mapping[str, bytes]) -> str | None:
    """None if `heartbeat` carries a valid signature by one of `keys`, else a Verdict value.

    The comparison is constant time (`hmac.compare_digest`).
    """
    if heartbeat.signature is None or heartbeat.key_id is None:
        return Verdict.UNSIGNED
    secret = keys.get(heartbeat.key_id)
    if secret is None:
        return Verdict.UNKNOWN_KEY
    try:
        expected = signature_of(heartbeat, secret)
    except ValueError:  # NaN or infinity in a float field: never produced by a signer
        return Verdict.BAD_SIGNATURE
    if not hmac.compare_digest(expected, heartbeat.signature):
        return Verdict.BAD_SIGNATURE
    return None


def verify_payload(payload: bytes, heartbeat: Heartbeat,
                   keys: Mapping[str, bytes]) -> str | None:
    """`verify_signature` for `heartbeat` as parsed from `payload`, cheaply when the payload
    is what `HeartbeatSigner.signed_payload` writes: one HMAC over the bytes before the
    signature field. Any other payload (an older agent's, which serialized the heartbeat
    its own way) is verified by `verify_signature`."""
    signature = heartbeat.signature
    secret = keys.get(heartbeat.key_id) if heartbeat.key_id is not None else None
    if signature is not None and secret is not None:
        at = payload.rfind(SIGNATURE_FIELD)
        if at > 0 and payload.endswith(b'"}') and \
                payload[at + len(SIGNATURE_FIELD):-2] == signature.encode():
            expected = hmac_sha256_hex(secret, payload[:at] + b"}")
            if hmac.compare_digest(expected, signature):
                return None
    return verify_signature(heartbeat, keys)


def verify_record(payload: bytes, record: LoadRecord, keys: Mapping[str, bytes]) -> str | None:
    """None if the load record `record`, parsed from `payload`, is signed by one of `keys`
    (`HeartbeatSigner.signed_record`), else a Verdict value. Constant-time comparison."""
    signature, key_id = record.signature, record.key_id
    if signature is None or key_id is None:
        return Verdict.UNSIGNED
    secret = keys.get(key_id)
    if secret is None:
        return Verdict.UNKNOWN_KEY
    tail = b',"' + signature.encode() + b'"]'
    if not payload.endswith(tail):
        return Verdict.BAD_SIGNATURE
    expected = hmac_sha256_hex(secret, payload[:-len(tail)])
    if not hmac.compare_digest(expected.encode(), signature.encode()):  # bytes: any content
        return Verdict.BAD_SIGNATURE
    return None

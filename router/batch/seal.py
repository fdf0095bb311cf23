"""Batch records signed with the heartbeat keys: what a Redis writer cannot forge.

With heartbeat keys configured (README "Signed heartbeats"), whoever can write to Redis
without them could otherwise rewrite a batch's `doc` (its owner: show its metadata to
another tenant; its API key id: run its lines as, and charge, another tenant; its input
file or expiry) or put lines of their own in its results (the output file its owner
downloads). So a batch's `doc` is stored with a seal, an HMAC over the batch id and the
doc's bytes as stored, and every result with an HMAC over the batch id, the line's index
and the line: a doc without a valid seal is not found (the batch is 404 for every tenant
and no runner takes it), and a result without one is replaced by an error entry
(`result_not_signed`) when the batch is finalized.

The batch's status and counters are changed by Lua scripts in Redis and are not signed:
a writer can still end or stall a batch, or misstate its counts, but not read it as
another tenant, run it as one, or change what its files hold.

Without keys nothing is signed, and seals already stored are read past.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from worker.signing import hmac_sha256_hex

_SEP = " "  # between a result's seal and the line (a line is JSON: it starts with "{")


class Seal:
    """Signs and checks batch records with the first of `keys` / any of them."""

    __slots__ = ("_key", "_keys")

    def __init__(self, keys: Mapping[str, bytes] | None = None) -> None:
        self._keys = dict(keys or {})
        self._key = next(iter(self._keys.items()), None)

    @property
    def on(self) -> bool:
        return self._key is not None

    def of(self, *parts: str) -> str:
        """`key_id:hmac` over `parts` ("" when signing is off)."""
        if self._key is None:
            return ""
        key_id, secret = self._key
        return f"{key_id}:{hmac_sha256_hex(secret, _message(parts))}"

    def holds(self, seal: str | None, *parts: str) -> bool:
        """Whether `seal` is one of the keys' over `parts` (always, when signing is off)."""
        if self._key is None:
            return True
        key_id, _, signature = (seal or "").partition(":")
        secret = self._keys.get(key_id)
        if secret is None:
            return False
        return hmac.compare_digest(hmac_sha256_hex(secret, _message(parts)).encode(),
                                   signature.encode())

    def wrap(self, batch_id: str, index: int, line: str) -> str:
        """A result line as stored: sealed in front when signing is on."""
        if self._key is None:
            return line
        return self.of(batch_id, str(index), line) + _SEP + line

    def unwrap(self, batch_id: str, index: int, stored: str) -> str | None:
        """The line of a stored result; None when signing is on and its seal is not
        valid (written by someone without the keys)."""
        sealed = not stored.startswith("{")
        seal, _, line = stored.partition(_SEP) if sealed else ("", "", stored)
        if self._key is None:
            return line
        return line if self.holds(seal, batch_id, str(index), line) else None


def _message(parts: tuple[str, ...]) -> bytes:
    # Length-prefixed: no two different lists of parts make the same bytes.
    return b"".join(b"%d:%s;" % (len(encoded), encoded)
                    for encoded in (part.encode() for part in parts))

"""The little of a multipart form that routing needs: the audio endpoints' `model`.

`POST /v1/audio/transcriptions` and `/translations` upload a file with the model, the
language and the rest as form fields (`multipart/form-data`), as OpenAI's API and vLLM
take them. The router reads the field names and the short fields' values in one pass of
`bytes.find` over the body (a file of many MB is never copied or decoded) and passes the
body on unchanged, with its Content-Type (the boundary) as the client sent it.
"""

from __future__ import annotations

from router.core.errors import ApiError
from router.core.parse import ParsedRequest

# Endpoints whose body is a form, by kind (router.core.endpoints).
FORM_KINDS = frozenset({"transcription", "translation"})
# An audio file's tokens, roughly: a few kB of compressed audio is a second of speech,
# which a Whisper-like encoder turns into about 50 frames. Only relative sizes matter.
AUDIO_BYTES_PER_TOKEN = 128
_MAX_FIELD_BYTES = 4096  # a text field longer than this is not one the router reads
_READ_FIELDS = frozenset({b"model", b"stream"})


def boundary_of(content_type: str) -> bytes:
    """The boundary of a `multipart/form-data` Content-Type; ApiError(400) otherwise."""
    media_type, _, parameters = content_type.partition(";")
    if media_type.strip().lower() != "multipart/form-data":
        raise ApiError(400, "this endpoint takes a multipart/form-data body (a file and "
                       "form fields)")
    for parameter in parameters.split(";"):
        name, _, value = parameter.strip().partition("=")
        if name.lower() == "boundary":
            value = value.strip('"')
            if 0 < len(value) <= 70 and value.isascii():
                return value.encode()
    raise ApiError(400, "the multipart/form-data Content-Type names no boundary")


def _field_name(headers: bytes) -> bytes | None:
    """The `name` of a part's Content-Disposition (parameter names in any case, the value
    quoted or not, as multipart parsers read it); ApiError(400) when a part names itself
    twice: the router must read the form as the engine does (it routes and authorizes by
    the model it reads there)."""
    names: list[bytes] = []
    for line in headers.split(b"\r\n"):
        key, colon, value = line.partition(b":")
        if not colon or key.strip().lower() != b"content-disposition":
            continue
        for parameter in value.split(b";")[1:]:
            key, equals, named = parameter.partition(b"=")
            if equals and key.strip().lower() == b"name":
                names.append(named.strip().strip(b'"'))
    if len(names) > 1:
        raise ApiError(400, "a form part has more than one name")
    return names[0] if names else None


def form_fields(body: bytes, boundary: bytes) -> tuple[dict[bytes, bytes], int]:
    """The short fields routing reads (`model`, `stream`), and the bytes of all parts;
    ApiError(400) for a body that is not a well-formed form."""
    delimiter = b"--" + boundary
    if not body.startswith(delimiter):
        raise ApiError(400, "the form does not start with its boundary")
    fields: dict[bytes, bytes] = {}
    total = 0
    at = len(delimiter)
    while True:
        if body.startswith(b"--", at):
            return fields, total  # the closing delimiter
        if not body.startswith(b"\r\n", at):
            raise ApiError(400, "a form part's boundary is not followed by a line break")
        head_end = body.find(b"\r\n\r\n", at + 2)
        next_at = body.find(b"\r\n" + delimiter, head_end + 4) if head_end >= 0 else -1
        if next_at < 0:
            raise ApiError(400, "the form ends inside a part (no closing boundary)")
        name = _field_name(body[at + 2:head_end])
        size = next_at - head_end - 4
        total += size
        if name in _READ_FIELDS:
            if name in fields or size > _MAX_FIELD_BYTES:
                raise ApiError(400, f"the form field {name.decode()!r} must be given once, "
                               "and short", param=name.decode())
            fields[name] = body[head_end + 4:next_at]
        at = next_at + 2 + len(delimiter)


def parse_form(body: bytes, content_type: str, kind: str) -> ParsedRequest:
    """A transcription or translation upload: its model and a size estimate. Raises
    ApiError(400) on bad input."""
    fields, total = form_fields(body, boundary_of(content_type))
    raw_model = fields.get(b"model")
    model = raw_model.decode("utf-8", "replace").strip() if raw_model is not None else ""
    if not model:
        raise ApiError(400, "'model' is required (a form field)", param="model")
    stream = fields.get(b"stream", b"false").strip().lower()
    if stream not in (b"true", b"false"):
        raise ApiError(400, "'stream' must be true or false", param="stream")
    return ParsedRequest(model=model, stream=stream == b"true",
                         prompt_tokens=max(1, total // AUDIO_BYTES_PER_TOKEN),
                         completion_tokens=None)

"""Reads a JSON request body under the size limit and validates it, off the event loop.

Invalid UTF-8 and lone surrogates (`"\\ud800"`, which JSON allows) become a 400 naming the
field: the bytes are decoded with surrogateescape, so both kinds end up as lone surrogates
in the parsed strings, where a walk over the body finds them. The same walk refuses arrays
and objects nested deeper than MAX_JSON_DEPTH, so nothing after it (validation, templates,
schemas) can exhaust Python's recursion limit.

A key given twice in one object is a 400, not "the last one wins" as in vLLM: the sender
meant one of the values, and a proxy in front that reads the first would let a request
through that means something else here.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from atom.server.errors import APIError, invalid_body
from atom.server.protocol import UNSUPPORTED_FIELDS

Body = TypeVar("Body", bound=BaseModel)
# Far deeper than any request needs (a tool schema nesting objects 60 deep fits); a body
# deeper than Python's recursion limit (~1000) is refused by the parser itself.
MAX_JSON_DEPTH = 128
TOO_DEEP = f"the JSON body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep"


async def read_body(request: Request, model: type[Body], max_bytes: int) -> Body:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise APIError(
            400, "the body must be a JSON object, sent as Content-Type: application/json"
        )
    raw = await _read_limited(request, max_bytes)
    return await asyncio.to_thread(parse_body, raw, model)


def parse_body(raw: bytes, model: type[Body]) -> Body:
    text = raw.decode("utf-8", errors="surrogateescape")
    try:
        data = json.loads(text, object_pairs_hook=_object_with_distinct_keys)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"malformed JSON body: {exc.msg} (at character {exc.pos})") from None
    except RecursionError:
        raise APIError(400, TOO_DEEP) from None
    if not isinstance(data, dict):
        raise APIError(
            400, "the body must be a JSON object, sent as Content-Type: application/json"
        )
    bad_text = _first_invalid_text(data, ())
    if bad_text is not None:
        field = ".".join(map(str, bad_text))
        raise APIError(
            400, f"{field}: not valid UTF-8 text (a lone surrogate or an invalid byte)", param=field
        )
    for field in UNSUPPORTED_FIELDS:
        if data.get(field) not in (None, [], {}, "") and field not in model.model_fields:
            raise APIError(400, f"{field} is not supported by atom serve", param=field)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from None


async def _read_limited(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, max_bytes: int) -> APIError:
    return APIError(
        413,
        f"the request body has {size} bytes or more; the limit is {max_bytes} "
        "(atom serve --max-request-body-bytes)",
        code="request_too_large",
    )


def _object_with_distinct_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) < len(pairs):
        seen = set()
        repeated = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise APIError(
            400, f"the key {repeated!r} appears twice in one JSON object; give each key once"
        )
    return found


def _first_invalid_text(value: Any, path: tuple) -> tuple | None:
    """The path of the first string (key or value) that is not encodable as UTF-8; a 400
    for arrays and objects nested too deep."""
    if isinstance(value, str):
        return None if value.isascii() or _encodes(value) else path
    if isinstance(value, dict | list) and len(path) >= MAX_JSON_DEPTH:
        raise APIError(400, TOO_DEEP)
    if isinstance(value, dict):
        for key, item in value.items():
            if not _encodes(key):
                return (*path, key.encode("utf-8", "replace").decode())
            found = _first_invalid_text(item, (*path, key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _first_invalid_text(item, (*path, i))
            if found is not None:
                return found
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True

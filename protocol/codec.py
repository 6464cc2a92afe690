"""The one codec: messages <-> ZeroMQ frames.

A message is two frames: ``[op, body]``. ``op`` is the ASCII op name; ``body``
is a msgpack map of the message's fields (nested structs are maps, enums are
their values). numpy arrays travel as msgpack extension type 1 holding
``[dtype string, shape list, raw bytes]``. Nothing here ever unpickles.

``decode`` validates every field against the message's type annotations and
raises ``ProtocolError`` with a numbered code and a message that names the
field, so the daemon can answer bad input instead of dying of it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any, Optional, Union

import msgpack
import numpy as np

from .messages import (
    MAX_ID_CHARS,
    MAX_MESSAGE_BYTES,
    REPLIES,
    REQUESTS,
    ErrorCode,
    Message,
    Op,
)

NDARRAY_EXT = 1
_PRIMITIVE = (int, str, float)


class ProtocolError(Exception):
    """A message could not be decoded or is invalid."""

    def __init__(self, code: ErrorCode, message: str, request_id: Optional[str] = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


# --------------------------------------------------------------------------- msgpack


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        payload = msgpack.packb([arr.dtype.str, list(arr.shape), arr.tobytes()], use_bin_type=True)
        return msgpack.ExtType(NDARRAY_EXT, payload)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != NDARRAY_EXT:
        raise ValueError(f"unknown msgpack extension type {code}")
    dtype, shape, raw = msgpack.unpackb(data, raw=False)
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise ValueError("object arrays are not allowed")
    return np.frombuffer(raw, dtype=dt).reshape(shape)


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, default=_default)


def unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, ext_hook=_ext_hook, strict_map_key=True)


# --------------------------------------------------------------------------- to the wire


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


def encode(msg: Message) -> list[bytes]:
    """Message -> [op frame, body frame]."""
    return [msg.op.value.encode("ascii"), packb(_to_wire(msg))]


# --------------------------------------------------------------------------- from the wire


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}
    if tp in names:
        return names[tp]
    origin = typing.get_origin(tp)
    if origin is list:
        return "a list"
    if origin is dict or dataclasses.is_dataclass(tp):
        return "a map"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ValueError(f"'{path}' must not be null")
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(value, inner, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is np.ndarray:
        if isinstance(value, np.ndarray):
            return value
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in tp)
            raise ValueError(f"'{path}' must be one of {allowed}, got {value!r}") from None
    elif origin is list:
        if isinstance(value, list):
            (inner,) = typing.get_args(tp)
            if inner in _PRIMITIVE and all(type(v) is inner for v in value):
                return value  # fast path: long token lists, embedding vectors
            return [_convert(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            key_tp, val_tp = typing.get_args(tp)
            return {_convert(k, key_tp, path): _convert(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return from_map(tp, value, path + ".")
    else:
        raise TypeError(f"codec cannot convert to {tp!r}")
    raise ValueError(f"'{path}' must be {_type_name(tp)}, got {type(value).__name__}")


def from_map(cls: type, body: dict, prefix: str = "") -> Any:
    """A dataclass from a map, type-checked field by field as the wire is (ValueError names the field)."""
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in body:
            kwargs[f.name] = _convert(body[f.name], hints[f.name], prefix + f.name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"missing field '{prefix}{f.name}'")
    # Unknown keys are ignored: a newer minor version may add fields.
    return cls(**kwargs)


def _readable_id(body: Any) -> Optional[str]:
    if isinstance(body, dict):
        rid = body.get("id")
        if isinstance(rid, str) and 1 <= len(rid) <= MAX_ID_CHARS:  # else the error reply could not carry it
            return rid
    return None


def decode(frames: list[bytes], *, replies: bool = False, table: Optional[dict] = None) -> Message:
    """[op frame, body frame] -> Message. ``replies`` selects daemon->client ops;
    the default decodes client->daemon requests; ``table`` (op -> class) selects
    another set, e.g. the internal drafter messages. Raises ProtocolError."""
    if len(frames) != 2:
        raise ProtocolError(ErrorCode.MALFORMED_MESSAGE, f"a message is 2 frames [op, msgpack body]; got {len(frames)}")
    op_frame, body_frame = frames
    if len(body_frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            ErrorCode.MESSAGE_TOO_LARGE,
            f"message body is {len(body_frame):,} bytes; the limit is {MAX_MESSAGE_BYTES:,}",
        )
    try:
        body = unpackb(body_frame)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(ErrorCode.MALFORMED_MESSAGE, f"body is not valid msgpack: {exc}") from None
    request_id = _readable_id(body)
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.MALFORMED_MESSAGE, f"body must be a msgpack map, got {type(body).__name__}")
    if table is None:
        table = REPLIES if replies else REQUESTS
    try:
        op = Op(op_frame.decode("ascii"))
        cls = table[op]
    except (UnicodeDecodeError, ValueError, KeyError):
        known = ", ".join(o.value for o in table)
        raise ProtocolError(
            ErrorCode.UNKNOWN_OP, f"unknown op {op_frame[:40]!r}; known ops: {known}", request_id
        ) from None
    try:
        msg = from_map(cls, body)
        if isinstance(getattr(msg, "id", None), str) and not 1 <= len(msg.id) <= MAX_ID_CHARS:
            raise ValueError(f"'id' must have 1 to {MAX_ID_CHARS} characters")
        check = getattr(msg, "check", None)
        if check is not None:
            check()
    except ValueError as exc:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"{op.value}: {exc}", request_id) from None
    except (TypeError, RecursionError, UnicodeError) as exc:  # a check met a value of a shape it did not foresee
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST,
            f"{op.value}: a field has a value of the wrong shape ({type(exc).__name__})",
            request_id,
        ) from None
    return msg

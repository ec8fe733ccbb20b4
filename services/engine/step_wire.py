"""A step's host inputs (`HostStep`) as one bytes message: how rank 0 sends each step to its
tensor-parallel followers (services/engine/tensor_parallel.py).

A step is a score of small numpy arrays. Pickling the dataclass costs each side a Python object per
array and per field, every step; here the arrays travel as their raw bytes behind one header:

    [header length: int64] [header: int64 ...] [each array's bytes, 8-byte aligned] [pickle of the rare]

The header holds the caller's integers, then one entry of `ENTRY` int64s per `HostStep` field, in
field order: what the field holds (an array of one or two dimensions, an integer, None, or an object
pickled at the end) and its dtype and shape, or the integer. What is neither an array nor an integer
(prompt rows, requests joining) is rare and goes pickled, after the arrays.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import numpy as np

from services.engine.cuda_graph import HostStep

NONE, ARRAY, INT, OBJECT = range(4)
"""What a field's entry describes."""
ENTRY = 4
"""int64s per field entry: kind, dtype (index in DTYPES) or the integer, rows, columns (-1: 1-D)."""
DTYPES = (np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.float32))
"""The dtypes an array travels raw in (any other goes pickled, as an object)."""
ALIGN = 8

FIELDS = tuple(field.name for field in dataclasses.fields(HostStep))
FLAGS = frozenset(field.name for field in dataclasses.fields(HostStep) if field.type in ("bool", bool))
"""The fields that are flags: they travel as integers and come back as bools."""


def pack_step(step: HostStep, numbers: list[int], extra: object = None) -> bytes:
    """`step`, the caller's `numbers` and a rare `extra` object (None: nothing) as one message."""
    header = [len(numbers), *numbers]
    arrays: list[np.ndarray] = []
    objects: list[Any] = [extra]
    for name in FIELDS:
        value = getattr(step, name)
        if value is None:
            header += [NONE, 0, 0, 0]
        elif isinstance(value, np.ndarray) and value.ndim <= 2 and value.dtype in DTYPES:
            shape = (*value.shape, -1) if value.ndim == 1 else value.shape
            header += [ARRAY, DTYPES.index(value.dtype), *shape]
            arrays.append(np.ascontiguousarray(value))
        elif isinstance(value, int):
            header += [INT, value, 0, 0]
        else:
            header += [OBJECT, len(objects), 0, 0]
            objects.append(value)
    head = np.array([len(header), *header], dtype=np.int64)
    parts = [head.tobytes()]
    for array in arrays:
        parts.append(array.tobytes())
        parts.append(bytes(-array.nbytes % ALIGN))
    if any(value is not None for value in objects):
        parts.append(pickle.dumps(objects, protocol=pickle.HIGHEST_PROTOCOL))
    return b"".join(parts)


def unpack_step(data: bytes | bytearray | memoryview) -> tuple[HostStep, list[int], Any]:
    """(the step, the numbers, the extra object) of a `pack_step` message. The step's arrays are
    views of one writable copy of the message."""
    buffer = bytearray(data)
    (length,) = np.frombuffer(buffer, dtype=np.int64, count=1)
    header = np.frombuffer(buffer, dtype=np.int64, count=int(length), offset=8).tolist()
    num_numbers = header[0]
    numbers = header[1 : 1 + num_numbers]
    entries = iter(header[1 + num_numbers :])
    offset = 8 * (1 + int(length))
    fields: dict[str, Any] = {}
    late: dict[str, int] = {}
    for name, kind, a, rows, columns in zip(FIELDS, entries, entries, entries, entries):
        if kind == ARRAY:
            count = rows if columns < 0 else rows * columns
            array = np.frombuffer(buffer, DTYPES[a], count, offset)
            fields[name] = array if columns < 0 else array.reshape(rows, columns)
            offset += -(-array.nbytes // ALIGN) * ALIGN
        elif kind == INT:
            fields[name] = bool(a) if name in FLAGS else a
        elif kind == OBJECT:
            late[name] = a
        else:
            fields[name] = None
    objects = pickle.loads(buffer[offset:]) if offset < len(buffer) else [None]
    fields.update({name: objects[index] for name, index in late.items()})
    return HostStep(**fields), numbers, objects[0]

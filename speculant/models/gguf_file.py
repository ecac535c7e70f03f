"""A GGUF file's header and tensor table, read without gguf's own reader: it makes every metadata
value a numpy object first (a tokenizer's ~100k strings: seconds), where stepping over them takes
milliseconds. ``loading.check_gguf`` checks a file whole with it, ``quantized.read`` maps the tensors."""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

from .. import files
from ..errors import SpeculantError


_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
MAX_ARRAY_DEPTH = 16  # arrays of arrays a metadata value may nest (llama.cpp writes 1 or 2)


class TooDeep(ValueError):
    """Metadata arrays nested past MAX_ARRAY_DEPTH (stepping over them would recurse without end)."""


class GGUFTable:
    """Reads a GGUF file's header and tables in order from a memory map (struct.error past its end)."""

    def __init__(self, m, size: int):
        self.m, self.size, self.at = m, size, 0

    def take(self, fmt: str):
        out = struct.unpack_from("<" + fmt, self.m, self.at)
        self.at += struct.calcsize("<" + fmt)
        return out[0] if len(out) == 1 else out

    def skip(self, n: int) -> None:
        if n < 0 or self.at + n > self.size:
            raise struct.error("past the end")
        self.at += n

    def string(self) -> bytes:
        n = self.take("Q")
        self.skip(n)
        return bytes(self.m[self.at - n : self.at])

    def value(self, kind: int, depth: int = 0):
        """One metadata value: scalars and strings returned, arrays skipped (None)."""
        if kind in _GGUF_SCALARS:
            return self.take({1: "B", 2: "H", 4: "I", 8: "Q"}[_GGUF_SCALARS[kind]])
        if kind == 8:
            return self.string()
        if kind == 9:
            if depth >= MAX_ARRAY_DEPTH:
                raise TooDeep(f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
            item, count = self.take("I"), self.take("Q")
            if item in _GGUF_SCALARS:
                self.skip(count * _GGUF_SCALARS[item])
            elif count > (self.size - self.at) // 8:
                raise struct.error("an array longer than the file")
            else:
                for _ in range(count):
                    self.value(item, depth + 1)
            return None
        raise ValueError(f"unknown metadata type {kind}")


def incomplete(path: Path, size: int):
    """The one-line error, by its reason, for a file that is not a whole GGUF (``lead``: what it is not)."""
    def bad(why: str, lead: str = "a complete GGUF file", fix: str = "give the whole file") -> SpeculantError:
        return SpeculantError(f"{files.shown(path)} is not {lead} ({size:,} bytes: {why}): {fix}")
    return bad


def _gguf_table(r: GGUFTable, bad, scalars: dict | None = None) -> tuple[int, list[tuple[str, list[int], int, int]]]:
    """(where the tensors' data starts, each tensor's (name, dims, GGML type, offset within the data)),
    from the header on: metadata values are stepped over, not made into Python objects (``scalars``,
    where given, gets every scalar and string value by key)."""
    if r.take("4s") != b"GGUF":
        raise bad("no GGUF header")
    version, tensors, kvs = r.take("I"), r.take("Q"), r.take("Q")
    if version not in (2, 3) or tensors > r.size // 24 or kvs > r.size // 12:
        raise bad(f"a header of version {version}, {tensors} tensors, {kvs} metadata entries")
    align = 32
    for _ in range(kvs):
        key, kind = r.string(), r.take("I")
        try:
            v = r.value(kind)
        except TooDeep as e:
            raise bad(f"its metadata {key.decode('utf-8', 'replace')[:80]!r} holds {e}", "a GGUF file speculant reads",
                      "give a GGUF file llama.cpp's converter wrote") from None
        if key == b"general.alignment" and isinstance(v, int) and v > 0:
            align = v
        if scalars is not None and v is not None:
            scalars[key.decode("utf-8", "replace")] = v.decode("utf-8", "replace") if isinstance(v, bytes) else v
    table = []
    for _ in range(tensors):
        name = r.string().decode("utf-8", "replace")
        dims = [r.take("Q") for _ in range(r.take("I"))]
        kind, offset = r.take("I"), r.take("Q")
        table.append((name, dims, kind, offset))
    return -(-r.at // align) * align, table


def _gguf_bytes(dims: list[int], kind: int, quant_sizes) -> int:
    block, nbytes = quant_sizes[kind]
    return math.prod(dims) // block * nbytes


def gguf_data_span(r: GGUFTable, bad, quant_sizes) -> tuple[int, list[int]]:
    """(where the tensors' data starts, each tensor's end offset within it), from the header on."""
    start, table = _gguf_table(r, bad)
    return start, [offset + _gguf_bytes(dims, kind, quant_sizes) for _, dims, kind, offset in table]


@dataclass
class GGUFTensor:
    name: str
    kind: str  # GGML type name: "Q4_1", "Q8_0", "F32", ...
    dims: list[int]  # GGUF order: dims[0] is a row's length (in_features of a linear)
    data: "np.ndarray"  # its raw bytes, uint8 [rows, bytes a row], a view of the file
    type_id: int = -1  # GGML type id (the table's)
    at: int = 0  # where its bytes start in the file


def gguf_tensors(path: Path, scalars: dict | None = None, mapped: list | None = None) -> list[GGUFTensor]:
    """A GGUF file's tensors as views of the file, read from its table alone: gguf's own reader
    makes every metadata value a numpy object first (a tokenizer's ~100k strings: 2.8 s for the
    default GGUF, 12.3 s for gemma3-270m's on a 2-core Zen 3), where stepping over them takes
    milliseconds. Types gguf does not know are left out. ``scalars`` gets the metadata's scalar and
    string values by key; ``mapped`` the file's memory map (to give pages back: ``mmap.madvise``)."""
    import mmap

    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    size = path.stat().st_size
    with open(path, "rb") as f:  # one map: the table is read from it, the tensors are views of it
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    start, table = _gguf_table(GGUFTable(m, size), incomplete(path, size), scalars)
    if mapped is not None:
        mapped.append(m)
    data = np.frombuffer(m, dtype=np.uint8)  # keeps the map alive as long as a tensor's view does
    out = []
    for name, dims, kind, offset in table:
        try:
            kind_name = GGMLQuantizationType(kind).name
            nbytes = _gguf_bytes(dims, kind, GGML_QUANT_SIZES)
        except (ValueError, KeyError):
            continue
        rows = math.prod(dims[1:])  # a row is dims[0] values
        at = start + offset
        out.append(GGUFTensor(name, kind_name, dims, data[at : at + nbytes].reshape(rows, -1), kind, at))
    return out

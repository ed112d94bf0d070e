"""A GGUF file's header: metadata key/values and tensor descriptions; tensor bytes memory-mapped.

Why not gguf.GGUFReader: it memory-maps every metadata string separately, which takes 6 s for
SmolLM2's 98k tokenizer strings and 17 s for Qwen2.5's 300k. Parsing the header from one bytes
buffer takes a fraction of a second. Dequantization still uses the gguf package (numpy only).

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 kv count;
kv = string key, u32 value type, value (arrays: u32 element type, u64 count, elements);
tensor info = string name, u32 n_dims, u64 dims (innermost first), u32 ggml type, u64 offset;
tensor data starts at the next multiple of `general.alignment` (default 32).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from onnxgen.errors import ModelLoadError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# Far above any real file; a larger count means a corrupt header, not a big model.
_MAX_COUNT = 1 << 24

# GGUF metadata value types → struct format of one scalar.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {k: np.dtype("<" + v) for k, v in _SCALARS.items()}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first): [out, in] for a linear weight
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.qtype.name


class _Cursor:
    """Reads little-endian values from a buffer; running off the end is a truncated header."""

    def __init__(self, buf: memoryview | bytes, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise ModelLoadError(
                f"{self.path}: GGUF header is truncated or corrupt (needs {n} bytes at offset {self.pos}, "
                f"file has {len(self.buf)})"
            )

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        self.need(size)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        self.need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"{self.path}: a GGUF string at offset {self.pos - n} is not UTF-8 ({e})") from None

    def count(self, what: str) -> int:
        n = self.scalar("Q")
        if n > _MAX_COUNT:
            raise ModelLoadError(f"{self.path}: GGUF header claims {n} {what}; the file is corrupt")
        return n

    def value(self, vtype: int) -> Any:
        if vtype == 6:
            # Shortest decimal that is this float32 (1e-05, not 9.999999747378752e-06).
            return float(str(np.float32(self.scalar("f"))))
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.scalar("I")
            n = self.count("array elements")
            if etype in _NUMPY:
                # Numeric arrays (token types, scores) in one read instead of n.
                dtype = _NUMPY[etype]
                self.need(n * dtype.itemsize)
                arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).copy()
                self.pos += n * dtype.itemsize
                return arr
            return [self.value(etype) for _ in range(n)]
        raise ModelLoadError(f"{self.path}: unknown GGUF value type {vtype} at offset {self.pos}; the file is corrupt")


class GGUFFile:
    """Metadata and tensor table of a GGUF file; `raw(name)` gives a tensor's bytes (memory-mapped)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: no such GGUF file")
        self.file_size = self.path.stat().st_size
        if self.file_size < 24:
            raise ModelLoadError(f"{self.path}: {self.file_size} bytes is too short to be a GGUF file")
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            pass  # a tensor view is still alive; the map closes when it is collected

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _parse(self) -> None:
        cur = _Cursor(memoryview(self._map), self.path)
        if bytes(self._map[:4]) != _MAGIC:
            raise ModelLoadError(f"{self.path}: not a GGUF file (magic {bytes(self._map[:4])!r}, expected b'GGUF')")
        cur.pos = 4
        version = cur.scalar("I")
        if version not in (2, 3):
            hint = " (a big-endian file?)" if version > 0xFFFF else ""
            raise ModelLoadError(f"{self.path}: GGUF version {version} is not supported (2 or 3){hint}")
        n_tensors = cur.count("tensors")
        n_kv = cur.count("metadata entries")
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("I")
            if n_dims > 8:
                raise ModelLoadError(f"{self.path}: tensor {name!r} claims {n_dims} dims; the file is corrupt")
            dims = [cur.scalar("Q") for _ in range(n_dims)]
            raw_type = cur.scalar("I")
            offset = cur.scalar("Q")
            infos.append((name, dims, raw_type, offset))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ModelLoadError(f"{self.path}: general.alignment {alignment} is not a power of two")
        data_start = -(-cur.pos // alignment) * alignment
        for name, dims, raw_type, offset in infos:
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise ModelLoadError(f"{self.path}: tensor {name!r} has unknown ggml type {raw_type}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            if dims and dims[0] % block:
                raise ModelLoadError(
                    f"{self.path}: tensor {name!r} rows of {dims[0]} are not whole {qtype.name} blocks of {block}"
                )
            count = int(np.prod(dims, dtype=np.int64)) if dims else 1
            nbytes = count // block * type_size
            start = data_start + offset
            if start + nbytes > self.file_size:
                raise ModelLoadError(
                    f"{self.path}: GGUF file is truncated: tensor {name!r} needs bytes up to {start + nbytes}, "
                    f"the file has {self.file_size}"
                )
            if name in self.tensors:
                raise ModelLoadError(f"{self.path}: tensor {name!r} appears twice; the file is corrupt")
            self.tensors[name] = TensorInfo(name, tuple(reversed(dims)), qtype, start, nbytes)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks {key!r}")
        return self.metadata[key]

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 rows [..., bytes_per_row] (a read-only view of the file)."""
        info = self.tensors[name]
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        inner = info.shape[-1] if info.shape else 1
        row_bytes = inner // block * type_size
        flat = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return flat.reshape(*info.shape[:-1], row_bytes)

"""Typed manifest describing one rank's captured state image.

An image is one flat uint8 buffer plus this manifest. The manifest travels as
UTF-8 JSON (never pickle): it names every tensor (dtype, shape, byte offset)
and carries the non-tensor parts of the state dicts as a tagged JSON tree, so
bytes from a peer or from disk can be validated before anything is restored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptless.errors import ManifestError

FORMAT_VERSION = 1

_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.complex64, torch.complex128,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ManifestError(f"unsupported tensor dtype {dtype}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError as exc:
        raise ManifestError(f"unknown dtype {name!r} in manifest") from exc


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's place in the flat buffer."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> list[Any]:
        return [self.dtype, list(self.shape), self.offset, self.nbytes]

    @classmethod
    def from_json(cls, raw: Any) -> TensorEntry:
        try:
            dtype, shape, offset, nbytes = raw
            entry = cls(str(dtype), tuple(int(s) for s in shape), int(offset), int(nbytes))
        except (TypeError, ValueError) as exc:
            raise ManifestError(f"malformed tensor entry {raw!r}") from exc
        dt = dtype_from_name(entry.dtype)
        numel = 1
        for s in entry.shape:
            if s < 0:
                raise ManifestError(f"negative dimension in tensor entry {raw!r}")
            numel *= s
        if numel * dt.itemsize != entry.nbytes or entry.offset < 0:
            raise ManifestError(f"tensor entry {raw!r}: size does not match dtype and shape")
        return entry


@dataclass(frozen=True)
class Manifest:
    """Everything needed to validate and restore one image.

    ``tree`` is the tagged JSON tree of the protected objects' state dicts in
    which tensors are replaced by indices into ``tensors`` (its encoding is
    owned by :mod:`ckptless.state.tree`; the manifest treats it as opaque JSON).
    """

    job_id: str
    owner: int
    version: int
    generation: int
    total_bytes: int
    chunk_bytes: int
    chunk_checksums: tuple[int, ...]
    tensors: tuple[TensorEntry, ...] = ()
    tree: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT_VERSION,
            "job_id": self.job_id,
            "owner": self.owner,
            "version": self.version,
            "generation": self.generation,
            "total_bytes": self.total_bytes,
            "chunk_bytes": self.chunk_bytes,
            "chunk_checksums": list(self.chunk_checksums),
            "tensors": [t.to_json() for t in self.tensors],
            "tree": self.tree,
            "extra": self.extra,
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=True).encode("utf-8")

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"manifest is not valid UTF-8 JSON ({len(raw)} bytes)") from exc
        if not isinstance(doc, dict):
            raise ManifestError("manifest is not a JSON object")
        if doc.get("format") != FORMAT_VERSION:
            raise ManifestError(f"unsupported manifest format {doc.get('format')!r} (expected {FORMAT_VERSION})")
        try:
            m = cls(
                job_id=str(doc["job_id"]),
                owner=int(doc["owner"]),
                version=int(doc["version"]),
                generation=int(doc["generation"]),
                total_bytes=int(doc["total_bytes"]),
                chunk_bytes=int(doc["chunk_bytes"]),
                chunk_checksums=tuple(int(c) for c in doc["chunk_checksums"]),
                tensors=tuple(TensorEntry.from_json(t) for t in doc["tensors"]),
                tree=doc.get("tree"),
                extra=dict(doc.get("extra") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"manifest missing or malformed field: {exc}") from exc
        m.validate()
        return m

    def validate(self) -> None:
        """Structural checks: chunks cover the buffer, tensors lie inside it."""
        if self.chunk_bytes <= 0 or self.total_bytes < 0:
            raise ManifestError(f"bad sizes: total_bytes={self.total_bytes} chunk_bytes={self.chunk_bytes}")
        want_chunks = -(-self.total_bytes // self.chunk_bytes)
        if len(self.chunk_checksums) != want_chunks:
            raise ManifestError(
                f"{len(self.chunk_checksums)} checksums for {want_chunks} chunks of {self.total_bytes} bytes"
            )
        for i, t in enumerate(self.tensors):
            if t.offset + t.nbytes > self.total_bytes:
                raise ManifestError(f"tensor {i} [{t.offset}, +{t.nbytes}) outside buffer of {self.total_bytes} bytes")

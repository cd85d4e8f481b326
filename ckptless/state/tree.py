"""Tagged JSON encoding of nested state dicts, with tensors pulled out.

Why not pickle: images travel between processes and come back from disk, and
unpickling foreign bytes executes code. Instead a state dict is split into
(a) a JSON-safe tree that carries every non-tensor value *with its exact
Python type*, and (b) the list of tensors, which the capturer lays out raw in
a flat buffer. :func:`decode` rebuilds the original structure exactly: tuples
stay tuples, ``int`` dict keys (optimizer state is keyed by parameter index)
stay ``int``, ``bool`` stays ``bool``, ``nan``/``inf`` survive strict JSON.

Node forms (a JSON object node always has exactly one key, the tag):

======================  ==================================================
``null`` true false     ``None``, ``bool``
JSON integer            ``int`` (arbitrary size)
JSON float              finite ``float`` (``repr`` round-trips exactly)
JSON string             ``str``
JSON array              ``list``
``{"t": [...]}``        ``tuple``
``{"S": [...]}``        ``torch.Size``
``{"d": [[k, v], ..]}`` ``dict`` (keys ``str`` or ``int``; order kept)
``{"o": [items, meta]}`` ``OrderedDict``; ``items`` as for ``d``, ``meta`` the
                        encoded ``_metadata`` attribute (module state dicts
                        carry per-submodule versions there) or ``null``
``{"f": "nan"}``        non-finite ``float`` (``"nan"``, ``"inf"``, ``"-inf"``)
``{"T": i}``            CPU tensor ``tensors[i]``
``{"Td": [i, type]}``   tensor ``tensors[i]`` that lived on a device of ``type``
                        (``"cuda"``: the type only, never an index; see
                        :mod:`ckptless.state.devices`)
``{"N": i}``            numpy array, stored as ``tensors[i]``
``{"n": [dt, v]}``      numpy scalar of dtype name ``dt`` (bool/int/float)
``{"dtype": name}``     ``torch.dtype``
``{"device": name}``    ``torch.device``
======================  ==================================================
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ckptless.errors import ManifestError, StateError
from ckptless.state import devices
from ckptless.state.dtensor import DTensorSpec, Meshes, is_dtensor, local_of, same_layout
from ckptless.state.manifest import dtype_name

MAX_DEPTH = 128
"""Deeper nesting is rejected: real state dicts are < 10 levels deep, and a
bound keeps a hostile tree from exhausting the interpreter stack."""

_NP_KINDS = {"b", "i", "u", "f"}
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _where(path: str) -> str:
    return path or "<root>"


def encode(obj: Any, path: str = "") -> tuple[Any, list[torch.Tensor]]:
    """Split ``obj`` into a tagged JSON-safe tree and the tensors it holds.

    ``path`` prefixes the dotted location reported in errors (for example
    ``optimizer.state.0.step``). Tensors are returned as-is (no copy); numpy
    arrays are wrapped with :func:`torch.from_numpy` (no copy either).
    Raises :class:`StateError` for any value it cannot represent exactly.
    """
    tensors: list[torch.Tensor] = []
    tree = _enc(obj, path, tensors, 0)
    return tree, tensors


def _add_tensor(t: torch.Tensor, path: str, tensors: list[torch.Tensor]) -> int:
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        raise StateError(f"cannot capture {_where(path)}: unsupported tensor layout/device ({t.layout}, {t.device})")
    try:
        dtype_name(t.dtype)
    except ManifestError as exc:
        raise StateError(f"cannot capture {_where(path)}: unsupported tensor dtype {t.dtype}") from exc
    tensors.append(t)
    return len(tensors) - 1


def _enc(obj: Any, path: str, tensors: list[torch.Tensor], depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise StateError(f"cannot capture {_where(path)}: nested deeper than {MAX_DEPTH} levels")
    kind = type(obj)
    if obj is None or kind is bool or kind is int or kind is str:
        return obj
    if kind is float:
        return obj if math.isfinite(obj) else {"f": "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
    if is_dtensor(obj):
        return {"DT": [_enc_tensor(local_of(obj), path, tensors), *DTensorSpec.of(obj, path).to_json()]}
    if isinstance(obj, torch.Tensor):
        if kind not in (torch.Tensor, torch.nn.Parameter):
            raise StateError(f"cannot capture {_where(path)}: tensor subclass {kind.__qualname__} is not supported")
        return _enc_tensor(obj, path, tensors)
    if kind is dict:
        return {"d": _enc_items(obj, path, tensors, depth)}
    if kind is OrderedDict:
        meta = getattr(obj, "_metadata", None)
        enc_meta = None if meta is None else _enc(meta, _join(path, "_metadata"), tensors, depth + 1)
        return {"o": [_enc_items(obj, path, tensors, depth), enc_meta]}
    if kind is list:
        return [_enc(v, _join(path, i), tensors, depth + 1) for i, v in enumerate(obj)]
    if kind is tuple:
        return {"t": [_enc(v, _join(path, i), tensors, depth + 1) for i, v in enumerate(obj)]}
    if kind is torch.Size:
        return {"S": [int(s) for s in obj]}
    if kind is torch.dtype:
        return {"dtype": str(obj).removeprefix("torch.")}
    if kind is torch.device:
        return {"device": str(obj)}
    if kind is np.ndarray:
        return {"N": _enc_ndarray(obj, path, tensors)}
    if isinstance(obj, np.generic) and obj.dtype.kind in _NP_KINDS and obj.dtype.itemsize <= 8:
        return {"n": [obj.dtype.name, _enc(obj.item(), path, tensors, depth + 1)]}
    raise StateError(f"cannot capture {_where(path)}: unsupported type {kind.__module__}.{kind.__qualname__}")


def _enc_tensor(t: torch.Tensor, path: str, tensors: list[torch.Tensor]) -> dict[str, Any]:
    idx = _add_tensor(t.detach(), path, tensors)
    return {"T": idx} if t.device.type == "cpu" else {"Td": [idx, devices.recorded(t)]}


def _enc_items(obj: dict[Any, Any], path: str, tensors: list[torch.Tensor], depth: int) -> list[list[Any]]:
    items = []
    for k, v in obj.items():
        if type(k) is not str and type(k) is not int:
            raise StateError(
                f"cannot capture {_where(path)}: dict key {k!r} has type {type(k).__qualname__} (only str and int keys)"
            )
        items.append([k, _enc(v, _join(path, k), tensors, depth + 1)])
    return items


def _enc_ndarray(arr: np.ndarray, path: str, tensors: list[torch.Tensor]) -> int:
    try:
        t = torch.from_numpy(np.ascontiguousarray(arr))
    except TypeError as exc:
        raise StateError(f"cannot capture {_where(path)}: numpy dtype {arr.dtype} has no tensor equivalent") from exc
    return _add_tensor(t, path, tensors)


# --- decoding ---------------------------------------------------------------


@dataclass(frozen=True)
class _Ctx:
    tensors: Sequence[torch.Tensor]
    move: bool
    meshes: Meshes | None


def decode(tree: Any, tensors: Sequence[torch.Tensor], move: bool = True, meshes: Meshes | None = None) -> Any:
    """Rebuild the object :func:`encode` produced ``tree`` from.

    ``tensors[i]`` is placed wherever the tree says ``{"T": i}``; tensors that
    were on an accelerator are copied to this process's current device of
    that type (:func:`ckptless.state.devices.target`), *asynchronously*
    (``non_blocking``): a caller that reuses the source buffer afterwards
    synchronises first (:func:`ckptless.state.restore.restore` does, once).
    Anything not produced by
    :func:`encode` raises :class:`ManifestError` naming the path: the tree may
    come from a peer or from disk and is validated, never trusted.

    ``move=False`` validates without moving: ``{"Td": ...}`` tensors are left
    where they are and only their device is checked to exist (a zero-size
    allocation). Restore uses it to vet a whole image before touching any
    object without copying every device tensor to its device first.

    DTensor nodes: their metadata is always validated. Without ``meshes`` the
    local shard itself is returned (the disk writer stores each rank's shard
    as a plain tensor). With ``meshes`` the recorded mesh must exist
    (:class:`StateError` naming the path otherwise) and, unless
    ``move=False``, a DTensor is built around the local tensor; a
    ``tensors[i]`` that already is a DTensor (a live one an in-place restore
    copied into) is returned as it is.
    """
    try:
        return _dec(tree, "", _Ctx(tensors, move, meshes), 0)
    except RecursionError as exc:  # pragma: no cover - MAX_DEPTH stops this first
        raise ManifestError("state tree nested too deeply") from exc


def _bad(path: str, what: str) -> ManifestError:
    return ManifestError(f"malformed state tree at {_where(path)}: {what}")


def _index(raw: Any, path: str, n: int) -> int:
    if type(raw) is not int or not 0 <= raw < n:
        raise _bad(path, f"tensor index {raw!r} not in [0, {n})")
    return raw


def _dec(node: Any, path: str, ctx: _Ctx, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise _bad(path, f"nested deeper than {MAX_DEPTH} levels")
    kind = type(node)
    if node is None or kind is bool or kind is int or kind is str:
        return node
    if kind is float:
        if not math.isfinite(node):
            raise _bad(path, "non-finite float must be tagged")
        return node
    if kind is list:
        return [_dec(v, _join(path, i), ctx, depth + 1) for i, v in enumerate(node)]
    if kind is not dict or len(node) != 1:
        raise _bad(path, f"unexpected node of type {kind.__name__}")
    ((tag, val),) = node.items()
    if tag == "d":
        return _dec_dict(val, path, ctx, depth, {})
    if tag == "o":
        if type(val) is not list or len(val) != 2:
            raise _bad(path, "OrderedDict payload must be [items, metadata]")
        od = _dec_dict(val[0], path, ctx, depth, OrderedDict())
        if val[1] is not None:
            meta = _dec(val[1], _join(path, "_metadata"), ctx, depth + 1)
            if not isinstance(meta, dict):
                raise _bad(path, "OrderedDict metadata is not a dict")
            od._metadata = meta  # type: ignore[attr-defined]
        return od
    if tag == "t":
        if type(val) is not list:
            raise _bad(path, "tuple payload is not a list")
        return tuple(_dec(v, _join(path, i), ctx, depth + 1) for i, v in enumerate(val))
    if tag == "T":
        return ctx.tensors[_index(val, path, len(ctx.tensors))]
    if tag == "Td":
        if type(val) is not list or len(val) != 2 or type(val[1]) is not str:
            raise _bad(path, "device tensor payload must be [index, device]")
        t = ctx.tensors[_index(val[0], path, len(ctx.tensors))]
        try:
            dev = devices.target(val[1])
            if not ctx.move:
                torch.empty(0, device=dev)  # the device exists here
                return t
            # A live tensor an in-place restore copied into stays on its own device (any GPU of the rank's).
            return t if t.device.type == dev.type else t.to(dev, non_blocking=True)
        except (RuntimeError, AssertionError, StateError) as exc:
            raise StateError(f"cannot restore {_where(path)} onto device {val[1]!r}: {exc}") from exc
    if tag == "DT":
        return _dec_dtensor(val, path, ctx, depth)
    if tag == "N":
        t = ctx.tensors[_index(val, path, len(ctx.tensors))]
        if t.device.type != "cpu":
            raise _bad(path, "numpy array tensor is not on the CPU")
        return t.numpy()
    if tag == "f":
        if val not in _NONFINITE:
            raise _bad(path, f"unknown non-finite float {val!r}")
        return _NONFINITE[val]
    if tag == "S":
        if type(val) is not list or any(type(s) is not int or s < 0 for s in val):
            raise _bad(path, "torch.Size payload must be a list of non-negative ints")
        return torch.Size(val)
    if tag == "n":
        return _dec_npscalar(val, path, ctx, depth)
    if tag == "dtype":
        dt = getattr(torch, val, None) if type(val) is str else None
        if not isinstance(dt, torch.dtype):
            raise _bad(path, f"unknown dtype {val!r}")
        return dt
    if tag == "device":
        try:
            return torch.device(val)
        except (RuntimeError, TypeError) as exc:
            raise _bad(path, f"invalid device {val!r}") from exc
    raise _bad(path, f"unknown tag {tag!r}")


def _dec_dtensor(val: Any, path: str, ctx: _Ctx, depth: int) -> Any:
    if type(val) is not list or len(val) != 5:
        raise _bad(path, "DTensor payload must be [local, placements, shape, stride, mesh]")
    local_node = val[0]
    if type(local_node) is not dict or len(local_node) != 1 or next(iter(local_node)) not in ("T", "Td"):
        raise _bad(path, "DTensor local shard is not a tensor node")
    spec = DTensorSpec.from_json(val[1:], path)
    local = _dec(local_node, path, ctx, depth + 1)
    if is_dtensor(local):  # a live DTensor an in-place restore already copied into
        if not same_layout(local, spec):
            raise StateError(f"cannot restore {_where(path)}: the live DTensor's layout differs from the image's")
        return local
    spec.check_local(local, path)
    if ctx.meshes is None:
        return local
    mesh = ctx.meshes.find(spec.mesh, path)
    if not ctx.move:
        return local
    return spec.build(local, mesh)


def _dec_dict(val: Any, path: str, ctx: _Ctx, depth: int, out: dict[Any, Any]) -> dict[Any, Any]:
    if type(val) is not list:
        raise _bad(path, "dict payload is not a list of pairs")
    for pair in val:
        if type(pair) is not list or len(pair) != 2:
            raise _bad(path, f"dict item {pair!r} is not a [key, value] pair")
        k, v = pair
        if type(k) is not str and type(k) is not int:
            raise _bad(path, f"dict key {k!r} is not a str or int")
        if k in out:
            raise _bad(path, f"duplicate dict key {k!r}")
        out[k] = _dec(v, _join(path, k), ctx, depth + 1)
    return out


def _dec_npscalar(val: Any, path: str, ctx: _Ctx, depth: int) -> Any:
    if type(val) is not list or len(val) != 2 or type(val[0]) is not str:
        raise _bad(path, "numpy scalar payload must be [dtype, value]")
    try:
        dt = np.dtype(val[0])
    except TypeError as exc:
        raise _bad(path, f"unknown numpy dtype {val[0]!r}") from exc
    if dt.kind not in _NP_KINDS or dt.itemsize > 8:
        raise _bad(path, f"numpy dtype {val[0]!r} is not a supported scalar type")
    raw = _dec(val[1], path, ctx, depth + 1)
    if type(raw) not in (bool, int, float):
        raise _bad(path, "numpy scalar value is not a number")
    try:
        return dt.type(raw)
    except (OverflowError, ValueError) as exc:
        raise _bad(path, f"value {raw!r} does not fit numpy {dt.name}") from exc


def tensor_paths_of(tree: Any) -> dict[int, str]:
    """Tensor index -> its path in the state (``model.0.weight``), read from an encoded tree without
    decoding it (names in error messages, e.g. silent data corruption; unknown tags are skipped)."""
    found: dict[int, str] = {}
    _walk(tree, "", found, 0)
    return found


def _walk(node: Any, path: str, found: dict[int, str], depth: int) -> None:
    if depth > 128:
        return
    if isinstance(node, list):
        for i, v in enumerate(node):
            _walk(v, f"{path}.{i}" if path else str(i), found, depth + 1)
        return
    if not isinstance(node, dict) or len(node) != 1:
        return
    ((tag, val),) = node.items()
    if tag in ("T", "N") and isinstance(val, int):
        found.setdefault(val, path)
    elif tag == "Td" and isinstance(val, list) and val and isinstance(val[0], int):
        found.setdefault(val[0], path)
    elif tag in ("d", "o"):
        items = val[0] if tag == "o" and isinstance(val, list) and val else val
        for item in items if isinstance(items, list) else ():
            if isinstance(item, list) and len(item) == 2:
                _walk(item[1], f"{path}.{item[0]}" if path else str(item[0]), found, depth + 1)
    elif tag in ("t", "DT") and isinstance(val, list):
        _walk(val if tag == "t" else val[0], path, found, depth + 1)

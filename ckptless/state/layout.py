"""The layout key of an image: what must match for one rank's image to fit another rank's objects.

Why: a pre-built warm spare runs the script's setup as a *standby rank* X
before anyone fails. If rank Y is lost instead, the spare can still take Y by
receiving Y's image into the objects it built as X, but only if those objects
have Y's shapes. The planner cannot look into a spare's objects; it can
compare the images the holders report: when X's image and Y's image have the
same layout key, an object tree built as X takes Y's bytes exactly as it takes
X's, and the spare skips its setup on the critical path (see
``docs/recovery.md``, "Any-rank adoption").

The key is a SHA-256 over:

* every tensor's dtype and shape, in image order, and the image's total and
  chunk sizes (a different shard shape, an extra buffer: another key);
* the skeleton of the non-tensor tree: every tag, string and dict key stays,
  numbers and booleans become a placeholder (a learning rate, a step count or a
  flag changes as training goes, the layout does not);
* the owner rank when the state holds a DTensor: a sharded tensor's place on
  its mesh is the rank's own, so no other rank's objects fit it.

Pure: no torch, no I/O; tested in ``tests/unit/test_layout_key.py``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from ckptless.state.manifest import Manifest, TensorEntry

_NUMBER = "#"
_FLAG = "?"


def skeleton(node: Any) -> tuple[Any, bool]:
    """The tree with numbers and booleans replaced by placeholders, and whether it holds a DTensor."""
    if isinstance(node, bool):
        return _FLAG, False
    if isinstance(node, (int, float)):
        return _NUMBER, False
    if node is None or isinstance(node, str):
        return node, False
    if isinstance(node, list):
        items = [skeleton(x) for x in node]
        return [s for s, _ in items], any(d for _, d in items)
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        rank_bound = False
        for tag, val in node.items():
            if tag in ("f", "T", "N"):  # a non-finite float; a tensor's index: position, not layout
                out[tag] = _NUMBER
                continue
            s, d = skeleton(val)
            out[tag] = s
            rank_bound = rank_bound or d or tag == "DT"
        return out, rank_bound
    return repr(type(node).__name__), False


def layout_key(tensors: Sequence[TensorEntry], total_bytes: int, chunk_bytes: int, tree: Any, owner: int) -> str:
    """The layout key of an image with these tensors and this tree (see the module docstring)."""
    skel, rank_bound = skeleton(tree)
    doc = {
        "tensors": [[t.dtype, list(t.shape)] for t in tensors],
        "total": total_bytes,
        "chunk": chunk_bytes,
        "tree": skel,
        "owner": owner if rank_bound else None,
    }
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:32]


def manifest_layout_key(m: Manifest) -> str:
    """The layout key of the image ``m`` describes."""
    return layout_key(m.tensors, m.total_bytes, m.chunk_bytes, m.tree, m.owner)

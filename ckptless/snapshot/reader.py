"""On-disk format of a snapshot, its verification, and exact restore.

Layout of one snapshot (``<directory>/<job_id>/step_<NNNNNNNN>/``)::

    rank0/                 a standalone DCP checkpoint of rank 0's state
      .metadata            (DCP's own files; keys "<object>.<path>", e.g.
      __0_0.distcp          "model.0.weight", "optimizer.state.0.exp_avg")
    rank1/ ...
    rank0.json             rank 0's part record (typed JSON, see PartRecord)
    rank1.json ...
    COMPLETE.json          the completion marker, written LAST by rank 0

Why one DCP checkpoint per rank: every rank's state (RNG streams, data
position, optimizer, even the replicated model) is restored exactly on the
same world layout, each rank writes without any collective from a background
thread, and a plain ``torch.distributed.checkpoint.load`` of
``step_N/rank<r>`` into ``{"model": m.state_dict(), ...}`` works without
ckptless.

Why ckptless never lets DCP unpickle: DCP stores non-tensor values (floats,
tuples, strings) as pickles and its loader unpickles them with
``weights_only=False``. ckptless loads only the *tensors* from DCP (named by
the fully qualified names recorded at save time) and rebuilds every
non-tensor value from the typed JSON manifest in the part record. The one
pickle DCP always reads, ``.metadata``, is checked against the SHA-256 the
part record holds before DCP opens it, and the tensor bytes are verified
against the manifest's CRC32C chunk checksums before anything is restored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from ckptless.errors import CkptlessError, SnapshotError
from ckptless.snapshot.config import check_job_id
from ckptless.state import checksum
from ckptless.state.capture import StateImage, restore
from ckptless.state.manifest import Manifest, dtype_from_name
from ckptless.state.registry import StateRegistry

log = logging.getLogger(__name__)

FORMAT = 1
MARKER = "COMPLETE.json"
STEP_RE = re.compile(r"^step_(\d{8,})$")


def step_dir(directory: Path | str, job_id: str, step: int) -> Path:
    return Path(directory) / job_id / f"step_{step:08d}"


def part_name(rank: int) -> str:
    return f"rank{rank}.json"


def failed_name(rank: int) -> str:
    return f"rank{rank}.failed"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def short_error(exc: BaseException) -> str:
    """One line for an exception; DCP's CheckpointException embeds whole tracebacks."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def _bad(path: Path, field: str, value: object, why: str) -> SnapshotError:
    return SnapshotError(f"{path}: field {field}={value!r}: {why}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError as exc:
        raise SnapshotError(f"{path}: missing") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SnapshotError(f"{path}: unreadable or not JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise _bad(path, "<root>", type(doc).__name__, "must be a JSON object")
    if doc.get("format") != FORMAT:
        raise _bad(path, "format", doc.get("format"), f"expected {FORMAT}")
    return doc


def _field(doc: dict[str, Any], path: Path, name: str, kind: type, want: object = None) -> Any:
    val = doc.get(name)
    if isinstance(val, bool) is not (kind is bool) or not isinstance(val, kind):
        raise _bad(path, name, val, f"missing or not {kind.__name__}")
    if want is not None and val != want:
        raise _bad(path, name, val, f"expected {want!r}")
    return val


@dataclass(frozen=True)
class PartRecord:
    """What one rank wrote: its DCP files, the tensors' FQNs and its manifest."""

    job_id: str
    step: int
    generation: int
    rank: int
    world_size: int
    files: dict[str, int]
    metadata_sha256: str
    fqns: tuple[str, ...]
    manifest: Manifest

    def to_bytes(self) -> bytes:
        doc = {"format": FORMAT, "job_id": self.job_id, "step": self.step, "generation": self.generation,
               "rank": self.rank, "world_size": self.world_size, "files": self.files,
               "metadata_sha256": self.metadata_sha256, "fqns": list(self.fqns),
               "manifest": json.loads(self.manifest.to_bytes())}
        return json.dumps(doc, separators=(",", ":")).encode("utf-8")

    @classmethod
    def read(cls, path: Path, job_id: str, step: int, rank: int, world_size: int) -> PartRecord:
        doc = _read_json(path)
        _field(doc, path, "job_id", str, job_id)
        _field(doc, path, "step", int, step)
        _field(doc, path, "rank", int, rank)
        _field(doc, path, "world_size", int, world_size)
        gen = _field(doc, path, "generation", int)
        files = _field(doc, path, "files", dict)
        if not files or not all(isinstance(k, str) and "/" not in k and type(v) is int for k, v in files.items()):
            raise _bad(path, "files", files, "must map plain file names to sizes")
        meta = _field(doc, path, "metadata_sha256", str)
        fqns = _field(doc, path, "fqns", list)
        if not all(isinstance(f, str) for f in fqns):
            raise _bad(path, "fqns", fqns[:4], "must be a list of strings")
        try:
            manifest = Manifest.from_bytes(json.dumps(doc.get("manifest")).encode("utf-8"))
        except CkptlessError as exc:
            raise _bad(path, "manifest", "...", str(exc)) from exc
        if manifest.job_id != job_id or manifest.owner != rank or manifest.version != step:
            raise _bad(path, "manifest", (manifest.job_id, manifest.owner, manifest.version),
                       f"expected (job_id, owner, version) = {(job_id, rank, step)}")
        if len(fqns) != len(manifest.tensors) or len(set(fqns)) != len(fqns):
            raise _bad(path, "fqns", len(fqns), f"expected {len(manifest.tensors)} distinct names")
        return cls(job_id, step, gen, rank, world_size, dict(files), meta, tuple(fqns), manifest)


@dataclass(frozen=True)
class SnapshotInfo:
    """A snapshot whose marker and part records were verified."""

    path: Path
    job_id: str
    step: int
    world_size: int
    generation: int
    wall_time: float
    part_sha256: tuple[str, ...]


def marker_bytes(info: SnapshotInfo) -> bytes:
    doc = {"format": FORMAT, "job_id": info.job_id, "step": info.step, "world_size": info.world_size,
           "generation": info.generation, "wall_time": info.wall_time,
           "ranks": [{"rank": r, "part_sha256": h} for r, h in enumerate(info.part_sha256)]}
    return json.dumps(doc, indent=1).encode("utf-8")


def _check_files(path: Path, rec: PartRecord, rank_dir: Path) -> None:
    for name, size in rec.files.items():
        f = rank_dir / name
        try:
            have = f.stat().st_size
        except OSError as exc:
            raise _bad(path, f"files.{name}", size, f"{f} is missing") from exc
        if have != size:
            raise _bad(path, f"files.{name}", size, f"{f} has {have} bytes (truncated or replaced)")


def verify_snapshot(path: Path, job_id: str, world_size: int) -> SnapshotInfo:
    """Check a step directory's marker, part records and file sizes (not the data bytes).

    Raises :class:`SnapshotError` naming the file and field that failed.
    """
    m = STEP_RE.match(path.name)
    if m is None:
        raise _bad(path, "<dirname>", path.name, "not a step_NNNNNNNN directory")
    marker = path / MARKER
    doc = _read_json(marker)
    _field(doc, marker, "job_id", str, job_id)
    _field(doc, marker, "world_size", int, world_size)
    step = _field(doc, marker, "step", int, int(m.group(1)))
    gen = _field(doc, marker, "generation", int)
    wall = doc.get("wall_time")
    if isinstance(wall, bool) or not isinstance(wall, (int, float)):
        raise _bad(marker, "wall_time", wall, "missing or not a number")
    ranks = _field(doc, marker, "ranks", list)
    if len(ranks) != world_size:
        raise _bad(marker, "ranks", len(ranks), f"expected {world_size} entries")
    digests = []
    for r, ent in enumerate(ranks):
        if not isinstance(ent, dict) or ent.get("rank") != r or not isinstance(ent.get("part_sha256"), str):
            raise _bad(marker, f"ranks[{r}]", ent, "expected {rank, part_sha256}")
        part = path / part_name(r)
        try:
            have = sha256_file(part)
        except OSError as exc:
            raise _bad(marker, f"ranks[{r}].part_sha256", ent["part_sha256"], f"{part} unreadable") from exc
        if have != ent["part_sha256"]:
            raise _bad(marker, f"ranks[{r}].part_sha256", ent["part_sha256"], f"{part} has digest {have}")
        rec = PartRecord.read(part, job_id, step, r, world_size)
        if rec.generation != gen:
            raise _bad(part, "generation", rec.generation, f"marker says {gen}")
        _check_files(part, rec, path / f"rank{r}")
        digests.append(have)
    return SnapshotInfo(path, job_id, step, world_size, gen, float(wall), tuple(digests))


def scan_steps(directory: Path | str, job_id: str) -> list[tuple[int, Path]]:
    """All ``step_*`` directories of a job, newest first."""
    jdir = Path(directory) / check_job_id(job_id)
    try:
        names = [p for p in jdir.iterdir() if p.is_dir()]
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise SnapshotError(f"{jdir}: cannot list snapshots ({exc})") from exc
    found = [(int(m.group(1)), p) for p in names if (m := STEP_RE.match(p.name))]
    return sorted(found, reverse=True)


def list_complete(directory: Path | str, job_id: str, world_size: int) -> list[SnapshotInfo]:
    """Every verified snapshot, newest first; others are skipped with a warning saying why."""
    out = []
    for _, path in scan_steps(directory, job_id):
        if not (path / MARKER).exists():
            log.info("snapshot %s is incomplete (no %s): skipped", path, MARKER)
            continue
        try:
            out.append(verify_snapshot(path, job_id, world_size))
        except SnapshotError as exc:
            log.warning("snapshot skipped: %s", exc)
    return out


def latest_complete(directory: Path | str, job_id: str, world_size: int) -> SnapshotInfo | None:
    """The newest snapshot that passes :func:`verify_snapshot`, or None."""
    for _, path in scan_steps(directory, job_id):
        if not (path / MARKER).exists():
            log.info("snapshot %s is incomplete (no %s): skipped", path, MARKER)
            continue
        try:
            return verify_snapshot(path, job_id, world_size)
        except SnapshotError as exc:
            log.warning("snapshot skipped: %s", exc)
    return None


def tensor_views(buf: torch.Tensor, manifest: Manifest) -> list[torch.Tensor]:
    """Per-tensor views of ``buf`` that each own an exactly-sized storage.

    Exact storages matter on save: DCP clones any tensor whose storage is
    larger than itself (a plain view of the flat buffer) before writing it.
    """
    arr = buf.numpy()
    views = []
    for e in manifest.tensors:
        dt = dtype_from_name(e.dtype)
        if e.nbytes == 0:
            views.append(torch.empty(e.shape, dtype=dt))
        else:
            views.append(torch.frombuffer(arr, dtype=dt, count=e.nbytes // dt.itemsize, offset=e.offset).view(e.shape))
    return views


def load_snapshot(info: SnapshotInfo, registry: StateRegistry, rank: int) -> int:
    """Restore ``rank``'s part of a verified snapshot into ``registry``; return its step.

    Every check happens before any object is touched: the part record's digest
    against the marker, DCP file sizes, ``.metadata``'s digest, then the
    loaded bytes against the manifest checksums (:class:`IntegrityError`).
    Needs no process group (DCP is used without collectives).
    """
    if type(rank) is not int or not 0 <= rank < info.world_size:
        raise SnapshotError(f"{info.path}: rank {rank!r} not in [0, {info.world_size})")
    part = info.path / part_name(rank)
    try:
        digest = sha256_file(part)
    except OSError as exc:
        raise SnapshotError(f"{part}: unreadable ({exc})") from exc
    if digest != info.part_sha256[rank]:
        raise _bad(part, "<file>", digest, f"digest differs from the marker's {info.part_sha256[rank]}")
    rec = PartRecord.read(part, info.job_id, info.step, rank, info.world_size)
    rank_dir = info.path / f"rank{rank}"
    _check_files(part, rec, rank_dir)
    try:
        meta_digest = sha256_file(rank_dir / ".metadata")
    except OSError as exc:
        raise SnapshotError(f"{rank_dir / '.metadata'}: unreadable ({exc})") from exc
    if meta_digest != rec.metadata_sha256:
        raise _bad(part, "metadata_sha256", rec.metadata_sha256, f"{rank_dir / '.metadata'} has digest {meta_digest}")
    m = rec.manifest
    buf = torch.zeros(m.total_bytes, dtype=torch.uint8)
    views = tensor_views(buf, m)
    flat = {fqn: v for fqn, v in zip(rec.fqns, views) if v.numel() > 0}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
            dcp.load(flat, checkpoint_id=str(rank_dir), no_dist=True)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise SnapshotError(f"{rank_dir}: DCP load failed: {short_error(exc)}") from exc
    checksum.verify(buf, m.chunk_bytes, list(m.chunk_checksums), m.total_bytes,
                    what=f"snapshot {rank_dir} (step {info.step})")
    restore(registry, StateImage(manifest=m, buffer=buf), verify=False)
    return info.step

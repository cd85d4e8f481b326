"""Node-local ``/dev/shm`` files of the peer store: names, owner records, cleanup.

Why a file name carries (job, node, owner, holder, slot): with K >= 2, several
holders of one owner can run on one host and share ``/dev/shm``. Names keyed by
(job, owner, slot) alone made them map the *same* payload file and race on
one manifest temp file (issue 8: ``No such file or directory: ...-o1-s1.json.tmp``
in a fault-free run). The holder rank makes a name unique inside a node; the
node id (hashed) keeps two agents that share a host apart (chaos clusters run
several "nodes" on one machine), so a rank number that moved to another
agent after a recovery never meets its previous incarnation's files.

Why owner records: ``/dev/shm`` is RAM and outlives every process; a job whose
agent was SIGKILLed would pin its replicas until reboot. Each agent writes
``<group>.owner.json`` (its pid, the process start time from
``/proc/<pid>/stat`` so a reused pid is not mistaken for the agent, and its pid
namespace) *before* it spawns workers; :func:`cleanup_stale` deletes every
group whose recorded agent is gone and never touches a group whose agent is
alive, nor one recorded from another pid namespace (containers sharing
``/dev/shm``), whose pid means nothing here.

Who removes a lost node's files (issue 17): on a real cluster they sit in the
lost machine's own ``/dev/shm`` and go with its next start-up sweep. Where
several agents share one directory (one host), the agents that survive do it:
:func:`remove_dead_groups` at every new generation (a node lost on this host
is freed within a recovery, not at the end) and :func:`finish_job` at exit
(the job leaves nothing behind). Both judge only by the owner record, so a
group of a live agent, whatever the coordinator thinks of its node (a
partition), is never touched.

Why buffers are reserved (:func:`reserve_mapping`): a tmpfs file is sparse, so
a full ``/dev/shm`` used to show up only when a page was first written through
the mapping: SIGBUS in Python, and inside a Gloo receive a failure that
surfaced only as the round's timeout (every mirror round timed out; issue 17). ``posix_fallocate`` turns that into ENOSPC
at allocation, where the caller falls back to memory and says so once
(:class:`FallbackNotice`).

Layout (``<job>`` = :func:`file_prefix`, ``<n>`` = 8 hex digits of the node id)::

    ckptless-<job>-n<n>-o<owner>-h<holder>-s<slot>.bin    payload, written in place
    ckptless-<job>-n<n>-o<owner>-h<holder>-s<slot>.json   manifest, written last (tmp + rename)
    ckptless-<job>-n<n>-r<rank>-own-<t>-b<i>.bin          rank's own capture buffer i (node-local tier)
    ckptless-<job>-n<n>-r<rank>-own-<t>-b<i>.json         its manifest, only while it holds the committed image
    ckptless-<job>-n<n>.owner.json                         the agent that owns this group

``<t>`` (8 hex digits) is random per mirror engine, so buffers of two engines
(two generations of one process, or a rank's successive processes) never share
a file; :mod:`ckptless.mirror.ownimage` writes and reads the own-image files.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ckptless.errors import ConfigError

log = logging.getLogger(__name__)

OWNER_RECORD_FORMAT = 1


def file_prefix(job_id: str) -> str:
    """Stable, filesystem-safe prefix for a job's files (sanitised name + hash)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id)[:40]
    digest = hashlib.blake2b(job_id.encode(), digest_size=4).hexdigest()
    return f"ckptless-{safe}-{digest}"


def node_tag(node: str | None) -> str:
    """8 hex digits naming a node id in file names (ids hold hostnames, pids, uuids)."""
    return hashlib.blake2b((node or "").encode(), digest_size=4).hexdigest()


def group_prefix(job_id: str, node: str | None) -> str:
    """Prefix of every file one node keeps for one job (the unit an owner record governs)."""
    return f"{file_prefix(job_id)}-n{node_tag(node)}"


def slot_path(shm_dir: str, job_id: str, node: str | None, owner: int, holder: int, slot: int, ext: str) -> str:
    """Path of one slot's payload (``bin``) or manifest (``json``) file."""
    return os.path.join(shm_dir, f"{group_prefix(job_id, node)}-o{owner}-h{holder}-s{slot}.{ext}")


def own_path(shm_dir: str, job_id: str, node: str | None, rank: int, token: str, index: int, ext: str) -> str:
    """Path of a rank's own capture buffer (``bin``) or of its committed-image manifest (``json``)."""
    return os.path.join(shm_dir, f"{group_prefix(job_id, node)}-r{rank}-own-{token}-b{index}.{ext}")


def owner_record_path(shm_dir: str, job_id: str, node: str | None = None) -> str:
    return os.path.join(shm_dir, f"{group_prefix(job_id, node)}.owner.json")


# The job part is matched lazily and the tail strictly to the end, so a name
# splits into (job, node, tail) in exactly one way. Holder-less names without a
# node are the pre-issue-8 layout; they are parsed so cleanup can remove them.
_FILE = re.compile(
    r"^(?P<job>ckptless-[A-Za-z0-9_.-]*?-[0-9a-f]{8})(?:-n(?P<node>[0-9a-f]{8}))?"
    r"(?:-o(?P<owner>\d+)(?:-h(?P<holder>\d+))?-s(?P<slot>[01])\.(?P<ext>bin|json)"
    r"|-r(?P<rank>\d+)-own-(?P<token>[0-9a-f]{8})-b(?P<index>\d+)\.(?P<oext>bin|json)|(?P<rec>\.owner\.json))"
    r"(?P<tmp>\.tmp)?$"
)


@dataclass(frozen=True)
class ShmFile:
    """One parsed ckptless file name.

    ``kind``: ``bin``/``json`` (a held replica's slot), ``own_bin``/``own_json``
    (a rank's own capture buffer and committed-image manifest: ``rank``,
    ``token``, ``index`` set) or ``owner`` (the owner record).
    """

    name: str
    job: str
    node: str | None
    owner: int | None
    holder: int | None
    slot: int | None
    kind: str
    tmp: bool
    rank: int | None = None
    token: str | None = None
    index: int | None = None

    @property
    def group(self) -> str:
        return self.job if self.node is None else f"{self.job}-n{self.node}"


def parse_name(name: str) -> ShmFile | None:
    """The parts of a ckptless shm file name, or None for any other file."""
    m = _FILE.match(name)
    if m is None:
        return None
    if m.group("rec") is not None:
        if m.group("node") is None:
            return None
        return ShmFile(name, m.group("job"), m.group("node"), None, None, None, "owner", m.group("tmp") is not None)
    if m.group("rank") is not None:
        if m.group("node") is None:
            return None  # own-image files always carry their node
        return ShmFile(name, m.group("job"), m.group("node"), None, None, None, f"own_{m.group('oext')}",
                       m.group("tmp") is not None, int(m.group("rank")), m.group("token"), int(m.group("index")))
    holder = m.group("holder")
    if (holder is None) != (m.group("node") is None):
        return None  # a holder always comes with a node; legacy names have neither
    return ShmFile(name, m.group("job"), m.group("node"), int(m.group("owner")),
                   None if holder is None else int(holder), int(m.group("slot")), m.group("ext"),
                   m.group("tmp") is not None)


def list_files(shm_dir: str) -> list[ShmFile]:
    """Every ckptless file in ``shm_dir`` (a missing directory holds none)."""
    try:
        names = sorted(os.listdir(shm_dir))
    except FileNotFoundError:
        return []
    return [f for f in map(parse_name, names) if f is not None]


def holder_files(shm_dir: str, job_id: str, node: str | None, holder: int) -> list[ShmFile]:
    """The files one holder identity (job, node, holder) owns, temp files included."""
    job, tag = file_prefix(job_id), node_tag(node)
    return [f for f in list_files(shm_dir) if f.job == job and f.node == tag and f.holder == holder]


def own_files(shm_dir: str, job_id: str, node: str | None, rank: int) -> list[ShmFile]:
    """The own-image files of one rank on one node (every engine's, temp files included)."""
    job, tag = file_prefix(job_id), node_tag(node)
    return [f for f in list_files(shm_dir)
            if f.job == job and f.node == tag and f.rank == rank and f.kind.startswith("own_")]


def unlink_quiet(path: str) -> bool:
    """Remove ``path``; False if it was already gone (a concurrent cleanup is fine)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _remove(shm_dir: str, files: list[ShmFile]) -> list[str]:
    # Owner records go last: a cleanup that dies half-way still leaves the record
    # that tells the next cleanup this group is dead.
    removed = []
    for f in sorted(files, key=lambda f: f.kind == "owner"):
        path = os.path.join(shm_dir, f.name)
        if unlink_quiet(path):
            removed.append(path)
    return removed


# --- buffers --------------------------------------------------------------------------------------
def reserve_mapping(path: str, nbytes: int, *, create_new: bool = False) -> torch.Tensor:
    """A shared mapping of ``path`` whose first ``nbytes`` are backed by reserved pages.

    Creates the file (``create_new``: it must not exist yet) or grows an
    existing one; ``posix_fallocate`` reserves every page now, so a full
    filesystem raises ``OSError`` (ENOSPC) here instead of a SIGBUS, or a
    silently stuck Gloo receive, on the first write into the mapping. It also
    sets the size: ``torch.from_file`` growing a file itself was observed to
    zero byte 0. The caller removes ``path`` when this raises.
    """
    nbytes = max(nbytes, 1)  # zero-length mappings are not allowed
    fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_EXCL if create_new else 0), 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def os_error_text(exc: BaseException) -> str:
    """``ENOSPC (No space left on device)``: the errno's name first, the one a user searches for."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{errno.errorcode.get(exc.errno, f'errno {exc.errno}')} ({exc.strerror or exc})"
    return f"{type(exc).__name__}: {exc}"


class FallbackNotice:
    """Says once per process and (who, directory), as a warning, that ``shm_dir`` could not take a buffer.

    Why once: with a full ``/dev/shm`` every slot, every version and every
    generation's engine would say the same; the first message names the
    directory, the errno and the bytes needed, later ones go to the debug log.
    ``reason`` keeps this notice's first cause.
    """

    _warned: set[tuple[str, str]] = set()  # (who, shm_dir) already warned about in this process
    _lock = threading.Lock()

    def __init__(self, shm_dir: str, who: str, consequence: str) -> None:
        self.shm_dir, self.who, self.consequence = shm_dir, who, consequence
        self.reason = ""

    def report(self, what: str, nbytes: int, exc: BaseException) -> None:
        text = os_error_text(exc)
        self.reason = self.reason or text
        with self._lock:
            first = (self.who, self.shm_dir) not in self._warned
            self._warned.add((self.who, self.shm_dir))
        if not first:
            log.debug("%s: %s of %d bytes not placed in %s: %s", self.who, what, nbytes, self.shm_dir, text)
            return
        log.warning("%s: %s of %d bytes could not be placed in %s: %s. Kept in memory only: %s. Later ones "
                    "that do not fit are handled the same way, without another warning; free space there or "
                    "choose another --shm-dir.", self.who, what, nbytes, self.shm_dir, text, self.consequence)


# --- owner records --------------------------------------------------------------------------------
def process_start_time(pid: int) -> int | None:
    """Start time (clock ticks since boot, /proc/<pid>/stat field 22) of a live process.

    None when there is no such process or it is a zombie: a dead agent that
    its parent has not reaped yet must count as dead.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = raw[raw.rfind(")") + 2:].split()  # comm may contain spaces and parentheses
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def agent_alive(pid: int, start_time: int | None) -> bool:
    """True while the process recorded as (pid, start time) still runs."""
    if not os.path.isdir("/proc"):  # not Linux: no start times, only "pid exists"
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    now = process_start_time(pid)
    return now is not None and (start_time is None or now == start_time)


def pid_namespace(pid: int | str = "self") -> str | None:
    """The pid namespace of ``pid`` (``pid:[4026531836]``), None where it cannot be read.

    Why: a pid recorded by an agent in another container that shares
    ``/dev/shm`` means nothing in this one; such a group is never judged dead.
    """
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


@dataclass(frozen=True)
class OwnerRecord:
    job_id: str
    node: str | None
    pid: int
    start_time: int | None
    written: float
    pid_ns: str | None = None  # None: an older record, or not readable (then judged as before)


def register_owner(shm_dir: str, job_id: str, pid: int | None = None, *, node: str | None = None) -> str:
    """Record that agent ``pid`` (default: this process) owns the job's files on ``node``.

    Call before spawning workers, so files never exist unowned. Written
    atomically (tmp + rename); re-registering replaces the record. A
    directory that cannot take even this record (full, read-only) raises
    :class:`ConfigError` naming it and the errno: every file of the job
    would be unowned there.
    """
    pid = os.getpid() if pid is None else pid
    path = owner_record_path(shm_dir, job_id, node)
    doc = {"format": OWNER_RECORD_FORMAT, "job_id": job_id, "node": node, "pid": pid,
           "start_time": process_start_time(pid), "pid_ns": pid_namespace(pid), "written": time.time()}
    tmp = path + ".tmp"
    try:
        os.makedirs(shm_dir, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except OSError as exc:
        unlink_quiet(tmp)
        raise ConfigError("shm_dir", shm_dir, f"cannot write this node's owner record there: "
                                              f"{os_error_text(exc)}") from exc
    return path


def read_owner(path: str) -> OwnerRecord | None:
    """The record at ``path``; None if missing or unreadable (treated as unowned)."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
        start, ns = doc.get("start_time"), doc.get("pid_ns")
        return OwnerRecord(str(doc["job_id"]), None if doc.get("node") is None else str(doc["node"]),
                           int(doc["pid"]), None if start is None else int(start), float(doc.get("written", 0.0)),
                           None if ns is None else str(ns))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


# --- cleanup ----------------------------------------------------------------------------------------
def cleanup_job(shm_dir: str, job_id: str, *, only_node: str | None = None) -> list[str]:
    """Remove every file of the job (or only ``only_node``'s group); returns the paths removed.

    Why a node filter: agents of one job that share a host each clean their
    own group at exit, so the first to finish never pulls files from under
    another node's still-running workers (their mappings would survive, but
    a respawn there could no longer re-attach).
    """
    job, tag = file_prefix(job_id), node_tag(only_node)
    return _remove(shm_dir, [f for f in list_files(shm_dir)
                             if f.job == job and (only_node is None or f.node == tag)])


def cleanup_stale(shm_dir: str, is_alive: Callable[[int, int | None], bool] = agent_alive,
                  orphan_grace_s: float | None = None, *, job_id: str | None = None) -> list[str]:
    """Remove the files of every group whose recorded agent is gone; returns paths removed.

    A group whose owner record names a live agent (``is_alive(pid, start_time)``)
    is kept, and so is one recorded from another pid namespace (its pid cannot
    be judged here). A group without a readable record (pre-issue-8 files, or
    a store used without an agent) is removed only when ``orphan_grace_s`` is
    given, no live agent is recorded for the same job, and none of its files
    changed for that long; by default such files are left alone. ``job_id``:
    only that job's groups are considered.
    """
    groups: dict[str, list[ShmFile]] = {}
    for f in list_files(shm_dir):
        groups.setdefault(f.group, []).append(f)
    here = pid_namespace()
    verdict: dict[str, bool | None] = {}  # group -> agent alive (None: no record)
    for group, files in groups.items():
        rec = next((f for f in files if f.kind == "owner" and not f.tmp), None)
        owner = None if rec is None else read_owner(os.path.join(shm_dir, rec.name))
        if owner is None:
            verdict[group] = None
        else:  # a foreign namespace's agent counts as alive: never removed, and its job is live
            foreign = owner.pid_ns is not None and here is not None and owner.pid_ns != here
            verdict[group] = foreign or is_alive(owner.pid, owner.start_time)
    live_jobs = {files[0].job for g, files in groups.items() if verdict[g]}
    only = None if job_id is None else file_prefix(job_id)
    now = time.time()
    removed: list[str] = []
    for group, files in groups.items():
        alive = verdict[group]
        if only is not None and files[0].job != only:
            continue
        if alive is False:
            removed += _remove(shm_dir, files)
        elif alive is None and orphan_grace_s is not None and files[0].job not in live_jobs:
            newest = max((_mtime(os.path.join(shm_dir, f.name)) for f in files), default=now)
            if now - newest >= orphan_grace_s:
                removed += _remove(shm_dir, files)
    return removed


def remove_dead_groups(shm_dir: str, job_id: str) -> list[str]:
    """The job's groups whose agent died (a node lost on this host): removed now; never raises.

    For a surviving agent on every new generation: a lost node's replicas and
    own images are read by no one (only its own agent and its workers used
    them), and at real sizes they pin GBs of RAM until the job ends. A failure
    to look is logged, not raised: cleanup never costs the job anything.
    """
    try:
        removed = cleanup_stale(shm_dir, job_id=job_id)
    except OSError as exc:
        log.warning("could not sweep dead nodes' files of job %r from %s: %s", job_id, shm_dir, os_error_text(exc))
        return []
    if removed:
        nodes = sorted({f.node or "" for f in map(parse_name, map(os.path.basename, removed)) if f is not None})
        log.info("removed %d file(s) of job %r's dead node(s) %s from %s", len(removed), job_id, nodes, shm_dir)
    return removed


def finish_job(shm_dir: str, job_id: str, node: str | None) -> list[str]:
    """An agent's exit: its own group, then every group of the job whose agent is dead.

    Why both: the own group is this agent's to remove (its workers are
    stopped); a group of a node lost earlier may still be here when it shared
    this host, and the last agent to leave must not leave it behind (issue 17:
    a lost node's 15 files outlived a job that ended well). Groups of agents
    still running are left to them.
    """
    return cleanup_job(shm_dir, job_id, only_node=node) + remove_dead_groups(shm_dir, job_id)


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:
        return 0.0


def stat_signature(path: str) -> tuple[int, int, int, int] | None:
    """(inode, size, mtime_ns, ctime_ns): changes when another process writes the file.

    A cheap way to invalidate a cached "verified" verdict: ``write()`` and a
    first write through a fresh mapping both update mtime on tmpfs. Not
    complete (a mapping that read a page before writing it does not), hence
    the age limit on cached verdicts as well.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

"""A full ``--shm-dir`` end to end (issue 17): real etcd, real agents, real workers, a real SIGKILL.

Was: on a tmpfs full from the start, the own image fell back to memory with a
warning, but the holders' replica slots were sparse files whose first write
failed silently inside Gloo; every mirror round of v0 timed out, every timeout
became ``generation N -> N+1: memory, resume at v0``, no step ever completed
(about 50 minutes to the generation guard), and nothing named the full
directory. Now a slot that cannot reserve its pages (ENOSPC) is held in
memory with one warning naming the directory, ENOSPC and the bytes, and the
rounds commit: the job runs, survives a kill from its peers' copies, and ends
bitwise equal to the fault-free run.

The ``--shm-dir`` is a 1 MiB tmpfs of the test's own (root only) filled to
12 KiB: room for the two agents' owner records (one page each), none for an
image of the reference job (tens of KiB per rank).
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptless.coordinator.embedded import EmbeddedEtcd
from ckptless.recovery.decision import RecoveryPlan

from .recovery_harness import Cluster, assert_bitwise_equal, run_fault_free, wait_membership

Finals = dict[int, dict[str, object]]
VICTIM, STEP = 1, 5
LEFT_FREE = 12 * 1024


@pytest.fixture(scope="module")
def baseline(module_etcd: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory) -> Finals:
    """The same job without faults and without shm: how state is protected never changes what is trained."""
    out = tmp_path_factory.mktemp("base")
    return run_fault_free(Cluster(module_etcd.endpoint, out, f"fullbase-{uuid.uuid4().hex[:6]}"))


@pytest.fixture
def full_shm(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs with only LEFT_FREE bytes free (a filler file of reserved pages), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    d = tmp_path / "shm"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        st = os.statvfs(d)
        fd = os.open(d / "filler", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize - LEFT_FREE)
        finally:
            os.close(fd)
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_full_shm_dir_degrades_to_memory_and_the_job_recovers_bitwise(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                                      full_shm: Path, baseline: Finals) -> None:
    out = tmp_path / "full"
    out.mkdir()
    c = Cluster(module_etcd.endpoint, out, f"shmfull-{uuid.uuid4().hex[:6]}",
                env={"REF_PAUSE_RANK": str(VICTIM), "REF_PAUSE_STEP": str(STEP)})
    try:
        for _ in range(2):
            c.start_agent("--shm-dir", str(full_shm))
        # Reaching the pause at all is the first check: before the fix no step ever completed.
        victim = c.paused_pid(VICTIM, timeout=120)
        os.kill(victim, signal.SIGKILL)
        m = wait_membership(c, 1)
        rec = c.exit_record(VICTIM)
        c.wait(timeout=180)
        last = c.membership()
    finally:
        c.kill_all()
    text = c.log_text()
    assert_bitwise_equal(c.finals(), baseline)
    # One incident, recovered from the peers' in-memory copies at a committed step, not from v0.
    assert last is not None and last.generation == 1, f"more than one incident:\n{c.tail()}"
    d = m.decision
    assert isinstance(d, RecoveryPlan) and d.resume_version > 0, d  # was: every round failed, resume at v0, forever
    assert not d.node_local and [t.owner for t in d.transfers] == [VICTIM], d
    assert rec is not None and rec.signal == signal.SIGKILL and rec.local_image is None, rec  # its own image was in memory
    # The full directory is named: where, why (ENOSPC) and how much, for replica slots and own images alike.
    named = [line for line in text.splitlines() if "ENOSPC" in line and str(full_shm) in line]
    assert any("replica of owner" in line and "bytes" in line for line in named), text[-6000:]
    assert any("own image buffer" in line for line in named), text[-6000:]
    assert "Timed out waiting" not in text, text[-6000:]  # the rounds' old symptom
    assert sorted(os.listdir(full_shm)) == ["filler"], "files of the job left in the shm dir"

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
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptless.coordinator.embedded import EmbeddedEtcd
from ckptless.recovery.decision import RecoveryPlan

from ..harness.cluster import FaultFree, assert_bitwise_equal, new_cluster, wait_membership
from ..harness.shm import mounted_tmpfs

VICTIM, STEP = 1, 5
LEFT_FREE = 12 * 1024
# The baseline (conftest.py) runs without --shm-dir: how state is protected never changes what is trained.


@pytest.fixture
def full_shm(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs with only LEFT_FREE bytes free (a filler file of reserved pages), unmounted afterwards."""
    d = tmp_path / "shm"
    d.mkdir()
    with mounted_tmpfs(d, "1m"):
        st = os.statvfs(d)
        fd = os.open(d / "filler", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize - LEFT_FREE)
        finally:
            os.close(fd)
        yield d


def test_full_shm_dir_degrades_to_memory_and_the_job_recovers_bitwise(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                                      full_shm: Path, baseline: FaultFree) -> None:
    c = new_cluster(module_etcd.endpoint, tmp_path, "shmfull", REF_PAUSE_RANK=str(VICTIM), REF_PAUSE_STEP=str(STEP),
                    REF_PAUSE_COMMITTED="1")
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
    assert_bitwise_equal(c.finals(), baseline.finals)
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

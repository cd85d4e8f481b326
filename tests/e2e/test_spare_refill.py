"""--spare-refill's decisions (launcher/refill.py) and WorkerGroup.add_like, on real processes.

The end-to-end case (a second failure served by the new pre-built spare, bitwise equal) is
tests/e2e/test_recovery_e2e.py::test_spare_refill_serves_a_second_failure_from_a_new_prebuilt_spare.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ckptless.launcher import refill
from ckptless.launcher.slots import Slot
from ckptless.launcher.worker_logs import WorkerLogs, logs_for
from ckptless.launcher.workers import WorkerGroup


def _slots(*ranks: int | None, alive: bool = True) -> list[Slot]:
    out = []
    for i, r in enumerate(ranks):
        s = Slot(i, f"n/w{i}", r, f"hb{i}", alive=alive)
        s.spare = r is None
        out.append(s)
    return out


def test_recovery_over_only_once_every_live_rank_trains_in_the_generation() -> None:
    slots = _slots(0, 1, None)
    progress = {"hb0": {"state": "training", "generation": 2}, "hb1": {"state": "training", "generation": 2}}
    assert refill.recovery_over(slots, 2, progress.get)
    assert not refill.recovery_over(slots, 3, progress.get), "a rank still in the previous generation"
    progress["hb1"] = {"state": "recovering", "generation": 2}
    assert not refill.recovery_over(slots, 2, progress.get)
    assert not refill.recovery_over(slots, 2, {}.get), "no heartbeat yet"
    assert not refill.recovery_over(_slots(None), 0, progress.get), "no rank here: nothing says it is over"
    dead = _slots(0, alive=False) + _slots(None)
    assert not refill.recovery_over(dead, 0, progress.get)


def test_spares_missing_counts_live_unassigned_spares() -> None:
    slots = _slots(0, None, None)
    assert refill.spares_missing(slots, 2) == 0 and refill.spares_missing(slots, 3) == 1
    slots[1].alive = False
    assert refill.spares_missing(slots, 2) == 1


def test_spare_env_names_its_own_files_and_standby_rank() -> None:
    env = refill.spare_env("n/spare3", "/hb/hb5", "/hb/exit5.json", 2, {"LOCAL_RANK": "5"})
    assert env["CKPTLESS_WORKER_ID"] == "n/spare3" and env["LOCAL_RANK"] == "5"
    assert env["CKPTLESS_STANDBY_RANK"] == env["RANK"] == "2" and env["CKPTLESS_ROLE"] == "spare"
    assert refill.spare_env("n/s", "h", "e", None, {"LOCAL_RANK": "1"})["CKPTLESS_STANDBY_RANK"] == ""
    # on a GPU node the device env puts it on its own GPU (launcher/devices.py)
    gpu = refill.spare_env("n/s", "h", "e", 0, {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "6"})
    assert gpu["CUDA_VISIBLE_DEVICES"] == "6" and gpu["LOCAL_RANK"] == "0"


def test_logs_move_to_the_new_local_rank_directory(tmp_path: Path) -> None:
    base = tmp_path / "attempt_0"
    logs = WorkerLogs(str(base / "2" / "stdout.log"), os.devnull, True, False, str(base / "2" / "error.json"))
    moved = logs_for(logs, 2, 7)
    assert moved.stdout == str(base / "7" / "stdout.log") and moved.stderr == os.devnull
    assert moved.error_file == str(base / "7" / "error.json") and (base / "7").is_dir()
    assert logs_for(WorkerLogs(), 2, 7) == WorkerLogs()


def test_add_like_starts_one_more_worker_with_the_template_command(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    code = "import os, sys; open(os.path.join(sys.argv[1], os.environ['WHO']), 'w').write(os.environ['LOCAL_RANK'])"
    g = WorkerGroup([[sys.executable, "-c", code, str(out)]], [{**os.environ, "WHO": "first", "LOCAL_RANK": "0"}])
    with g:
        g.start(start_server=False)
        lr = g.add_like(0, {"WHO": "added", "LOCAL_RANK": "1"})
        assert lr == 1 and g.size == 2
        exits = g.wait(60)
    assert exits is not None and all(e.exitcode == 0 for e in exits.values())
    assert (out / "first").read_text() == "0" and (out / "added").read_text() == "1"

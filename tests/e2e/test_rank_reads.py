"""ckptless.worker.rank_reads: which of a pre-built spare's setup reads name its rank (issue 17), seen from
the process's first line (issue 35: a read before ``ckptless.init()`` went unseen)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from ckptless.worker import rank_reads, spare_site

from ..harness.repo import child_env

SPARE = {"CKPTLESS_ROLE": "spare", "CKPTLESS_STANDBY_RANK": "0"}
# A script that reads its rank before anything of ckptless is imported, then reports what was seen.
EARLY_READ = textwrap.dedent("""
    import os
    rank = int(os.environ["RANK"])
    import json, sys
    from ckptless.worker import rank_reads
    print(json.dumps({"reads": rank_reads.reads(), "from_start": rank_reads.watched_from_start(),
                      "torch": "torch" in sys.modules, "path": [p for p in sys.path if "spare_site" in p],
                      "watched": type(os.environ).__name__}))
""")


def _started(env: dict[str, str], tmp_path: Path, extra_path: str = "") -> dict[str, object]:
    """What a fresh ``python script`` saw, started as ckptless-run starts a node's workers."""
    script = tmp_path / "train.py"
    script.write_text(EARLY_READ)
    full = dict(child_env(), RANK="2", **env)
    full["PYTHONPATH"] = spare_site.pythonpath(os.pathsep.join(p for p in (extra_path, full["PYTHONPATH"]) if p))
    out = subprocess.run([sys.executable, "-u", str(script)], env=full, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    doc: dict[str, object] = json.loads(lines[-1])
    doc["stdout"] = lines[:-1]
    return doc


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    rank_reads.start()
    try:
        yield
    finally:
        rank_reads.stop()


def test_the_scripts_own_reads_are_named_with_their_line(watch: None) -> None:
    assert int(os.environ["RANK"]) == 3
    assert os.environ.get("LOCAL_RANK") == "1"
    assert os.environ.get("PATH") is not None  # not a rank variable
    reads = rank_reads.reads()
    assert len(reads) == 2 and all("test_rank_reads.py:" in r for r in reads), reads
    assert reads[0].startswith("os.environ['RANK'] at") and reads[1].startswith("os.environ['LOCAL_RANK'] at")


def test_get_rank_is_watched_and_still_answers(watch: None) -> None:
    with pytest.raises((ValueError, RuntimeError)):  # no default group here: torch's own answer, unchanged
        dist.get_rank()
    assert [r.split(" at ")[0] for r in rank_reads.reads()] == ["torch.distributed.get_rank()"]


def test_whole_environment_copies_and_library_reads_are_not_the_scripts(watch: None) -> None:
    subprocess.run(["true"], check=True)  # subprocess copies the environment for the child
    os.environ.copy()
    assert dict(os.environ.items())["RANK"] == "3"  # a walk over every variable (tqdm's, at import)
    list(os.environ.values())
    from ckptless.data import ResumableSampler

    ResumableSampler(8, seed=1)  # takes rank and world from the job (ckptless's own read)
    assert rank_reads.reads() == []


def test_stop_restores_what_it_replaced() -> None:
    before_class, before_get_rank = os.environ.__class__, dist.get_rank
    rank_reads.start()
    assert os.environ.__class__ is not before_class and dist.get_rank is not before_get_rank
    held = dist.get_rank  # `from torch.distributed import get_rank` in the setup
    rank_reads.stop()
    assert os.environ.__class__ is before_class and dist.get_rank is before_get_rank
    with pytest.raises((ValueError, RuntimeError)):  # still torch's own answer (no default group here)
        held()
    os.environ.get("RANK")
    assert rank_reads.reads() == []  # nothing recorded once stopped


def test_a_spares_read_before_ckptless_is_imported_is_seen(tmp_path: Path) -> None:
    seen = _started(SPARE, tmp_path)
    assert seen["from_start"] is True and seen["watched"] == "_WatchedEnviron"
    assert seen["reads"] == [f"os.environ['RANK'] at {tmp_path / 'train.py'}:3"], seen
    assert seen["torch"] is False, "the hook imported torch before the script (which may set what torch reads)"
    assert seen["path"] == [], "the script's sys.path must be the one it would have had"


def test_a_spare_that_waits_for_its_rank_is_watched_too(tmp_path: Path) -> None:
    """--no-spare-prebuild: RANK is a placeholder until ckptless.init() returns the real one."""
    seen = _started({"CKPTLESS_ROLE": "spare", "CKPTLESS_STANDBY_RANK": ""}, tmp_path)
    assert seen["from_start"] is True and seen["reads"] == [f"os.environ['RANK'] at {tmp_path / 'train.py'}:3"]


def test_other_workers_are_not_watched(tmp_path: Path) -> None:
    for env in ({"CKPTLESS_ROLE": "member"}, {"CKPTLESS_ROLE": "replacement"}, {}):
        seen = _started(env, tmp_path)
        assert seen["from_start"] is False and seen["reads"] == [] and seen["watched"] == "_Environ", (env, seen)


def test_the_sitecustomize_it_shadows_still_runs_and_its_reads_are_not_the_scripts(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nprint('shadowed ran as rank', os.environ['RANK'])\n")
    seen = _started(SPARE, tmp_path, extra_path=str(site))
    assert seen["stdout"] == ["shadowed ran as rank 2"]
    assert seen["reads"] == [f"os.environ['RANK'] at {tmp_path / 'train.py'}:3"], seen


def test_a_forked_worker_drops_its_servers_watch_and_starts_its_own() -> None:
    """The fork server calls at_process_start(env) in each new worker (launcher/forkserver_program.py)."""
    before_class, before_get_rank = os.environ.__class__, dist.get_rank
    rank_reads.start()
    os.environ.get("RANK")
    assert rank_reads.reads()
    try:
        assert rank_reads.at_process_start(SPARE) and rank_reads.watched_from_start()
        assert rank_reads.reads() == [] and dist.get_rank is before_get_rank  # nothing inherited
        os.environ.get("LOCAL_RANK")
        rank_reads.start()  # ckptless.init() in the spare: the reads since its start are kept
        assert [r.split(" at ")[0] for r in rank_reads.reads()] == ["os.environ['LOCAL_RANK']"]
    finally:
        assert not rank_reads.at_process_start({})  # not a spare: nothing watched
    assert os.environ.__class__ is before_class and dist.get_rank is before_get_rank
    assert not rank_reads.watched_from_start()


def test_pythonpath_puts_the_site_first_once() -> None:
    once = spare_site.pythonpath(os.pathsep.join(["/a", spare_site.DIR, "/b"]))
    assert once.split(os.pathsep) == [spare_site.DIR, "/a", "/b"]
    assert spare_site.pythonpath(None) == spare_site.DIR

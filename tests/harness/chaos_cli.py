"""``ckptless-chaos`` run in the test's own process, and its one verdict line."""

from __future__ import annotations

import pytest

from ckptless.chaos.main import main


def run_chaos(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """The exit code and everything printed."""
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def verdict(text: str) -> str:
    """The single ``PASS ...``/``FAIL ...`` line of a run."""
    lines = [ln for ln in text.splitlines() if ln.startswith(("PASS ", "FAIL "))]
    assert len(lines) == 1, text[-6000:]
    return lines[0]


def passes(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run it; it must exit 0 with one PASS verdict, which is returned."""
    code, text = run_chaos(capsys, *argv)
    line = verdict(text)
    assert code == 0 and line.startswith("PASS "), text[-6000:]
    return line

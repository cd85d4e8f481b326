"""Docs that cannot drift: every ckptless-run flag of our own and every CKPTLESS_* variable the code
reads or sets must be documented in docs/configuration.md (torchrun's own flags: docs/launcher.md)."""

from __future__ import annotations

import re

from torch.distributed.run import get_args_parser

from ckptless.launcher.args import build_parser

from ..harness.repo import REPO

CONFIG_DOC = (REPO / "docs" / "configuration.md").read_text()
NOT_VARIABLES = {"CKPTLESS_PREFIX", "CKPTLESS_ETCD_"}  # a constant's name, a prefix in prose


def _options(parser: object) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--")}  # type: ignore[attr-defined]


def test_every_own_flag_is_documented() -> None:
    ours = _options(build_parser({})) - _options(get_args_parser())
    missing = sorted(f for f in ours if f not in CONFIG_DOC and f.replace("_", "-") not in CONFIG_DOC)
    assert ours, "no ckptless-run flags found: the test is broken"
    assert not missing, f"ckptless-run flags missing from docs/configuration.md: {missing}"


def test_every_ckptless_variable_is_documented() -> None:
    names: set[str] = set()
    for pkg in ("ckptless", "launcher", "chaos"):
        for path in (REPO / pkg).rglob("*.py"):
            names |= set(re.findall(r"CKPTLESS_[A-Z0-9_]+", path.read_text()))
    names -= NOT_VARIABLES
    assert len(names) > 10, "too few variables found: the test is broken"
    missing = sorted(n for n in names if n not in CONFIG_DOC)
    assert not missing, f"variables read or set by the code but missing from docs/configuration.md: {missing}"


def test_no_doc_claims_a_working_flag_is_missing() -> None:
    """A doc that says "not implemented" about something that works is a bug."""
    for doc in (REPO / "docs").glob("*.md"):
        text = doc.read_text()
        for flag in ("--spares", "--snapshot-every", "--hang-timeout", "--replicas", "--shm-dir", "--metrics-port"):
            for line in text.splitlines():
                if flag in line:
                    assert not re.search(r"not (yet )?implemented|coming soon", line, re.I), f"{doc.name}: {line}"

"""File-descriptor checks shared by the tests."""

from __future__ import annotations

import os


def fd_open(fd: int) -> bool:
    """Is ``fd`` an open descriptor in this process?"""
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False

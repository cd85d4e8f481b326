"""torch's NCCL settings a recovery depends on: one table, applied before the first communicator, checked once.

Why: torch's ``ProcessGroupNCCL`` has machinery of its own that acts on a
failure whatever ckptless does, and with torch's defaults it ends the
processes a recovery keeps (measured on one H200, torch 2.11, NCCL 2.28.9,
three ranks over NCCL's socket transport: docs/gpu-runs/2026-11-28-h200/):

* on any failed or timed-out collective the watchdog writes ``exception_dump``
  into the *root* store (beneath every PrefixStore: the agent's TCPStore,
  shared by all generations, never deleted), whatever the error mode. The
  heartbeat monitor of each process's first NCCL group polls that key, dumps,
  sleeps ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` (480 s) and ends the process
  (``LOG(FATAL)``, SIGABRT). Measured: both survivors of a peer death were
  ended 8 s (the heartbeat timeout set there) after the key appeared, and a
  process that formed its first communicator *after* the key was written
  (a replacement) was ended 14 s later; with monitoring or dumping off, it lived.
* after an error the watchdog sleeps 4 x ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``
  (60 s by default) holding the group's work list: a new collective on that
  group, and the group's destructor, wait that long.
* ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` unset means 3 (tear the process down).

Each setting is given to the workers by ``ckptless-run`` (unless the user
set it) and to this process by ``ckptless.init()`` before any communicator
is made (torch reads them when a group is constructed); a value that would
let torch end a survivor or a replacement is refused at start with one
:class:`~ckptless.errors.ConfigError` naming it, a value that only costs time
is allowed with a warning. docs/configuration.md has one line per setting;
the torch sources behind each are in the table below (``ProcessGroupNCCL.cpp``
as of torch 2.13, "S2" lines; headers exact per wheel).

What ckptless does instead of torch's machinery: it aborts every
communicator of a failed generation from a thread of its own at the
incident (:mod:`ckptless.worker.abort`), drops them off the training thread
(:mod:`ckptless.worker.reaper`), and a hung rank is ended by its agent's
progress watchdog, which is what torch's heartbeat monitor is for.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from ckptless import environment
from ckptless.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Setting:
    """One torch variable: the value ckptless gives it, and why."""

    name: str
    value: str
    answers: str  # the torch behaviour it answers
    source: str  # where torch does it


SETTINGS: tuple[Setting, ...] = (
    Setting("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2",
            "1 and 3 end the process ~60 s after any NCCL error (with every replica it holds); unset means 3; "
            "2 aborts the communicator and keeps the process",
            "ProcessGroupNCCL.cpp S2:978-979, 1012-1019, 2429-2437; ProcessGroupNCCL.hpp (2.11) :64-68"),
    Setting("TORCH_NCCL_DUMP_ON_TIMEOUT", "0",
            "the first group of a process polls the root store's exception_dump key (written on any failed "
            "collective, never deleted) and starts the monitor's kill: a replacement forming its first group in "
            "a later generation is ended TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC later",
            "ProcessGroupNCCL.cpp S2:1788, 1839-1945; ProcessGroupNCCL.hpp (2.11) :70-74"),
    Setting("TORCH_NCCL_ENABLE_MONITORING", "0",
            "the heartbeat monitor ends the process (LOG(FATAL)) after a dump, or when the watchdog looks stuck "
            "(ckptless's own aborts and lock waits can look so); ckptless's agent ends a hung rank itself",
            "ProcessGroupNCCL.cpp S2:1792-1793, 2106-2123; ProcessGroupNCCL.hpp (2.11) :95-101"),
    Setting("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "250",
            "after an error the watchdog sleeps 4x this holding the group's work list: a new collective on the "
            "broken group and its destructor wait that long (default 60 s; 1 s here)",
            "ProcessGroupNCCL.cpp S2:1782-1783, 2278, 2426-2427"),
    Setting("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "60",
            "with the monitor off, the longest a group's destructor waits for it on torch 2.11 (its sleep "
            "ignores stop()); must exceed the watchdog's post-error sleep if a user turns the monitor on",
            "ProcessGroupNCCL.cpp S2:1780-1781, 1947-1972, 2084-2095"),
    Setting("TORCH_NCCL_LOG_CPP_STACK_ON_UNCLEAN_SHUTDOWN", "0",
            "a possibly hanging step (a C++ stack dump) on the monitor's exit path",
            "ProcessGroupNCCL.cpp S2:1790-1791, 1993-1995, 2063-2071"),
)

#: Values refused at start, with why (a torch setting that ends the processes a recovery keeps).
_REFUSED = {
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"): "tears the process down after an NCCL error, with the replicas it holds",
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"): "tears the process down after an NCCL error, with the replicas it holds",
}


def effective(env: Mapping[str, str]) -> dict[str, str]:
    """Each setting's value in ``env`` (the user's, if set; ckptless's otherwise)."""
    return {s.name: (env.get(s.name) or "").strip() or s.value for s in SETTINGS}


def check(env: Mapping[str, str]) -> list[str]:
    """Refuse a combination that lets torch end a survivor or a replacement (one ConfigError naming the
    variable and its value); return warnings for values that only cost time."""
    values = effective(env)
    mode = values["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    if mode not in ("0", "2"):
        why = _REFUSED.get(("TORCH_NCCL_ASYNC_ERROR_HANDLING", mode), "is not a mode torch knows")
        raise ConfigError("TORCH_NCCL_ASYNC_ERROR_HANDLING", mode, f"{why}: use 2 (abort the communicator, keep the "
                                                                   "process; ckptless-run's default) or 0, or unset it")
    monitoring, dumping = values["TORCH_NCCL_ENABLE_MONITORING"], values["TORCH_NCCL_DUMP_ON_TIMEOUT"]
    if monitoring != "0" and dumping != "0":
        raise ConfigError("TORCH_NCCL_DUMP_ON_TIMEOUT", dumping,
                          f"with TORCH_NCCL_ENABLE_MONITORING={monitoring}, torch ends every process whose first NCCL "
                          "group sees the exception_dump key a failure left in the job's store: each later replacement "
                          "dies TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC after it joins; set one of them to 0 (ckptless sets both)")
    warnings = []
    if monitoring != "0":
        wait_s = 4 * _number(values, "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC") / 1000
        heartbeat_s = _number(values, "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")
        if heartbeat_s <= wait_s + 5:
            raise ConfigError("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", values["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"],
                              f"with the monitor on it must exceed the watchdog's post-error sleep ({wait_s:.0f} s, "
                              "4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC) by 5 s, or a normal error looks like a hung "
                              "watchdog and the process is ended")
        warnings.append(f"TORCH_NCCL_ENABLE_MONITORING={monitoring}: torch's heartbeat monitor ends a process whose NCCL "
                        "watchdog it finds stuck; ckptless's agent already ends a hung rank (--hang-timeout)")
    if _number(values, "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC") > 2000:
        warnings.append(f"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC={values['TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC']}: after "
                        "an NCCL error a new collective on the broken group waits 4x this before it can fail")
    return warnings


def _number(values: Mapping[str, str], name: str) -> float:
    try:
        return float(values[name])
    except ValueError:
        raise ConfigError(name, values[name], "must be a number") from None


def for_workers(parent_env: Mapping[str, str]) -> dict[str, str]:
    """What ``ckptless-run`` puts in each worker's environment: every setting, the user's value where set
    (checked first: a refused one ends the launch with exit 2)."""
    check(parent_env)
    return effective(parent_env)


def apply(formation_timeout_s: float) -> None:
    """Give this process every setting the user did not set, and check them: a recovering worker, before any
    NCCL communicator exists (torch reads them when a group is made).

    ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` (read once per process; torch's default 1800 s) becomes
    ``formation_timeout_s`` (the recovery timeout): the longest a non-blocking init in progress holds its
    communicator's lock, hence the longest an abort of a formation (on the aborter's thread, never the
    training thread's: :mod:`ckptless.worker.forming`) and the helper thread inside it are held."""
    for w in check(environment.environ()):
        log.warning("ckptless: %s", w)
    for s in SETTINGS:
        environment.set_default(s.name, s.value)
    environment.set_default("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(max(1, int(formation_timeout_s))))

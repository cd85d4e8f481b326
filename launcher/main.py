"""``ckptless-run``: a drop-in for ``torchrun`` backed by ckptless's etcd coordinator.

Why errors are one line: a launcher is used from shells and schedulers; a
ckptless error (bad flag value, unreachable etcd, a closed rendezvous) is the
user's to fix and a traceback would bury the one fact that matters. A job that
has already ended is not an error of this agent's: one line, and the job's
outcome as the exit status (0: it succeeded; 1: it failed).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from ckptless import environment
from ckptless.errors import CkptlessError, JobAlreadyEnded
from ckptless.worker import exit_guard


def main(argv: Sequence[str] | None = None) -> int:
    agent = None
    try:
        # The agent forks workers while gRPC threads run; gRPC's fork handlers only
        # log noise then, and workers exec at once, so turn them off. (Inside the
        # try: reading the environment raises ConfigError on a malformed variable.)
        environment.set_default("GRPC_ENABLE_FORK_SUPPORT", "false")
        from ckptless.launcher.args import check_implemented, parse_args

        logging.basicConfig(
            level=environment.current().log_level.upper(),
            format="[ckptless-run %(asctime)s %(levelname)s] %(message)s",
        )
        cfg = parse_args(list(sys.argv[1:] if argv is None else argv))
        check_implemented(cfg)
        from ckptless.worker import nccl_env

        for warning in nccl_env.check(environment.environ()):  # torch's NCCL settings: refused here, at start
            logging.getLogger("ckptless.agent").warning("%s", warning)
        from ckptless.launcher.agent import NodeAgent

        agent = NodeAgent(cfg)
        return agent.run().exit_code
    except JobAlreadyEnded as exc:  # nothing to join: one line, and the job's own outcome (docs/launcher.md)
        print(f"ckptless-run: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except CkptlessError as exc:
        stopped = agent.stop_signal if agent is not None else None
        if stopped is not None:  # a wait interrupted by SIGINT/SIGTERM: the shell's convention
            return 128 + stopped
        print(f"ckptless-run: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    """The console script: ``main()``, then leave at once.

    Everything the agent owns is released by then (workers stopped, lease
    revoked, etcd stopped); interpreter finalization would only add seconds of
    torch/gRPC/TCPStore teardown between a Ctrl-C and the shell prompt.
    """
    exit_guard.leave_now(main())


if __name__ == "__main__":
    entry()

"""``ckptless-run``: a drop-in for ``torchrun`` backed by ckptless's etcd coordinator.

Why errors are one line: a launcher is used from shells and schedulers; a
ckptless error (bad flag value, unreachable etcd, a closed rendezvous) is the
user's to fix and a traceback would bury the one fact that matters.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from ckptless.errors import CkptlessError


def main(argv: Sequence[str] | None = None) -> int:
    # The agent forks workers while gRPC threads run; gRPC's fork handlers only
    # log noise then, and workers exec at once, so turn them off.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from ckptless.launcher.args import check_implemented, parse_args

    logging.basicConfig(
        level=os.environ.get("CKPTLESS_LOG_LEVEL", "WARNING").upper(),
        format="[ckptless-run %(asctime)s %(levelname)s] %(message)s",
    )
    try:
        cfg = parse_args(list(sys.argv[1:] if argv is None else argv))
        check_implemented(cfg)
        from ckptless.launcher.agent import NodeAgent

        return NodeAgent(cfg).run().exit_code
    except CkptlessError as exc:
        print(f"ckptless-run: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

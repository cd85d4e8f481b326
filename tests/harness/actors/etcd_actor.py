"""A separate process that holds etcd state, so tests can SIGKILL it for real.

usage: etcd_actor.py ENDPOINT COMMAND ARGS... ; announces progress by writing
files (the test waits on them), never by timing.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from ckptless.coordinator.client import EtcdClient
from ckptless.coordinator.config import EtcdConfig
from ckptless.coordinator.election import Election
from ckptless.coordinator.generation import GenerationCounter
from ckptless.coordinator.session import Session


def _announce(path: str, doc: dict[str, object]) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.rename(path)


def main() -> None:
    endpoint, cmd, *args = sys.argv[1:]
    client = EtcdClient(EtcdConfig((endpoint,)))
    if cmd == "hold":  # hold KEY TTL READYFILE
        key, ttl, ready = args
        session = Session(client, ttl_s=float(ttl))
        client.put(key, "held", lease=session.lease_id)
        _announce(ready, {"lease": session.lease_id})
        threading.Event().wait()
    elif cmd == "campaign":  # campaign PREFIX TTL NAME OUTFILE
        prefix, ttl, name, out = args
        session = Session(client, ttl_s=float(ttl))
        election = Election(client, session, prefix)
        election.campaign(name, timeout_s=60)
        _announce(out, {"name": name, "t": time.time()})
        threading.Event().wait()
    elif cmd == "bump":  # bump KEY N OUTFILE
        key, n, out = args
        counter = GenerationCounter(client, key)
        values = [counter.bump(reason=f"pid-{id(counter)}").generation for _ in range(int(n))]
        _announce(out, {"values": values})
    else:
        raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()

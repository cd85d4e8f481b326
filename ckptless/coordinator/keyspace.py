"""Every etcd key ckptless uses, in one place (documented in docs/keyspace.md).

Why one module: the keyspace is the protocol between agents, workers and the
leader. Keeping all key shapes here makes it reviewable and lets tests assert
that nothing writes outside ``/ckptless/<job-id>/``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckptless.errors import ConfigError

ROOT = "/ckptless"
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_job_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not _JOB_ID.match(job_id):
        raise ConfigError("rdzv_id", job_id, "job ids are 1-128 characters of letters, digits, '.', '_' or '-'")
    return job_id


@dataclass(frozen=True)
class Keyspace:
    job_id: str

    def __post_init__(self) -> None:
        validate_job_id(self.job_id)

    @property
    def prefix(self) -> str:
        return f"{ROOT}/{self.job_id}/"

    # --- rendezvous --------------------------------------------------------
    @property
    def nodes_prefix(self) -> str:
        """``nodes/<node-id>`` -> JSON node record, on the agent's lease."""
        return f"{self.prefix}nodes/"

    def node(self, node_id: str) -> str:
        return f"{self.nodes_prefix}{node_id}"

    @property
    def rdzv_state(self) -> str:
        """The rendezvous round: JSON {round, state, participants}; fenced on mod revision."""
        return f"{self.prefix}rdzv/state"

    @property
    def links_prefix(self) -> str:
        """``links/<node-id>`` -> JSON: the interface and address the node's mirrors use and the rate it
        measured to one peer (``ckptless.mirror.link``), on the agent's lease; read by ``ckptless status``."""
        return f"{self.prefix}links/"

    def link(self, node_id: str) -> str:
        return f"{self.links_prefix}{node_id}"

    # --- election and generation --------------------------------------------
    @property
    def election_prefix(self) -> str:
        """``election/<lease-hex>`` per contender; lowest create revision leads."""
        return f"{self.prefix}election/"

    @property
    def job_prefix(self) -> str:
        """``job/``: the few keys every worker and agent acts on (the generation, the membership, the
        incidents, the job's status), and nothing else, so that one watch on it costs a worker O(1)
        events per incident whatever W is. Reports, ready marks, exits and spares live elsewhere:
        only the leader reads them (docs/scale.md)."""
        return f"{self.prefix}job/"

    @property
    def generation(self) -> str:
        """Monotonic generation counter, advanced only by fenced transactions."""
        return f"{self.job_prefix}generation"

    # --- workers -------------------------------------------------------------
    @property
    def exits_prefix(self) -> str:
        """``exits/<global-rank>`` -> JSON exit record (code/signal, node, time)."""
        return f"{self.prefix}exits/"

    def worker_exit(self, rank: int) -> str:
        return f"{self.exits_prefix}{rank}"

    def spare_exit(self, worker_id: str) -> str:
        """A spare's exit record (rank -1 inside): one key per spare, so no spare's death hides
        another's, and the leader sees it even when it assigned that spare a rank a moment before."""
        return f"{self.exits_prefix}spare:{worker_id.replace('/', ':')}"

    @property
    def spares_prefix(self) -> str:
        """``spares/<worker-id, / as :>`` -> JSON spare record, on its agent's lease."""
        return f"{self.prefix}spares/"

    # --- recovery -------------------------------------------------------------
    @property
    def membership(self) -> str:
        """Current generation's membership (rank -> worker, store address, the plan that made it).

        Written only together with ``generation`` in one fenced transaction."""
        return f"{self.job_prefix}membership"

    def facts_prefix(self, generation: int) -> str:
        """``facts/g<G>/<rank>`` -> survivor's WorkerReport for the incident ending generation G."""
        return f"{self.prefix}facts/g{generation}/"

    def facts(self, generation: int, rank: int) -> str:
        return f"{self.facts_prefix(generation)}{rank}"

    @property
    def round(self) -> str:
        """The rendezvous round the recovery keys below belong to (a restarted job clears the old ones)."""
        return f"{self.prefix}round"

    def run_state_prefixes(self) -> tuple[str, ...]:
        """Keys of one run's recovery state, cleared when the job is started again under the same id."""
        p = self.prefix
        return (f"{p}exits/", f"{p}facts/", f"{p}ready/", self.job_prefix, f"{p}ported")

    @property
    def worker_writes(self) -> tuple[str, ...]:
        """What a worker writes (its reports, ready marks, the ported mark): all its node's control relay
        puts in etcd for it (``coordinator/relay_writer.py``)."""
        p = self.prefix
        return (f"{p}facts/", f"{p}ready/", self.ported)

    @property
    def ported(self) -> str:
        """Put by every worker in ``ckptless.init()``: the script uses ckptless (so it can be recovered)."""
        return f"{self.prefix}ported"

    def ready_prefix(self, generation: int) -> str:
        """``ready/g<G>/<rank>`` -> {worker_id}: the rank restored and resumed training in generation G."""
        return f"{self.prefix}ready/g{generation}/"

    def ready(self, generation: int, rank: int) -> str:
        return f"{self.ready_prefix(generation)}{rank}"

    @property
    def incident_prefix(self) -> str:
        """``job/incident/g<G>``: see :meth:`incident`."""
        return f"{self.job_prefix}incident/g"

    def incident(self, generation: int) -> str:
        """Set by the leader when it sees generation G fail: tells every worker to stop and report."""
        return f"{self.incident_prefix}{generation}"

    def incident_generation(self, key: str) -> int | None:
        """The G of an ``incident/g<G>`` key (None for any other key)."""
        if not key.startswith(self.incident_prefix):
            return None
        try:
            return int(key[len(self.incident_prefix):])
        except ValueError:
            return None

    def grow(self, generation: int) -> str:
        """``job/grow/g<G>``: set by the leader when a generation with fewer ranks can have its hosted ranks
        back (spares are at hand): its processes leave together at their next step boundary."""
        return f"{self.job_prefix}grow/g{generation}"

    def grow_generation(self, key: str) -> int | None:
        """The G of a ``grow/g<G>`` key (None for any other key)."""
        head = f"{self.job_prefix}grow/g"
        if not key.startswith(head):
            return None
        try:
            return int(key[len(head):])
        except ValueError:
            return None

    @property
    def status(self) -> str:
        """Job status: {state: succeeded | failed, reason, root_cause}; written once, by the leader, at the end."""
        return f"{self.job_prefix}status"

"""The one place a ckptless process reads (and writes) its environment.

Why one place: ``ckptless-run`` talks to its workers, and the chaos runner to
everything it starts, through ``CKPTLESS_*`` variables. Read in seventeen
files, a process's true configuration was nowhere to be printed, and a test
could not say which knob a process had seen. Here each process reads its
environment once, into one typed, frozen :class:`ProcessEnv`; everything else
takes its values from that object (or from the typed configs built from it:
:class:`~ckptless.worker.context.WorkerContext` for a worker's identity,
:class:`~ckptless.coordinator.config.EtcdConfig` for the etcd connection,
the launcher's parsed arguments).

What may still touch ``os.environ`` directly (``tests/unit/test_structure.py``
holds the list): this module, and the watcher of a user script's rank reads
(:mod:`ckptless.worker.rank_reads`), which observes the script's own reads.

Writes go through here too: a spare exports the rank it was given (the user
script reads ``RANK``), a forked worker installs the environment its agent
built for it (:func:`install`), and each install re-reads the settings.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ckptless.errors import ConfigError

#: Environment variable -> field of :class:`ProcessEnv` (besides the worker identity, see WorkerContext).
VARIABLES: dict[str, str] = {
    "CKPTLESS_LOG_LEVEL": "log_level",
    "CKPTLESS_HEARTBEAT_FILE": "heartbeat_file",
    "CKPTLESS_EXIT_FILE": "exit_file",
    "CKPTLESS_DIGEST_DIR": "digest_dir",
    "CKPTLESS_CHAOS_DIR": "chaos_dir",
    "CKPTLESS_CHAOS_POINTS": "chaos_points",
    "CKPTLESS_LOCAL_ADDR": "local_addr",
    "GLOO_SOCKET_IFNAME": "gloo_socket_ifname",
    "NCCL_SOCKET_IFNAME": "nccl_socket_ifname",
    "CKPTLESS_MIRROR_MIN_GBPS": "mirror_min_gbps",
    "CKPTLESS_ETCD_BINARY": "etcd_binary",
    "CKPTLESS_PRELOAD": "preload",
    "CKPTLESS_UNPORTED_WARN_S": "unported_warn_s",
    "CKPTLESS_COLLECTIVE_TIMEOUT": "collective_timeout_s",
    "CKPTLESS_SEED": "seed",
    "CKPTLESS_CPU_BACKEND": "cpu_backend",
    "CKPTLESS_CUDA_BACKEND": "cuda_backend",
    "CKPTLESS_CAPTURE_ORDER": "capture_order",
    "CKPTLESS_NODE_GPUS": "node_gpus",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "nccl_error_handling",
    "CKPTLESS_ETCD_USER": "etcd_user",
    "CKPTLESS_ETCD_PASSWORD": "etcd_password",
    "CKPTLESS_ETCD_CA_CERT": "etcd_ca_cert",
    "CKPTLESS_ETCD_CERT_KEY": "etcd_cert_key",
    "CKPTLESS_ETCD_CERT": "etcd_cert",
}
_SECRET = frozenset({"etcd_password"})
#: ``CKPTLESS_SEED`` when unset (``worker/setup_seed.py``); here so that a launcher can compare a job's
#: effective seed without importing torch.
DEFAULT_SEED = 20_260_101


class ProcessEnv(BaseModel):
    """The process-wide ``CKPTLESS_*`` knobs, as this process saw them at start (or at its last install)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    log_level: str = Field(default="WARNING", description="the launcher's and chaos runner's log level")
    heartbeat_file: str | None = Field(default=None, description="a worker's progress file, read by its agent")
    exit_file: str | None = Field(default=None, description="where a worker records why it exits")
    digest_dir: str | None = Field(default=None, description="a chaos runner asked for state digests here")
    chaos_dir: str | None = Field(default=None, description="the chaos runner's marker directory")
    chaos_points: str = Field(default="", description="tag=point pairs a worker pauses at (chaos runs only)")
    local_addr: str | None = Field(default=None, description="the address Gloo binds (the launcher's node address)")
    gloo_socket_ifname: str | None = Field(default=None, description="the user's own Gloo interface choice")
    nccl_socket_ifname: str | None = Field(default=None, description="the user's own NCCL interface choice")
    mirror_min_gbps: float = Field(default=1.0, ge=0, description="an agent warns when its mirror link measures "
                                                                  "below this many Gb/s")
    etcd_binary: str | None = Field(default=None, description="an etcd binary other than the bundled one")
    preload: str = Field(default="", description="modules the warm fork server imports, comma separated")
    unported_warn_s: float = Field(default=60.0, gt=0, description="warn when a worker never called init()")
    collective_timeout_s: float | None = Field(default=None, gt=0, description="a collective's deadline")
    seed: int | None = Field(default=None, ge=0, lt=2**32, description="the seed of an unseeded script's setup")
    cpu_backend: str = Field(default="gloo", min_length=1, description="the backend of the user's groups for "
                             "CPU tensors: gloo, or one the process registered (the tests' NCCL-semantics one)")
    node_gpus: int | None = Field(default=None, ge=0, description="the GPUs this node offers its workers, "
                                  "overriding the count from CUDA_VISIBLE_DEVICES or the driver (0: a CPU job)")
    cuda_backend: Literal["nccl", "gloo", "none"] | None = Field(
        default=None, description="the backend of the user's groups for CUDA tensors: nccl (the default where "
        "CUDA is available), gloo (ranks may share a GPU: tests on one GPU), none (a CPU job on a GPU host)")
    capture_order: Literal["overlap", "step"] = Field(
        default="overlap", description="where a step waits for the last capture's GPU copies: overlap (the "
        "optimizer step; the forward and backward overlap the copy) or step (the step's start, for scripts "
        "that write parameters in ways no version counter shows)")
    nccl_error_handling: int | None = Field(default=None, ge=0, le=3, description="torch's NCCL error mode: "
                                            "ckptless needs 0 or 2 (abort without tearing the process down)")
    etcd_user: str | None = None
    etcd_password: str | None = Field(default=None, repr=False)
    etcd_ca_cert: str | None = None
    etcd_cert_key: str | None = None
    etcd_cert: str | None = None

    @classmethod
    def from_mapping(cls, env: Mapping[str, str]) -> ProcessEnv:
        """Parse ``env``; one :class:`ConfigError` naming the variable and its value if one is bad."""
        values = {name: env[var] for var, name in VARIABLES.items() if env.get(var)}
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            err = exc.errors()[0]
            name = str(err.get("loc", ("?",))[0])
            var = next((v for v, n in VARIABLES.items() if n == name), name)
            raise ConfigError(var, env.get(var), err.get("msg", "invalid")) from exc

    def describe(self) -> dict[str, Any]:
        """What is set, printable (secrets masked): the ledger and ``ckptless status`` show it."""
        out = {k: v for k, v in self.model_dump().items() if v not in (None, "")}
        for k in _SECRET & out.keys():
            out[k] = "***"
        return out

    def etcd_credentials(self) -> dict[str, str | None]:
        """The etcd TLS/auth settings as :class:`~ckptless.coordinator.config.EtcdConfig` fields."""
        return {"user": self.etcd_user, "password": self.etcd_password, "ca_cert": self.etcd_ca_cert,
                "cert_key": self.etcd_cert_key, "cert_cert": self.etcd_cert}


_current: ProcessEnv | None = None
_environ: Mapping[str, str] | None = None


def current() -> ProcessEnv:
    """This process's settings, read from its environment on first use."""
    global _current
    if _current is None:
        _current = ProcessEnv.from_mapping(environ())
    return _current


def environ() -> Mapping[str, str]:
    """A read-only copy of the environment as this process started (or was last installed): for the
    typed configs that parse their own variables (WorkerContext, the launcher's PET_* fallbacks) and
    for the environment a launcher hands on to the processes it starts."""
    global _environ
    if _environ is None:
        _environ = MappingProxyType(dict(os.environ))
    return _environ


def reload() -> ProcessEnv:
    """Read the environment again (tests that change it; a process whose environment was installed)."""
    global _current, _environ
    _current = _environ = None
    return current()


def export(values: Mapping[str, str]) -> None:
    """Set variables the user's script reads (a spare's ``RANK`` once it has one); not re-read here."""
    global _environ
    os.environ.update(values)
    if _environ is not None:
        _environ = MappingProxyType({**_environ, **values})


def set_default(name: str, value: str) -> None:
    """Give a variable a value unless the user set one (for libraries read later, e.g. gRPC's)."""
    os.environ.setdefault(name, value)
    reload()


@contextmanager
def library_setting(name: str, value: str) -> Iterator[None]:
    """``name=value`` only inside the block, for a library that reads it in one constructor
    (torch's ``TORCH_GLOO_LAZY_INIT``, read when a Gloo group is made); the user's value is put back.
    Not re-read here: no ckptless setting is changed. The caller serialises such blocks."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def install(env: Mapping[str, str]) -> ProcessEnv:
    """Replace the whole environment with ``env`` (a forked worker taking the one its agent built)."""
    os.environ.clear()
    os.environ.update(env)
    return reload()

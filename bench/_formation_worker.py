"""One rank of ``bench/formation.py``: forms generation after generation, timing each part.

Run by the bench only: ``_formation_worker.py PLAN.json RANK``. The plan names the world size, the
bench's TCPStore (the agent's store in a job), the backends, the group counts, the generations per
configuration and the paths to time:

* ``ckptless``: the product's own formation, as a recovering worker runs it
  (``groups.form_mirror_group`` ahead, then ``groups.bind_all``: the second arrive barrier, every
  ``RebindableGroup.build`` one after another, the mirror group reused), then what a failure does
  before the next one (``abort.abort_now``, ``groups.release_all``; not timed).
* ``parallel``: a what-if, not product code: the same ``RebindableGroup.build`` calls, one thread per
  group, each on a store connection of its own (``TCPStore.clone``: over one client a non-root rank's
  blocking ``get`` holds the client's one lock, so two groups built at once over one client wait on
  each other's keys until the store timeout).
* ``torch``: torch's own path for the same W and G: ``init_process_group`` + G ``new_group``, each
  group connected and all-reduced once (what ckptless's member check does), then destroyed.

Timing: before each generation every rank passes a store barrier (not timed), so "the generation's
formation" is max over ranks of (end - start). One extra generation per configuration runs over a
counting store (``_CountingStore``) and is not in the timings: its store operations are reported.
Results go to ``OUT/rank<R>.json``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ckptless import environment  # noqa: E402
from ckptless.mirror import tree  # noqa: E402
from ckptless.worker import abort, groups, reaper, sockets  # noqa: E402
from ckptless.worker.rebindable import RebindableGroup  # noqa: E402
from tests.harness import nccl_like  # noqa: E402  - registers the NCCL-semantics backend

TIMEOUT_S = 60.0


class _CountingStore(dist.Store):
    """``inner`` unchanged, every operation counted by name (one count per round trip)."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner
        self.ops: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _n(self, op: str) -> None:
        with self._lock:
            self.ops[op] += 1

    def get(self, key: str) -> bytes:
        self._n("get")
        return bytes(self.inner.get(key))

    def set(self, key: str, value: Any) -> None:
        self._n("set")
        self.inner.set(key, value)

    def add(self, key: str, amount: int) -> int:
        self._n("add")
        return int(self.inner.add(key, amount))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._n("wait")
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        self._n("check")
        return bool(self.inner.check(keys))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._n("compare_set")
        return bytes(self.inner.compare_set(key, expected, desired))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._n("multi_get")
        return [bytes(v) for v in self.inner.multi_get(keys)]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._n("multi_set")
        self.inner.multi_set(keys, values)  # type: ignore[attr-defined]

    def delete_key(self, key: str) -> bool:
        self._n("delete_key")
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        self._n("num_keys")
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)


# --- instrumentation of the product's formation (wrappers; the product code is unchanged) ---------
_parts: dict[str, list[float]] = {}
_parts_lock = threading.Lock()


def _note(part: str, seconds: float) -> None:
    with _parts_lock:
        _parts.setdefault(part, []).append(seconds)


def _timed(part: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _note(part, time.perf_counter() - t0)
    return wrapper


groups.arrive = _timed("arrive", groups.arrive)  # bind_all and form_mirror_group look it up in groups
groups.mirror_group = _timed("mirror_group", groups.mirror_group)
RebindableGroup.build = _timed("group_build", RebindableGroup.build)  # type: ignore[method-assign]


def _sockets() -> int:
    return len(sockets.socket_fds())


class Rank:
    def __init__(self, plan: dict[str, Any], rank: int) -> None:
        self.plan, self.rank, self.world = plan, rank, int(plan["world"])
        self.store = groups.connect_store(plan["host"], int(plan["port"]), TIMEOUT_S)
        self.sync_n = 0
        self.baseline_sockets = _sockets()
        self.generation = 0
        self.rows: list[dict[str, Any]] = []
        self._held: list[Any] = []
        self._clones: list[dist.Store] = []
        ring = {(rank + 1) % self.world, (rank - 1) % self.world}  # K = 1 ring placement's holder/owner
        self.mirror_peers = sorted((set(tree.neighbours(rank, self.world)) | ring) - {rank})

    def sync(self) -> None:
        """Every rank here before anyone goes on (not timed): the generations start together."""
        self.sync_n += 1
        key = f"bench/sync/{self.sync_n}"
        if int(self.store.add(key, 1)) == self.world:
            self.store.set(f"{key}/go", "1")
        self.store.wait([f"{key}/go"], timedelta(seconds=TIMEOUT_S * 4))

    def use_backend(self, backend: str) -> None:
        environment._current = environment.current().model_copy(update={"cpu_backend": backend})

    # --- ckptless ---------------------------------------------------------------------------------
    def ckptless_generation(self, store: dist.Store, parallel: bool) -> dict[str, Any]:
        self.generation += 1
        gen = self.generation
        with _parts_lock:
            _parts.clear()
        deadline = time.monotonic() + TIMEOUT_S * 2
        if parallel:
            # One store connection per group, opened once and kept (as an implementation would): made
            # inside the formation, 17 connects at once met the client's connect back-off (5 s, as
            # groups.arrive's docstring measured for 32).
            # One rank after the other: W x (G + 1) connects at once meet the back-off too.
            need = len(groups.groups()) - len(self._clones)
            if need > 0:
                if self.rank > 0:
                    self.store.wait([f"bench/clones/{len(self._clones)}/{self.rank - 1}"])
                self._clones.extend(self.store.clone() for _ in range(need))  # type: ignore[attr-defined]
                self.store.set(f"bench/clones/{len(self._clones) - need}/{self.rank}", "1")
        self.sync()
        before = _sockets()
        t0 = time.perf_counter()
        if parallel:
            mirror = self._parallel_bind(store, gen, deadline)
        else:
            groups.form_mirror_group(store, gen, self.rank, self.world, TIMEOUT_S, deadline,
                                     peers=self.mirror_peers)
            mirror = groups.bind_all(store, gen, self.rank, self.world, TIMEOUT_S, deadline,
                                     mirror_peers=self.mirror_peers)
        seconds = time.perf_counter() - t0
        opened = _sockets() - before
        with _parts_lock:
            parts = {k: list(v) for k, v in _parts.items()}
        abort.abort_now(gen, "bench: the next generation")  # what a failure does, then leaving it
        rel = [groups.release_all(gen), reaper.drop("bench mirror", [mirror])]
        del mirror
        for r in rel:
            if r.thread is not None:
                r.thread.join(TIMEOUT_S)
        return {"seconds": seconds, "sockets_opened": opened, "parts": parts}

    def _parallel_bind(self, store: dist.Store, gen: int, deadline: float) -> Any:
        """What-if: every group built at once, each on its own store connection (see the module doc)."""
        groups.arrive(store, gen, self.world, deadline, barrier="arrived")
        todo = groups.groups()
        clones = self._clones[:len(todo)]  # made before the generation started (see ckptless_generation)
        built: list[Any] = [None] * len(todo)
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                built[i] = todo[i].build(clones[i], gen)
            except BaseException as exc:  # noqa: BLE001 - raised below
                errors.append(exc)

        with sockets.recording(gen):
            # The mirror group first, alone: its lazy Gloo is made with TORCH_GLOO_LAZY_INIT set in the
            # environment around the constructor (rebindable.new_gloo), and a setenv racing another
            # thread's getenv (an eager Gloo constructor) crashed a rank here (SIGSEGV, nccl_like, W = 2).
            mirror = groups.mirror_group(store, gen, self.rank, self.world, TIMEOUT_S, self.mirror_peers, deadline)
            threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(todo))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(TIMEOUT_S * 2)
        if errors:
            raise errors[0]
        for g, (inner, backends) in zip(todo, built):
            g.install(gen, inner, backends)
        return mirror

    # --- torch ------------------------------------------------------------------------------------
    def torch_generation(self, store: dist.Store, backend: str, n_groups: int) -> dict[str, Any]:
        self.generation += 1
        tag = f"bench/torch/{self.generation}/"
        self._held = []  # the previous generation's groups (see below), destroyed untimed
        gc.collect()
        self.sync()
        before = _sockets()
        build: list[float] = []
        t0 = time.perf_counter()
        dist.init_process_group(backend, store=dist.PrefixStore(tag, store), rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=TIMEOUT_S))
        pgs = [dist.group.WORLD]
        build.append(time.perf_counter() - t0)
        self._connect(pgs[0])
        for _ in range(n_groups):
            t1 = time.perf_counter()
            pg = dist.new_group(list(range(self.world)))
            self._connect(pg)
            pgs.append(pg)
            build.append(time.perf_counter() - t1)
        seconds = time.perf_counter() - t0
        opened = _sockets() - before
        for pg in pgs:
            if isinstance(pg, nccl_like.NcclLikeGroup):
                pg.abort()  # its watchdog thread ends (ckptless's path aborts too)
        dist.destroy_process_group()
        # Dropped one generation later, not now: the stand-in's work callback briefly holds its group
        # on Gloo's thread (tests/harness/nccl_like.py, _HeldWork._on_inner), and a group freed there
        # joins that very thread (SIGABRT "Resource deadlock avoided", seen here at once).
        self._held = pgs
        return {"seconds": seconds, "sockets_opened": opened, "parts": {"group_build": build}}

    @staticmethod
    def _connect(pg: Any) -> None:
        """Connect now and check the members, as ckptless's formation does for every group."""
        eager = getattr(pg, "eager_connect_single_device", None)
        if callable(eager):
            eager(torch.device("cpu"))
        one = torch.ones(1, dtype=torch.int32)
        dist.all_reduce(one, group=pg)

    # --- the plan ---------------------------------------------------------------------------------
    def run(self) -> None:
        plan = self.plan
        gens = int(plan["generations"])
        if "torch" in plan["paths"]:
            # Gloo only: the stand-in's counterpart is torch's ProcessGroupNCCL, which needs GPUs (the
            # stand-in's groups made by torch's own new_group and destroyed by it also ended a rank here,
            # SIGABRT "Resource deadlock avoided", which the product path never does).
            for backend in [b for b in plan["backends"] if b == "gloo"]:
                for n_groups in plan["groups"]:
                    for i in range(gens + 1):
                        counted = i == gens
                        store = _CountingStore(self.store) if counted else self.store
                        row = self.torch_generation(store, backend, n_groups)
                        self._keep("torch", backend, n_groups, counted, row, store)
        mine = [p for p in ("ckptless", "parallel") if p in plan["paths"]]
        if mine:
            self._held = []
            gc.collect()
            groups.ensure_default_group(self.store, self.rank, self.world, TIMEOUT_S)
            made = 0
            for n_groups in plan["groups"]:
                while made < n_groups:  # every rank makes the same groups in the same order (as users do)
                    dist.new_group(list(range(self.world)))
                    made += 1
                for backend in plan["backends"]:
                    self.use_backend(backend)
                    for path in mine:
                        if path == "parallel" and n_groups != max(plan["groups"]):
                            continue  # the what-if at the most groups only (the bench's time)
                        for i in range(gens + (path == "ckptless")):  # parallel: the same store operations
                            counted = i == gens
                            store = _CountingStore(self.store) if counted else self.store
                            row = self.ckptless_generation(store, parallel=path == "parallel")
                            self._keep(path, backend, n_groups, counted, row, store)

    def _keep(self, path: str, backend: str, n_groups: int, counted: bool, row: dict[str, Any],
              store: dist.Store) -> None:
        row.update(path=path, backend=backend, groups=n_groups, counted=counted, generation=self.generation)
        if isinstance(store, _CountingStore):
            row["store_ops"] = dict(store.ops)
        self.rows.append(row)
        if self.rank == 0:  # progress, in the rank's log
            print(f"[{time.strftime('%H:%M:%S')}] generation {self.generation}: {path} {backend} G={n_groups}"
                  f"{' counted' if counted else ''} {row['seconds']:.3f} s", flush=True)


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    r = Rank(plan, rank)
    gc.freeze()  # torch's import-time objects out of every collection: the reaper's gc.collect() per
    # generation costs milliseconds instead of ~0.1 s of CPU per process (16 processes share 2 cores)
    t0 = time.perf_counter()
    r.run()
    out = {"rank": rank, "baseline_sockets": r.baseline_sockets, "rows": r.rows,
           "wall_s": time.perf_counter() - t0}
    Path(plan["out"], f"rank{rank}.json").write_text(json.dumps(out))
    r.sync()  # nobody leaves (closing its sockets) while a peer may still be forming
    sys.stdout.flush()
    os._exit(0)  # communicators kept by the reaper or torch need no orderly teardown


if __name__ == "__main__":
    main()

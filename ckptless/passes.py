"""Where the user's own epoch loop is, and how a pass over a loader is reopened exactly there.

Why: a training script keeps its nested loop (``for epoch ...: for batch in
loader: ...``), usually inside a ``Trainer`` class, and ckptless must resume
it mid-epoch after a recovery with the same batches in the same order. The
loop runs through :meth:`ckptless.job.Job.train`, its epochs through
``job.epochs`` and each pass over a loader through ``job.batches``; this
module holds the *protected* part of that: :class:`LoopPosition` (which
epoch, which pass within it, how many batches of the pass were trained, and
what a pass must be reopened from) and :func:`open_pass`, which opens a pass
at a position without disturbing the global RNG streams.

A pass is reopened, by kind of loader:

* **Stateful** (``state_dict``/``load_state_dict``: torchdata's
  ``StatefulDataLoader``, ``ckptless.data.ResumableLoader``): its own state as
  it was *before the batch was fetched* is loaded, then ``iter()`` goes on
  from there (the loader's own exact resume: sampler, base seed, workers).
* **torch ``DataLoader``** (map-style): the pass's index stream is replayed
  from the RNG states recorded when the pass was opened (the global CPU
  generator, and the loader's ``generator``), the trained batches' indices
  are skipped without loading anything, and the rest is loaded by a
  one-pass ``DataLoader`` of the same dataset, collate function and workers,
  whose workers are seeded exactly as the original pass's were.
* **Anything else iterable** (an ``IterableDataset`` loader, a list): reopened
  with the recorded RNG and the trained batches fetched again and dropped.

Exact means: the same index batches, in the same order, collated the same.
Randomness drawn while a batch loads in this process (``num_workers=0``: a
random crop from ``torch``, ``random`` or ``np.random``) is reproduced at any
batch, from the streams recorded before each fetch. Randomness *inside* a
worker is reproduced at any batch too: a DataLoader's workers seed their
streams before each sample from the pass's base seed and the sample's place
(:mod:`ckptless.sample_seeds`). Persistent workers too: each pass opened draws a
base seed for them as a non-persistent loader's iterator does (their own, drawn
once, would serve every epoch), and they are started without drawing from any
stream; a persistent loader whose workers cannot be seeded so is refused at
start (docs/state.md, "Your own loop").
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data._utils.worker import _generate_state

from ckptless.errors import StateError
from ckptless.sample_seeds import SeedPerSample, install, pass_seed_slot, refuse_unreproducible
from ckptless.state import Stateful
from ckptless.state import RNGState, numpy_from_tree, numpy_tree, python_from_tree, python_tree

__all__ = ["AFTER_EPOCHS", "LoopPosition", "adapted", "is_stateful", "open_pass", "stop_workers"]

AFTER_EPOCHS = -2
"""``LoopPosition.ordinal`` of a pass made after the ``job.epochs`` loop ended (-1: no epoch loop yet)."""

_EMPTY = torch.empty(0, dtype=torch.uint8)
_END = object()


def adapted(loader: Any) -> DataLoader[Any] | None:
    """The torch ``DataLoader`` inside a Hugging Face Accelerate prepared loader (``DataLoaderShard``,
    ``DataLoaderDispatcher``, ``SkipDataLoader``: they pass for a ``DataLoader`` through ``__class__``),
    or None. Such an adapter has ``state_dict`` methods, but they answer only over a torchdata
    ``StatefulDataLoader`` (over a plain one they raise ``AttributeError: dl_state_dict``)."""
    base = getattr(loader, "__dict__", {}).get("base_dataloader")
    return base if isinstance(base, DataLoader) else None


def is_stateful(loader: Any) -> bool:
    """A loader that keeps its own position (torch.distributed.checkpoint's Stateful protocol)."""
    base = adapted(loader)
    return isinstance(loader, Stateful) and (base is None or isinstance(base, Stateful))


class LoopPosition:
    """The protected position of a loop run by ``job.train``: one entry of the rank's state.

    ``ordinal``/``epoch``: the current epoch of ``job.epochs`` (its index in the iterable, and its
    value when an ``int``; ``-1``/``None`` outside any). ``pass_index``: the ``job.batches`` pass
    within that epoch. ``consumed``: batches of the pass trained before the one in hand. ``opened``:
    the pass was opened (what follows is recorded). ``cpu_rng``/``loader_rng``: the global CPU
    generator's and the loader's own generator's state just before the pass was opened.
    ``sampler_rng``: the generators of its sampler chain that are not the loader's own (a
    ``RandomSampler(generator=...)``, Accelerate's synchronized generator), before it was opened.
    ``base_draw``: opening it drew the workers' base seed. ``loader_state``: a stateful loader's own
    state before the batch in hand was fetched. ``fetch_torch``/``fetch_python``/``fetch_numpy``: the
    torch CPU, Python and NumPy global streams before it was fetched (loading it in this process may
    draw from them: a reopened pass fetches it again from there; NumPy's only where the loader loads
    in this process). ``ordinal`` is :data:`AFTER_EPOCHS` for a pass after the ``job.epochs`` loop ended.
    """

    __ckptless_data_position__ = True
    __ckptless_not_hostable__ = ("the loop runs through job.train (a hosted rank's micro-batch would need the "
                                 "script's loop body run again)")

    def __init__(self) -> None:
        self.ordinal = -1
        self.epoch: int | None = None
        self.pass_index = 0
        self.consumed = 0
        self.opened = False
        self.cpu_rng = _EMPTY
        self.loader_rng = _EMPTY
        self.sampler_rng: list[torch.Tensor] = []
        self.base_draw = False
        self.loader_state: dict[str, Any] | None = None
        self.fetch_torch = _EMPTY
        self.fetch_python: tuple[Any, ...] | None = None
        self.fetch_numpy: tuple[Any, ...] | None = None

    def before_fetch(self, in_process: bool) -> None:
        """The streams loading the next batch may draw from: torch's and Python's (10-14 us), and NumPy's
        (51-79 us in all) where the batch is loaded in this process (``in_process``: no loader workers): a
        ``__getitem__`` with ``np.random`` draws from it there, from the worker's own stream elsewhere."""
        self.fetch_torch = torch.get_rng_state()
        self.fetch_python = random.getstate()
        self.fetch_numpy = np.random.get_state(legacy=True) if in_process else None  # type: ignore[assignment]

    def restore_fetch(self) -> None:
        if self.fetch_torch.numel():
            torch.set_rng_state(self.fetch_torch)
        if self.fetch_python is not None:
            random.setstate(self.fetch_python)
        if self.fetch_numpy is not None:
            np.random.set_state(self.fetch_numpy)

    def begin_epoch(self, ordinal: int, value: Any) -> None:
        self.ordinal, self.epoch = ordinal, value if type(value) is int else None
        self.pass_index, self.consumed, self.opened = 0, 0, False
        self.loader_state = None

    def next_pass(self) -> None:
        self.pass_index += 1
        self.consumed, self.opened, self.loader_state = 0, False, None

    def at_start(self) -> bool:
        """Version 0's position: nothing of the loop ran (every later version has a pass open)."""
        return self.ordinal == -1 and not self.opened and self.pass_index == 0 and self.consumed == 0

    def copy(self) -> LoopPosition:
        other = LoopPosition()
        other.load_state_dict(self.state_dict())
        return other

    def state_dict(self) -> dict[str, Any]:
        return {"ordinal": self.ordinal, "epoch": self.epoch, "pass": self.pass_index, "consumed": self.consumed,
                "opened": self.opened, "cpu_rng": self.cpu_rng, "loader_rng": self.loader_rng,
                "sampler_rng": list(self.sampler_rng), "base_draw": self.base_draw,
                "loader_state": self.loader_state, "fetch_torch": self.fetch_torch,
                "fetch_python": None if self.fetch_python is None else python_tree(self.fetch_python),
                "fetch_numpy": None if self.fetch_numpy is None else numpy_tree(self.fetch_numpy)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self.ordinal, self.epoch = int(state["ordinal"]), state["epoch"]
            self.pass_index, self.consumed = int(state["pass"]), int(state["consumed"])
            self.opened, self.base_draw = bool(state["opened"]), bool(state["base_draw"])
            self.cpu_rng = state["cpu_rng"].clone()
            self.loader_rng = state["loader_rng"].clone()
            self.sampler_rng = [t.clone() for t in state.get("sampler_rng", [])]  # none: an older image
            self.loader_state = state["loader_state"]
            self.fetch_torch = state["fetch_torch"].clone()
            py, npy = state["fetch_python"], state.get("fetch_numpy")  # no NumPy entry: an older image
            self.fetch_python = None if py is None else python_from_tree(py)
            self.fetch_numpy = None if npy is None else numpy_from_tree(npy)
        except (KeyError, TypeError, AttributeError) as exc:
            raise StateError(f"a loop position must have the fields of LoopPosition.state_dict(): {exc}") from exc


def _generator_of(loader: Any) -> torch.Generator | None:
    g = getattr(loader, "generator", None)
    return g if isinstance(g, torch.Generator) else None


def _sampler_generators(loader: Any) -> list[torch.Generator]:
    """The generators a pass's index order is drawn from besides the loader's own: a sampler's
    (``RandomSampler(generator=g)``, also inside a ``BatchSampler`` or Accelerate's ``BatchSamplerShard``)
    and Accelerate's synchronized one (the same object, usually). In a fixed order, each once."""
    own = _generator_of(loader)
    found: list[torch.Generator] = []
    todo: list[tuple[Any, int]] = [(getattr(loader, name, None), 0)
                                   for name in ("synchronized_generator", "batch_sampler", "sampler")]
    while todo:
        obj, depth = todo.pop(0)
        if isinstance(obj, torch.Generator):
            if obj is not own and all(obj is not g for g in found):
                found.append(obj)
        elif obj is not None and depth < 4 and not isinstance(obj, (int, float, str, torch.Tensor)):
            todo += [(getattr(obj, name, None), depth + 1) for name in ("generator", "batch_sampler", "sampler")]
    return found


def open_pass(loader: Iterable[Any], pos: LoopPosition, resume: dict[str, Any] | None) -> Iterator[Any]:
    """An iterator over one pass of ``loader``: from its start (``resume`` None: records in ``pos``
    what a later reopening needs), or reopened at ``pos``. ``resume`` is then the RNG streams of the
    resume version (``RNGState.state_dict()``), which they are left at: whatever the code before the
    pass drew again on its way here (a probe ``next(iter(loader))`` draws a base seed) is undone.

    An Accelerate prepared loader (:func:`adapted`) is opened as itself, so that its own work per
    pass runs (device placement, ``GradientState``'s end of the loader, its epoch counter); reopened,
    its inner ``DataLoader``'s pass is replayed below it (:func:`_adapter_rest`)."""
    base = adapted(loader)
    torch_loader = base if base is not None else loader  # what has workers, a generator, a batch sampler
    refuse_unreproducible(torch_loader)
    install(torch_loader)
    slot = pass_seed_slot(torch_loader)
    samplers = _sampler_generators(loader)
    if resume is None:
        pos.cpu_rng = torch.get_rng_state()
        g = _generator_of(torch_loader)
        pos.loader_rng = g.get_state() if g is not None else _EMPTY
        pos.sampler_rng = [s.get_state() for s in samplers]
        # A DataLoader draws its workers' base seed when its iterator is made; for persistent workers
        # the pass draws it (their iterator is made drawing nothing), so that it differs every pass.
        pos.base_draw = isinstance(torch_loader, DataLoader)
        if slot is not None:
            assert isinstance(torch_loader, DataLoader)
            _start_seeded_workers(torch_loader)
            slot.fill_(_draw_base(torch_loader))
        pos.opened = True
        return iter(loader)
    torch.set_rng_state(pos.cpu_rng)
    g = _generator_of(torch_loader)
    if g is not None and pos.loader_rng.numel():
        g.set_state(pos.loader_rng)
    if len(pos.sampler_rng) == len(samplers):
        for s, state in zip(samplers, pos.sampler_rng):
            s.set_state(state)
    try:
        if is_stateful(loader):
            if pos.loader_state is not None:
                loader.load_state_dict(pos.loader_state)  # type: ignore[attr-defined]
            return iter(loader)
        if isinstance(torch_loader, DataLoader) and not isinstance(torch_loader.dataset, IterableDataset) \
                and torch_loader.batch_sampler is not None and _shards_batches(loader):
            if base is None:
                return _rest_of(torch_loader, pos)
            _adapter_prologue(loader)
            return _adapter_rest(loader, _rest_of(torch_loader, pos),
                                 pos.base_draw and pos.consumed == 0 and _generator_of(torch_loader) is None)
        it = iter(loader)
        for _ in range(pos.consumed):  # no index stream to skip by: fetch the trained batches again
            next(it)
        return it
    finally:
        RNGState().load_state_dict(resume)  # (the loader's generator stays where the pass's opening left it)


def _shards_batches(loader: Any) -> bool:
    """One batch of ``loader`` is one batch of its index stream (not Accelerate's dispatcher, whose
    batch is several of its inner loader's: it is reopened by fetching the trained batches again)."""
    return adapted(loader) is None or type(loader).__name__ != "DataLoaderDispatcher"


def _adapter_prologue(loader: Any) -> None:
    """What an Accelerate ``DataLoaderShard`` does at a pass's start before it iterates its inner loader,
    done before the inner pass is replayed: the synchronized generator broadcast from rank 0 (one
    collective, as in the original pass: :func:`_adapter_rest` skips the adapter's own) and the
    sampler's epoch set from the adapter's epoch counter."""
    types = getattr(loader, "rng_types", None)
    if types:
        from accelerate.utils import synchronize_rng_states

        synchronize_rng_states(types, getattr(loader, "synchronized_generator", None))
    set_epoch = getattr(loader, "set_epoch", None)
    if callable(set_epoch) and hasattr(loader, "iteration"):
        set_epoch(loader.iteration)


def _adapter_rest(loader: Any, rest: Iterator[Any], draw: bool) -> Iterator[Any]:
    """The rest of an Accelerate loader's pass: its own ``__iter__`` (device placement, look-ahead,
    ``GradientState``, epoch counter) over the replayed inner pass ``rest``. ``draw``: the pass resumes
    at its first batch, whose fetch drew the inner loader's base seed from the global stream in the
    original pass (the adapter makes its inner iterator at its first fetch): drawn again."""
    saved = loader.__dict__["base_dataloader"], loader.__dict__.get("rng_types")
    loader.base_dataloader, loader.rng_types = _OnePass(rest, saved[0]), None
    try:
        if draw:
            torch.empty((), dtype=torch.int64).random_()
        inner = iter(loader)
        first = next(inner, _END)  # the adapter took its inner iterator (and looked one batch ahead)
    finally:
        loader.base_dataloader, loader.rng_types = saved
    if first is _END:
        return
    yield first
    yield from inner


class _OnePass:
    """Stands for an Accelerate adapter's inner loader while the adapter makes its iterator: its
    iterator is the replayed pass, everything else (sampler, dataset, ...) the inner loader's."""

    def __init__(self, it: Iterator[Any], inner: Any) -> None:
        self._it, self._inner = it, inner

    def __iter__(self) -> Iterator[Any]:
        return self._it

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _draw_base(loader: DataLoader[Any]) -> int:
    """Exactly the draw DataLoader's iterator makes for its workers' base seed (torch/utils/data/dataloader.py)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item())


def _start_seeded_workers(loader: DataLoader[Any]) -> None:
    """``loader``'s persistent workers, started with its per-pass seeding, the streams left as they were.

    Making the iterator draws a base seed and primes a pass (a shuffling sampler's draw): undone, so
    that where the workers start (a replacement at its first pass, the original at its first) changes
    no stream. Workers started before the seeding was installed (a probe ``next(iter(loader))`` before
    the first ``job.batches``) are replaced: they would draw from their own streams."""
    it = getattr(loader, "_iterator", None)
    if it is not None and getattr(it, "_worker_init_fn", None) is loader.worker_init_fn:
        return
    stop_workers(loader)
    g = _generator_of(loader)
    cpu, own = torch.get_rng_state(), g.get_state() if g is not None else None
    samplers = _sampler_generators(loader)  # a sampler's own generator primes too (Accelerate's)
    states = [s.get_state() for s in samplers]
    try:
        loader._iterator = loader._get_iterator()
    finally:
        torch.set_rng_state(cpu)
        if g is not None and own is not None:
            g.set_state(own)
        for s, state in zip(samplers, states):
            s.set_state(state)


def stop_workers(loader: DataLoader[Any]) -> None:
    """End ``loader``'s persistent workers (its next ``iter()`` starts new ones)."""
    it = getattr(loader, "_iterator", None)
    if it is not None:
        it._shutdown_workers()
        loader._iterator = None


def _rest_of(loader: DataLoader[Any], pos: LoopPosition) -> Iterator[Any]:
    """The rest of a map-style pass: its index batches replayed, the trained ones skipped unloaded."""
    base = _draw_base(loader) if pos.base_draw else 0
    batches = iter(loader.batch_sampler)  # type: ignore[arg-type]
    for _ in itertools.islice(batches, pos.consumed):  # the trained batches: indices only, nothing loaded
        pass
    rest: Iterator[list[int]] = batches
    if pos.consumed > 0 or loader.num_workers > 0:
        # The original pass's sampler drew before the batch in hand was fetched (at its first batch, or
        # when workers prefetched): draw here, with the pass's RNG swapped in. At the first batch of a
        # single-process pass it drew *while* fetching it: then it draws when the batch is fetched again.
        rest = itertools.chain(list(itertools.islice(batches, 1)), batches)
    kwargs: dict[str, Any] = {}
    if loader.num_workers > 0:
        init = loader.worker_init_fn
        if isinstance(init, SeedPerSample):  # seeded from the original pass's base (a persistent one's slot's)
            init = SeedPerSample(init.user, base)
        kwargs = {"prefetch_factor": loader.prefetch_factor, "multiprocessing_context": loader.multiprocessing_context,
                  "worker_init_fn": _Reseed(base, init) if pos.base_draw else init}
    one_pass = DataLoader(loader.dataset, batch_sampler=_Batches(rest), num_workers=loader.num_workers,
                          collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
                          generator=torch.Generator(), in_order=getattr(loader, "in_order", True), **kwargs)
    return iter(one_pass)


class _Batches:
    """A batch sampler over a precomputed stream of index batches (one pass only)."""

    def __init__(self, stream: Iterator[list[int]]) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[list[int]]:
        return self._stream


class _Reseed:
    """Seeds a worker of the reopened pass as the original pass's was (``base + worker_id``, as
    torch's ``_worker_loop`` does for ``random``, torch and numpy), then runs the user's init."""

    def __init__(self, base: int, user: Callable[[int], None] | None) -> None:
        self.base, self.user = base, user

    def __call__(self, worker_id: int) -> None:
        seed = self.base + worker_id
        random.seed(seed)
        torch.manual_seed(seed)
        np.random.seed(_generate_state(self.base, worker_id))
        if self.user is not None:
            self.user(worker_id)

"""Every private or version-dependent torch attribute ckptless reads or writes, and a probe of each on the
installed torch (issue 37's inventory; docs/compatibility.md, "torch internals ckptless touches").

Why a probe and not only a list: whether a touchpoint exists is a fact of one torch build, and the compat
lane runs a second torch (``make test-compat``). ``tests/unit/test_torch_touchpoints.py`` runs every probe
on the torch it is given (CI: 2.13.0; the compat lane: 2.14.1), so an attribute that a torch release
renames fails a named unit test instead of a recovery. ``python -m tests.harness.torch_touchpoints``
prints the table for the doc. Where is found by searching the product source for a needle, so the
table's file:line follows the code until the touchpoints move behind one module.

A probe answers ``yes``, ``yes: <note>`` (present, with something to know: a deprecation warning), ``n/a:
<why>`` (this build cannot show it: ProcessGroupNCCL on a CPU build) or ``no: <what is missing>``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import mmap
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from .repo import REPO


@dataclass(frozen=True)
class Touchpoint:
    path: str  # product file, relative to the repository
    needle: str  # text on the line that touches it (its first occurrence gives the line)
    what: str  # the torch attribute or behaviour, as the table names it
    probe: Callable[[], str]

    def where(self) -> str:
        for i, line in enumerate((REPO / self.path).read_text().splitlines(), 1):
            if self.needle in line:
                return f"{self.path}:{i}"
        return f"{self.path}:? (needle {self.needle!r} not found)"


def _resolve(dotted: str) -> Any:
    """``pkg.mod:Obj.attr`` -> the object (AttributeError/ImportError propagate)."""
    mod, _, attrs = dotted.partition(":")
    obj: Any = importlib.import_module(mod)
    for a in filter(None, attrs.split(".")):
        obj = getattr(obj, a)
    return obj


def attr(*dotted: str) -> Callable[[], str]:
    """Each ``pkg.mod:Obj.attr`` resolves."""
    def probe() -> str:
        missing = []
        for d in dotted:
            try:
                _resolve(d)
            except (AttributeError, ImportError):
                missing.append(d)
        return "no: " + ", ".join(missing) if missing else "yes"
    return probe


def self_attr(cls: str, *names: str, any_of: bool = False) -> Callable[[], str]:
    """Each instance attribute ``names`` is assigned (``self.<name>``) in the class's source, or is a
    class attribute (instance attributes of Python classes exist only once an object is built)."""
    def probe() -> str:
        try:
            klass = _resolve(cls)
        except (AttributeError, ImportError):
            return f"no: {cls}"
        src = "".join(inspect.getsource(k) for k in klass.__mro__ if k.__module__.startswith("torch")
                      and k is not object and _has_source(k))
        found = [n for n in names if f"self.{n}" in src or hasattr(klass, n)]
        if any_of:
            return f"yes: {found[0]}" if found else f"no: none of {', '.join(names)}"
        missing = [n for n in names if n not in found]
        return "no: " + ", ".join(missing) if missing else "yes"
    return probe


def _has_source(k: type) -> bool:
    try:
        inspect.getsource(k)
        return True
    except (OSError, TypeError):
        return False


def lib_string(lib: str, text: str) -> Callable[[], str]:
    """``text`` is compiled into ``torch/lib/<lib>`` (an environment variable torch's C++ reads)."""
    def probe() -> str:
        import torch
        path = Path(torch.__file__).parent / "lib" / lib
        if not path.exists():
            return f"n/a: no {lib} in this build"
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return "yes" if m.find(text.encode() + b"\0") >= 0 or m.find(text.encode()) >= 0 else f"no: {text}"
    return probe


def _nccl_built() -> bool:
    import torch.distributed as dist
    return hasattr(dist, "ProcessGroupNCCL")


def nccl_attr(*names: str) -> Callable[[], str]:
    """``ProcessGroupNCCL`` attributes (absent from CPU builds: n/a there)."""
    def probe() -> str:
        if not _nccl_built():
            return "n/a: CPU build (no ProcessGroupNCCL)"
        import torch.distributed as dist
        missing = [n for n in names if _missing_path(dist.ProcessGroupNCCL, n)]
        return "no: " + ", ".join(missing) if missing else "yes"
    return probe


def _missing_path(obj: Any, dotted: str) -> bool:
    for a in dotted.split("."):
        if a == "()":
            obj = obj()
            continue
        if not hasattr(obj, a):
            return True
        obj = getattr(obj, a)
    return False


def _gloo_options() -> str:
    import torch.distributed as dist
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    missing = [a for a in ("_timeout", "_devices") if not hasattr(opts, a)]
    if not hasattr(dist.ProcessGroupGloo, "create_device"):
        missing.append("ProcessGroupGloo.create_device")
    return "no: " + ", ".join(missing) if missing else "yes"


def _world1_gloo(store: Any = None) -> Any:
    import torch.distributed as dist
    return dist.ProcessGroupGloo(store if store is not None else dist.HashStore(), 0, 1, timedelta(seconds=10))


def _sequence_number() -> str:
    """Exists on every torch checked; 2.14.1 made it a deprecated no-op that warns once per process, from
    C++ to the process's stderr (not a Python warning), so the probe reads file descriptor 2."""
    pg = _world1_gloo()
    if not hasattr(pg, "_set_sequence_number_for_group"):
        return "no: _set_sequence_number_for_group"
    with tempfile.TemporaryFile() as err:
        saved = os.dup(2)
        try:
            sys.stderr.flush()
            os.dup2(err.fileno(), 2)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                pg._set_sequence_number_for_group()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        said = err.read().decode(errors="replace") + " ".join(str(w.message) for w in seen)
    return "yes: a deprecated no-op, warns" if "deprecated" in said else "yes"


def _backend_options() -> str:
    import torch.distributed as dist
    opts = dist.distributed_c10d._DistributedBackendOptions()
    fields = ("store", "group_rank", "group_size", "timeout", "group_id", "global_ranks_in_group")
    missing = [f for f in fields if not hasattr(opts, f)]
    return "no: " + ", ".join(missing) if missing else "yes"


def _plugins() -> str:
    import torch.distributed as dist
    plugins = getattr(dist.Backend, "_plugins", None)
    if not isinstance(plugins, dict):
        return "no: Backend._plugins"
    fields = getattr(next(iter(plugins.values()), None), "_fields", None) or ()
    sig = inspect.signature(dist.Backend.register_backend)
    missing = [p for p in ("extended_api", "devices") if p not in sig.parameters]
    if fields and "creator_fn" not in fields:
        missing.append("_BackendPlugin.creator_fn")
    return "no: " + ", ".join(missing) if missing else "yes"


def _error_type() -> str:
    import torch._C._distributed_c10d as c10d
    error_type = getattr(c10d, "ErrorType", None)
    if error_type is None or not hasattr(error_type, "SUCCESS"):
        return "no: ErrorType.SUCCESS"
    on = [n for n in ("ProcessGroupNCCL", "ProcessGroupGloo") if hasattr(getattr(c10d, n, None), "get_error")]
    return f"yes: get_error on {', '.join(on) or 'no built backend'} (ckptless skips a backend without it)"


def _gloo_rank_record() -> str:
    """Gloo's store keys and ``tcp::Rank`` record, which ckptless parses to learn a lazy group's peers."""
    import torch.distributed as dist

    from ckptless.worker.gloo_peers import _RANK_KEY, parse_rank_record

    seen: dict[bytes, bytes] = {}

    class Recording(dist.Store):  # the shape of ckptless's PeerRecordingStore
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def set(self, key: str, value: Any) -> None:
            seen[key.encode() if isinstance(key, str) else bytes(key)] = bytes(value)
            self.inner.set(key, value)

        def get(self, key: str) -> bytes:
            return bytes(self.inner.get(key))

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

        def add(self, key: str, amount: int) -> int:
            return int(self.inner.add(key, amount))

        def check(self, keys: list[str]) -> bool:
            return bool(self.inner.check(keys))

    _world1_gloo(Recording(dist.HashStore()))
    records = [v for k, v in seen.items() if _RANK_KEY.match(k)]
    if not records:
        return f"no: no rank record among the keys Gloo set ({sorted(seen)[:4]})"
    parsed = parse_rank_record(records[0])
    return "yes" if parsed is not None else "no: the tcp::Rank record did not parse"


def _generate_state() -> str:
    from torch.utils.data._utils.worker import _generate_state
    params = list(inspect.signature(_generate_state).parameters)
    return "yes" if params[:2] == ["base_seed", "worker_id"] else f"no: signature {params}"


def _getitems_delegates() -> str:
    from torch.utils.data import Subset
    from torch.utils.data._utils import fetch
    own = getattr(Subset, "__getitems__", None)
    if own is None or own.__module__ != "torch.utils.data.dataset":
        return "no: Subset.__getitems__ in torch.utils.data.dataset"
    return "yes" if "__getitems__" in inspect.getsource(fetch) else "no: the map-style fetcher's __getitems__ call"


def _dtensor() -> str:
    from torch.distributed.tensor import DTensor, Partial, Shard
    missing = []
    if getattr(Partial(), "reduce_op", None) != "sum":
        missing.append("Partial.reduce_op")
    if getattr(Shard(1), "dim", None) != 1:
        missing.append("Shard.dim")
    if "run_check" not in inspect.signature(DTensor.from_local).parameters:
        missing.append("DTensor.from_local(run_check=)")
    return "no: " + ", ".join(missing) if missing else "yes"


def _numa_modes() -> str:
    """launcher/args.py copies torchrun's ``--numa-binding`` choices (torch's ``AffinityMode`` values)."""
    binding = importlib.import_module("torch.numa.binding")
    modes = getattr(binding, "AffinityMode", None) or getattr(binding, "_AffinityMode", None)
    if modes is None:
        return "no: torch.numa.binding.AffinityMode"
    got = {m.value for m in modes}
    return "yes" if got == {"node", "socket", "exclusive", "core-complex"} else f"no: values {sorted(got)}"


def _async_op() -> str:
    """``asyncOp`` on every collective's options (ckptless/worker/rebindable.py ``_keep_work``): writable
    where present; options without it are left alone (no ``no``: the field's absence is handled)."""
    import torch._C._distributed_c10d as c10d
    names = ("AllreduceOptions", "AllreduceCoalescedOptions", "BroadcastOptions", "BarrierOptions",
             "AllgatherOptions", "ReduceScatterOptions", "AllToAllOptions", "GatherOptions", "ScatterOptions",
             "ReduceOptions")
    without = []
    for name in names:
        opts = getattr(c10d, name)()
        if not hasattr(opts, "asyncOp"):
            without.append(name)
            continue
        opts.asyncOp = False
        opts.asyncOp = True
        if opts.asyncOp is not True:
            return f"no: {name}.asyncOp is not writable"
    return f"yes: no asyncOp on {', '.join(without)} (left alone)" if without else "yes"


def reset_iter_state_api() -> str:
    """Present (2.13, 2.14) or not (2.11): either is handled; absent, the fallback's fields must be there."""
    from torch.distributed.fsdp import FSDPModule
    if callable(getattr(FSDPModule, "reset_iter_state", None)):
        return "yes"
    fields = _reset_iter_state_fields()
    return "yes: absent, ckptless's fallback" if fields == "yes" else f"no: absent, and the fallback's {fields}"


def _reset_iter_state_fields() -> str:
    """What ``ckptless.state.fsdp._reset_iter_state`` reads and writes without ``getattr`` defaults (the
    comm context's all-gather and reduce-scatter states differ by version and are read with defaults)."""
    pkg = "torch.distributed.fsdp._fully_shard"
    needs = (
        self_attr(f"{pkg}._fsdp_state:FSDPState", "_device_handle", "_comm_ctx", "_state_ctx",
                  "_modules_to_run_forward", "_training_state"),
        self_attr(f"{pkg}._fsdp_state:FSDPStateContext", "all_states", "iter_forward_root",
                  "post_backward_final_callback_queued"),
        self_attr(f"{pkg}._fsdp_param_group:FSDPCommContext", "post_forward_order"),
        self_attr(f"{pkg}._fsdp_param_group:FSDPCommContext", "reduce_scatter_states", "reduce_scatter_state",
                  any_of=True),
        self_attr(f"{pkg}._fsdp_param_group:FSDPParamGroup", "_all_gather_result", "_post_reduce_event",
                  "_reshard_after_forward_event", "_partial_reduce_output", "_post_forward_indices",
                  "_training_state"),
        attr(f"{pkg}._fsdp_param_group:FSDPParamGroup._wait_all_gather_streams_on_event",
             f"{pkg}._fsdp_param_group:FSDPParamGroup._to_sharded", f"{pkg}._fsdp_common:TrainingState.IDLE", f"{pkg}._fsdp_collectives:AllGatherResult.all_gather_event",
             f"{pkg}._fsdp_collectives:AllGatherResult.all_gather_work"),
    )
    missing = [got[4:] for got in (probe() for probe in needs) if got.startswith("no")]
    return "no: " + "; ".join(missing) if missing else "yes"


_C10D = "torch._C._distributed_c10d"
_DDP = "torch.nn.parallel.distributed:DistributedDataParallel"
_FSDP = "torch.distributed.fsdp._fully_shard"
RB, GR, NC = "ckptless/worker/rebindable.py", "ckptless/worker/groups.py", "ckptless/worker/nccl.py"
SC = "ckptless/worker/store_client.py"
DDP_PY, FSDP_PY = "ckptless/state/ddp.py", "ckptless/state/fsdp.py"

TOUCHPOINTS: tuple[Touchpoint, ...] = (
    # --- process groups: the rebindable group, its plugin, its backends ---
    Touchpoint(RB, "from torch._C._distributed_c10d import _create_work_from_future",
               "`_c10d._create_work_from_future` (an unbound group's local answer)",
               attr(f"{_C10D}:_create_work_from_future")),
    Touchpoint(RB, "class _TypedWork(dist.Work)", "`dist.Work` subclassed in Python (typed wait, future passed through)",
               attr("torch.distributed:Work.get_future", "torch.distributed:Work.is_success")),
    Touchpoint(RB, "class RebindableGroup(dist.ProcessGroup)",
               "`dist.ProcessGroup` subclassed in Python; C++ callers reach its overrides by these names",
               attr(*(f"torch.distributed:ProcessGroup.{n}" for n in (
                   "allreduce", "allreduce_coalesced", "broadcast", "barrier", "allgather", "_allgather_base",
                   "allgather_into_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base",
                   "reduce_scatter_tensor_coalesced", "alltoall_base", "alltoall", "gather", "scatter", "reduce",
                   "send", "recv", "recv_anysource", "_set_group_name", "_set_group_desc", "group_name",
                   "group_desc")))),
    Touchpoint(RB, "_LAZY_ENV = ", "`TORCH_GLOO_LAZY_INIT` (read in ProcessGroupGloo's constructor)",
               lib_string("libtorch_cpu.so", "TORCH_GLOO_LAZY_INIT")),
    Touchpoint(RB, "opts = dist.ProcessGroupGloo._Options()",
               "`ProcessGroupGloo._Options`, `._timeout`, `._devices`, `ProcessGroupGloo.create_device`",
               _gloo_options),
    Touchpoint(RB, "nccl.start_sequence_numbers(pg)", "`ProcessGroupGloo._set_sequence_number_for_group` (called "
               "on torch < 2.14 only: nccl.start_sequence_numbers)",
               _sequence_number),
    Touchpoint("ckptless/worker/gloo_peers.py", "def parse_rank_record", "Gloo's store keys (`<ctx>/<rank>`) and `tcp::Rank` record layout "
               "(ckptless/worker/gloo_peers.py parses them)", _gloo_rank_record),
    Touchpoint(RB, "def _keep_work(opts", "collective options' `asyncOp` set True (ProcessGroupNCCL returns no Work "
               "for a synchronous call: torch 2.11, GPU run 2); a `None` Work taken as finished", _async_op),
    Touchpoint(RB, "success = getattr(_c10d, \"ErrorType\", None)",
               "`_c10d.ErrorType.SUCCESS`, `Backend.get_error()`", _error_type),
    Touchpoint(RB, "gloo.options.group_name = self._name", "`Backend.options.group_name`, `.global_ranks_in_group`",
               lambda: "yes" if all(hasattr(_world1_gloo().options, a) for a in
                                    ("group_name", "global_ranks_in_group")) else "no: Backend.options fields"),
    Touchpoint(RB, "inner._set_default_backend(GLOO)",
               "`ProcessGroup._set_default_backend`, `._register_backend`, `ProcessGroup.BackendType`",
               attr("torch.distributed:ProcessGroup._set_default_backend",
                    "torch.distributed:ProcessGroup._register_backend",
                    "torch.distributed:ProcessGroup.BackendType.GLOO",
                    "torch.distributed:ProcessGroup.BackendType.NCCL")),
    Touchpoint(RB, "plugin = dist.Backend._plugins.get(name.upper())",
               "`dist.Backend._plugins` (`creator_fn`), `register_backend(extended_api=, devices=)`", _plugins),
    Touchpoint(RB, "opts = dist.distributed_c10d._DistributedBackendOptions()",
               "`distributed_c10d._DistributedBackendOptions` and its fields", _backend_options),
    Touchpoint(GR, "default = dist.distributed_c10d._get_default_group()", "`distributed_c10d._get_default_group`",
               attr("torch.distributed.distributed_c10d:_get_default_group")),
    Touchpoint(GR, "dist.distributed_c10d.init_process_group = _guarded_init_process_group",
               "`init_process_group` replaced in `torch.distributed` and `distributed_c10d` (a clear error)",
               attr("torch.distributed.distributed_c10d:init_process_group")),
    Touchpoint(SC, "use_libuv=True", "`TCPStore(use_libuv=)`",
               lambda: "yes" if "use_libuv" in (_resolve("torch.distributed:TCPStore").__init__.__doc__ or "")
               else "no: TCPStore(use_libuv=)"),
    # --- NCCL ---
    Touchpoint(NC, "opts = dist.ProcessGroupNCCL.Options()",
               "`ProcessGroupNCCL.Options`, `._timeout`, `.config.blocking`, `.group_name`, `.global_ranks_in_group`",
               nccl_attr("Options.()._timeout", "Options.().config.blocking", "Options.().group_name",
                         "Options.().global_ranks_in_group")),
    Touchpoint(NC, "backend._set_sequence_number_for_group()", "`ProcessGroupNCCL._set_sequence_number_for_group` "
               "(2.14.1: the base class's deprecated no-op, warns; called on torch < 2.14 only)", nccl_attr("_set_sequence_number_for_group")),
    Touchpoint(NC, "eager = getattr(backend, \"eager_connect_single_device\", None)",
               "`ProcessGroupNCCL.eager_connect_single_device`", nccl_attr("eager_connect_single_device")),
    Touchpoint("ckptless/worker/forming.py", "backend.abort()", "`ProcessGroupNCCL.abort` (off the training thread)",
               nccl_attr("abort")),
    Touchpoint("ckptless/worker/nccl_env.py", "TORCH_NCCL_DUMP_ON_TIMEOUT",
               "`TORCH_NCCL_*` settings (nccl_env.SETTINGS; docs/configuration.md, \"torch's NCCL settings\")",
               lib_string("libtorch_cuda.so", "TORCH_NCCL_DUMP_ON_TIMEOUT")),
    # --- DDP reducer ---
    Touchpoint(DDP_PY, "ddp._build_params_for_reducer()",
               "DDP `._build_params_for_reducer`, `._build_debug_param_to_name_mapping`, `._ddp_init_helper`",
               attr(f"{_DDP}._build_params_for_reducer", f"{_DDP}._build_debug_param_to_name_mapping",
                    f"{_DDP}._ddp_init_helper")),
    Touchpoint(DDP_PY, "if self._ddp._has_rebuilt_buckets:",
               "DDP instance state `._has_rebuilt_buckets`, `._comm_hooks`, `._use_python_reducer`, "
               "`._delay_all_reduce_all_params`, `.reducer`, `.parameters_to_ignore`, `.require_forward_param_sync`",
               self_attr(_DDP, "_has_rebuilt_buckets", "_comm_hooks", "_use_python_reducer",
                         "_delay_all_reduce_all_params", "reducer", "parameters_to_ignore",
                         "require_forward_param_sync", "require_backward_grad_sync")),
    Touchpoint(DDP_PY, "red._autograd_hook(i)",
               "`Reducer._autograd_hook`, `._rebuild_buckets`, `._reset_state`, `._get_zeros_like_grad_buckets`, "
               "`._remove_autograd_hooks`, `.prepare_for_backward`",
               attr(*(f"{_C10D}:Reducer.{n}" for n in ("_autograd_hook", "_rebuild_buckets", "_reset_state",
                                                        "_get_zeros_like_grad_buckets", "_remove_autograd_hooks",
                                                        "prepare_for_backward")))),
    # --- FSDP2 ---
    Touchpoint(FSDP_PY, "m._get_fsdp_state()", "`FSDPModule._get_fsdp_state`",
               attr("torch.distributed.fsdp:FSDPModule._get_fsdp_state")),
    Touchpoint(FSDP_PY, "api = getattr(m, \"reset_iter_state\", None)",
               "`FSDPModule.reset_iter_state` (2.13; torch 2.11 lacks it: ckptless's own `_reset_iter_state` then)",
               reset_iter_state_api),
    Touchpoint(FSDP_PY, "def _reset_iter_state(root", "the fields ckptless's `_reset_iter_state` resets where "
               "`reset_iter_state` is missing (FSDPState, its state and comm contexts, FSDPParamGroup; read "
               "against 2.11.0's sources and 2.13's)", _reset_iter_state_fields),
    Touchpoint(FSDP_PY, "groups = getattr(state, \"_fsdp_param_groups\", None)",
               "`FSDPState._fsdp_param_groups` (2.13) or `._fsdp_param_group` (2.11)",
               self_attr(f"{_FSDP}._fsdp_state:FSDPState", "_fsdp_param_groups", "_fsdp_param_group", any_of=True)),
    Touchpoint(FSDP_PY, "if state._is_root:", "`FSDPState._is_root`", self_attr(f"{_FSDP}._fsdp_state:FSDPState", "_is_root")),
    Touchpoint(FSDP_PY, "result = group._all_gather_result",
               "`FSDPParamGroup._all_gather_result` (`.all_gather_work`), `._module_to_pre_load_state_dict_hook_handle`, "
               "`.fsdp_params`",
               self_attr(f"{_FSDP}._fsdp_param_group:FSDPParamGroup", "_all_gather_result",
                         "_module_to_pre_load_state_dict_hook_handle", "fsdp_params")),
    Touchpoint(FSDP_PY, "post.add(param._post_load_hook_handle.id)",
               "`FSDPParam._post_load_hook_handle`, `._unsharded_param`, `.unsharded_accumulated_grad`",
               self_attr(f"{_FSDP}._fsdp_param:FSDPParam", "_post_load_hook_handle", "_unsharded_param",
                         "unsharded_accumulated_grad")),
    Touchpoint("ckptless/state/dtensor.py", "placements.append((\"P\", str(p.reduce_op)))",
               "DTensor: `Shard.dim`, `Partial.reduce_op`, `DTensor.from_local(run_check=)`, `DeviceMesh.mesh`",
               _dtensor),
    # --- data loading, RNG, snapshots, devices ---
    Touchpoint("ckptless/passes.py", "from torch.utils.data._utils.worker import _generate_state",
               "`torch.utils.data._utils.worker._generate_state(base_seed, worker_id)` (a worker's NumPy seed)",
               _generate_state),
    Touchpoint("ckptless/passes.py", "getattr(loader, \"_iterator\", None)",
               "`DataLoader._iterator` (a persistent loader's live iterator)",
               self_attr("torch.utils.data:DataLoader", "_iterator")),
    Touchpoint("ckptless/sample_seeds.py", "_TORCH_DELEGATES = ",
               "`Subset.__getitems__` lives in `torch.utils.data.dataset`; the map-style fetcher calls `__getitems__`",
               _getitems_delegates),
    Touchpoint("ckptless/snapshot/writer.py", "from torch.distributed.checkpoint._nested_dict import flatten_state_dict",
               "`torch.distributed.checkpoint._nested_dict.flatten_state_dict`",
               attr("torch.distributed.checkpoint._nested_dict:flatten_state_dict")),
    Touchpoint("ckptless/state/host_memory.py", "torch.cuda.cudart().cudaHostRegister",
               "`torch.cuda.cudart()` (`cudaHostRegister`/`cudaHostUnregister`)", attr("torch.cuda:cudart")),
    Touchpoint("ckptless/worker/faults.py", "accelerator_error = getattr(torch, \"AcceleratorError\", None)",
               "`torch.AcceleratorError` (read with getattr: absent on older torch)", attr("torch:AcceleratorError")),
    Touchpoint("launcher/arg_values.py", "if torch.accelerator.is_available():",
               "`torch.accelerator` (`--nproc-per-node auto`)", attr("torch:accelerator.device_count")),
    Touchpoint("launcher/args.py", "torch.numa.binding._AffinityMode",
               "`torch.numa.binding.AffinityMode` values copied (`--numa-binding` choices)", _numa_modes),
)


def probe_all() -> list[tuple[Touchpoint, str]]:
    out = []
    for t in TOUCHPOINTS:
        try:
            got = t.probe()
        except Exception as exc:  # a probe that cannot run is a finding too
            got = f"no: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        out.append((t, got))
    return out


def main() -> int:
    import torch
    print(f"torch {torch.__version__}")
    print("| where | what | here |\n|---|---|---|")
    results = probe_all()
    for t, got in results:
        print(f"| {t.where()} | {t.what} | {got} |")
    return 1 if any(got.startswith("no") for _, got in results) else 0


if __name__ == "__main__":
    sys.exit(main())

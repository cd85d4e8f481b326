"""Loop-carried values, protected by name: ``c = job.carry(X=X, Y=Y, best_val_loss=1e9)``.

Why: a training loop carries values from one iteration to the next that are
in no module or optimizer: the batch prefetched before the step (nanoGPT's
``X, Y = get_batch('train')`` at the end of the body), the best validation
loss so far, counters, an EMA kept in a plain tensor. After a recovery the
loop resumes at the resume step with the model, optimizer and RNG of that
version, but with whatever those locals held in this process: a survivor's
batch of a later step, a replacement's batch of its setup. The run then
silently trains on other data (issue 38). Before this the only port was a
hand-written ``Stateful`` whose ``load_state_dict`` assigned module globals.

How: :class:`Carried` is a namespace whose attributes are declared once (the
keyword arguments of ``job.carry``) and protected like any object, under the
name ``carried``. Its state is the attributes as they are when the version
is captured, which is the end of the step's body (``docs/state.md``,
"Loop-carried values"): the batch the body prefetched for the next step, the
metric it updated after its optimizer step, all of them. A recovery puts
them back before the loop gets the resume step.

Encoding: the values go through the image's tagged tree
(:mod:`ckptless.state.tree`), never pickle: tensors (on their device; a
restore puts them on the rank's current device), ``None``/``bool``/``int``/
``float``/``str``, lists, tuples, dicts with ``str``/``int`` keys of those,
NumPy arrays and scalars. Anything else is refused when it is assigned, with
a ``ConfigError`` naming the attribute and the value, rather than at the next
capture, steps later and on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ckptless.errors import ConfigError, StateError
from ckptless.state import encode

__all__ = ["CARRIED_ENTRY", "Carried", "check_value"]

CARRIED_ENTRY = "carried"
"""The name ``job.carry`` protects the namespace under (the digest and the chaos verdict show it)."""


def check_value(name: str, value: Any) -> None:
    """Refuse a value the image cannot hold exactly (``ConfigError`` naming ``carried.<name>`` and the value)."""
    try:
        encode(value, f"carried.{name}")
    except StateError as exc:
        reason = str(exc).split(": ", 1)[-1]
        raise ConfigError(f"carried.{name}", value,
                          f"a loop-carried value must be a tensor, None, bool, int, float, str, NumPy value, or a "
                          f"list/tuple/dict (str or int keys) of those ({reason}); keep an object with its own "
                          f"state_dict() in job.protect(...) instead") from None


class Carried:
    """A namespace of loop-carried values (see module doc): ``c.X``, ``c.best_val_loss``.

    Only declared names can be set (a typo would otherwise carry a value nobody reads, and leave the
    real one unprotected); every value is checked as it is assigned. ``ignore``: loop-carried
    locals the start-up check may name but that need no protection (a wall-clock ``t0``).
    """

    # Counted as a data position, as any Stateful of the script's own is (ckptless.data.protects_data_position):
    # a loop that samples its batches from the protected RNG keeps its place in what it carries (the batch it
    # prefetched), and a warning on every such port would be a false alarm.
    __ckptless_data_position__ = True

    def __init__(self, values: Mapping[str, Any], ignore: Iterable[str] = ()) -> None:
        for name, value in values.items():
            _check_name(name)
            check_value(name, value)
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_ignored", frozenset(ignore))

    @property
    def names(self) -> frozenset[str]:
        """The declared names and the ignored ones: what the start-up check counts as seen to."""
        return frozenset(self._values) | self._ignored

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        try:
            return values[name]
        except KeyError:
            raise AttributeError(f"no loop-carried value {name!r} (declared: {', '.join(values) or 'none'})") from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._values:
            raise ConfigError(f"carried.{name}", value,
                              f"is not declared: add {name}=<initial value> to job.carry(...) "
                              f"(declared: {', '.join(self._values) or 'none'})")
        check_value(name, value)
        self._values[name] = value

    def __delattr__(self, name: str) -> None:
        raise ConfigError(f"carried.{name}", None, "a declared loop-carried value cannot be deleted; assign None")

    def __repr__(self) -> str:
        return f"Carried({', '.join(f'{k}={type(v).__name__}' for k, v in self._values.items())})"

    def state_dict(self) -> dict[str, Any]:
        # The live values: the capture copies them at once (a device tensor on a side stream that the
        # next step waits for before it runs, docs/state.md "GPUs"), so a value rebound or updated in
        # place later is never torn.
        return dict(self._values)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        got, want = set(state_dict), set(self._values)
        if got != want:
            raise StateError(f"the image's loop-carried values {sorted(got)} are not the ones this process "
                             f"declared {sorted(want)}: every incarnation must call job.carry(...) alike")
        self._values.update(state_dict)


def _check_name(name: str) -> None:
    if not name.isidentifier() or name.startswith("_") or name in ("names", "state_dict", "load_state_dict"):
        raise ConfigError("carried", name, "a loop-carried value's name must be a public Python identifier "
                                           "other than names/state_dict/load_state_dict")

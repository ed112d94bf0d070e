"""CPU threads: how many torch uses for a CPU model, and libgomp's wait policy.

Why not torch's default (one OpenMP thread per core): torch's parallel regions split work
statically and end in a barrier, so each region lasts as long as its slowest thread. When another
process holds a core, the thread on it is descheduled and every region (hundreds per decode
token) waits for it; spinning waiters make it worse. On a shared 2-core machine that took decode
from tens of tokens/s to about one. onnxruntime's pool lets the calling thread take the work a
worker has not started, so it slows down instead. The default here is therefore half the
usable cores (at least 1): two processes, or one process beside a busy neighbour, still find a
core per thread. With one thread no barrier exists at all; on a quiet machine it costs some
speed against all cores (an explicit ``num_threads`` takes it back). A caller may ask for all the
usable cores as its default instead (``ThreadOptions.default="all"``): the batching server on the
CPU does, where the batched step's larger products gain more from a second core than a lone
stream's memory-bound ones (docs/batching.md has the measurement).

Precedence, highest first: ``ThreadOptions.num_threads`` (the CLI's --threads); the
``OMP_NUM_THREADS`` environment variable (torch has already applied it); a thread count the
user set with ``torch.set_num_threads`` (seen as a count different from torch's own default,
one per core: a user who sets exactly that is not told apart, and gets the default); the
default above. torch's thread count is per process: applying options affects every model
of the process.

The wait policy (``OMP_WAIT_POLICY``: "passive" sleeps at once, "active" spins) is read by
libgomp once, when torch loads it at ``import torch``; setting the variable afterwards changes
nothing. So ``ThreadOptions.prepare()`` sets it, and must run before torch is imported (the
CLI does so before it imports anything heavy). If torch is already imported the policy cannot
change: ``prepare()`` says so once on stderr and goes on with the policy libgomp has. A user's
own OMP_WAIT_POLICY or GOMP_SPINCOUNT is never overwritten. (This module sits outside
onnxgen.runtime, whose package import loads torch, so that importing it keeps torch unloaded.)
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from onnxgen.errors import InvalidInputError

WAIT_POLICIES = ("active", "passive")
_state: dict[str, int | None] = {"applied": None}  # the count apply() last set


@dataclass(frozen=True)
class ThreadOptions:
    """``num_threads``: torch intra-op threads for CPU work (None: see the module docstring).
    ``wait_policy``: "active"/"passive" for libgomp (None: libgomp's default); takes effect only
    through ``prepare()`` before torch is imported. ``default``: the count where neither these
    options nor the user chose one, "half" the usable cores or "all" of them."""

    num_threads: int | None = None
    wait_policy: str | None = None
    default: str = "half"

    def __post_init__(self) -> None:
        if self.num_threads is not None and (isinstance(self.num_threads, bool) or int(self.num_threads) < 1):
            raise InvalidInputError(f"num_threads must be a positive integer, got {self.num_threads!r}")
        if self.default not in ("half", "all"):
            raise InvalidInputError(f"the default thread count is 'half' or 'all' of the cores, got {self.default!r}")
        if self.wait_policy is not None and self.wait_policy not in WAIT_POLICIES:
            raise InvalidInputError(f"wait_policy must be one of {WAIT_POLICIES} or None, got {self.wait_policy!r}")

    def prepare(self) -> None:
        """Set the environment libgomp reads at load time (call before ``import torch``)."""
        if self.wait_policy is None:
            return
        wanted = self.wait_policy.upper()
        if "torch" in sys.modules:
            if os.environ.get("OMP_WAIT_POLICY", "").upper() != wanted:
                print(
                    f"onnxgen: note: wait policy {self.wait_policy!r} not applied: torch was imported before "
                    "onnxgen could set OMP_WAIT_POLICY (set it in the environment instead)",
                    file=sys.stderr,
                )
            return
        if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
            return  # the user's own setting wins
        os.environ["OMP_WAIT_POLICY"] = wanted

    def apply(self) -> int:
        """Set torch's thread count by the precedence in the module docstring; returns it."""
        import torch

        current = torch.get_num_threads()
        if self.num_threads is not None:
            chosen = int(self.num_threads)
        elif _user_chose(current):
            return current
        else:
            chosen = usable_cores() if self.default == "all" else default_threads()
        if chosen != current:
            torch.set_num_threads(chosen)
        _state["applied"] = chosen
        return chosen


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads(cores: int | None = None) -> int:
    """Half the usable cores, at least one (see the module docstring)."""
    return max(1, (cores if cores is not None else usable_cores()) // 2)


def _user_chose(current: int) -> bool:
    """Whether the thread count in force came from the user (environment or torch.set_num_threads)."""
    if os.environ.get("OMP_NUM_THREADS", "").strip() or os.environ.get("MKL_NUM_THREADS", "").strip():
        return True
    if _state["applied"] is not None:  # we set it before: only a change since then is the user's
        return current != _state["applied"]
    # torch's own default is one thread per usable core (or per CPU of the machine)
    return current not in (usable_cores(), os.cpu_count())

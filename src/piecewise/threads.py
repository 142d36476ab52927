"""The CPU thread policy of inference processes: how many intra-op threads torch runs, decided from
the cores this process may use and what other processes already run on them.

Why: a CPU decode step is tens of milliseconds of small parallel regions. torch's default (one
intra-op thread per core) holds on a quiet host, but when another process keeps one of those
cores busy, every parallel region waits at its barrier for the thread that shares a core with it,
and the step collapses: on a 2-core host, SmolLM2's decode step took 704 ms with torch's default
2 threads against 41 ms with 1 thread (issue 48). A step on the cores nobody else uses does not.

The policy (`decide_threads`):

* ``PIECEWISE_NUM_THREADS=N`` wins (``auto`` or empty: the policy below);
* else a thread count the user chose is kept: ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` set, or
  ``torch.set_num_threads`` called with a value other than torch's default;
* else one thread per usable core that other processes leave free: ``floor(usable - others +
  0.25)``, at least 1, at most torch's default; `usable` is the process's CPU affinity
  (``os.sched_getaffinity``, as ``taskset`` sets it) capped by a cgroup CPU quota, `others` the
  cores' worth of CPU time other processes used on those cores over a short sample (psutil's
  per-CPU times less this process's own; without psutil, the 1-minute load average).

A host is *oversubscribed* when ``others + threads > usable + 0.25``: whatever the thread count, a
step then shares cores with other work and runs slower and unevenly. That is logged once per
process (logger ``piecewise.threads``), naming the fix.

Where it applies: ``piecewise generate`` and the generation benchmark (``--threads policy``) call
`apply_serving_threads`; ``piecewise demo`` does not (it measures at torch's default); the library never changes a
process's thread count by itself (`piecewise.compile` on a CPU model only checks the host once, in
the background, and warns). A server built on the library calls `apply_serving_threads` at start::

    import piecewise.threads

    decision = piecewise.threads.apply_serving_threads()
    print(decision.describe())  # e.g. "1 intra-op thread (policy: 2 usable cores, 1.0 busy with other processes)"

The decision is taken once, at the call: a process that starts on a quiet host and later shares
it keeps its count (call `apply_serving_threads` again to re-decide). A thread count changes the
warm-start bundle's key (a bundle per count) and what Inductor's C++ kernels compile for.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Collection, Mapping

from .errors import ConfigError

__all__ = ["ENV_VAR", "HostLoad", "ThreadDecision", "apply_serving_threads", "decide_threads", "host_load",
           "oversubscribed", "serving_threads", "usable_cores", "warn_if_oversubscribed"]

log = logging.getLogger("piecewise.threads")

#: the override: a positive whole number of intra-op threads, or ``auto`` (the policy)
ENV_VAR = "PIECEWISE_NUM_THREADS"
#: variables by which a user has already chosen the thread count (torch reads them at start)
USER_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: the share of a core other processes may use before it no longer counts as free
SLACK = 0.25

_lock = threading.Lock()
_warned = False  # the oversubscription warning of this process has been logged
_checked = False  # warn_if_oversubscribed has started its one check of this process
_applied: int | None = None  # the count apply_serving_threads last set (not the user's)
_torch_start: int | None = None  # torch's count before apply_serving_threads first changed it


@dataclasses.dataclass(frozen=True)
class HostLoad:
    """What a process may use and what others use of it.

    Attributes:
        usable_cores: cores this process may run on: its affinity mask, capped by a cgroup CPU quota.
        others_busy: cores' worth of CPU time (0.0 = idle, 1.0 = one core always busy) that other
            processes used on those cores: a sample of per-CPU times less this process's own, or
            the 1-minute load average (`source` says which).
        source: how `others_busy` was measured, e.g. ``"per-CPU sample over 0.10 s"`` or ``"load average"``.
    """

    usable_cores: int
    others_busy: float
    source: str = "given"


@dataclasses.dataclass(frozen=True)
class ThreadDecision:
    """The intra-op thread count for serving, and why.

    Attributes:
        threads: intra-op threads (``torch.set_num_threads``), at least 1.
        source: who decided: ``"PIECEWISE_NUM_THREADS"``, ``"OMP_NUM_THREADS"``,
            ``"MKL_NUM_THREADS"``, ``"torch.set_num_threads"`` (kept: the user's) or ``"policy"``.
        load: the host load it was decided on.
        oversubscribed: other processes and these threads together want more than the usable cores.
    """

    threads: int
    source: str
    load: HostLoad
    oversubscribed: bool

    def describe(self) -> str:
        """One line: ``"1 intra-op thread (policy: 2 usable cores, 1.0 busy with other processes)"``."""
        plural = "" if self.threads == 1 else "s"
        return (f"{self.threads} intra-op thread{plural} ({self.source}: {self.load.usable_cores} usable core"
                f"{'' if self.load.usable_cores == 1 else 's'}, {self.load.others_busy:.1f} busy with other processes"
                f"{', oversubscribed' if self.oversubscribed else ''})")

    def warning(self, how: str = "process") -> str:
        """The oversubscription warning's text, naming the fix; `how` is ``"process"`` (a process
        that applies the policy: the command line, a server) or ``"library"`` (torch's count is the
        user's to set)."""
        load = self.load
        head = (f"this host is oversubscribed: other processes keep {load.others_busy:.1f} of the {load.usable_cores} "
                f"core{'' if load.usable_cores == 1 else 's'} this process may use busy ({load.source}) and torch runs "
                f"{self.threads} intra-op thread{'' if self.threads == 1 else 's'}, so a CPU step runs slower and "
                "unevenly (a parallel region waits for its thread that shares a core)")
        free = max(1, math.floor(load.usable_cores - load.others_busy + SLACK))
        if self.threads > free:
            if how == "library":
                fix = (f"use {free} thread{'' if free == 1 else 's'}: torch.set_num_threads({free}), OMP_NUM_THREADS={free} "
                       "at start, or piecewise.threads.apply_serving_threads()")
            else:
                fix = f"use {free} thread{'' if free == 1 else 's'}: PIECEWISE_NUM_THREADS={free} (or OMP_NUM_THREADS={free})"
            return f"{head}; fix: {fix}, or give the process cores of its own (taskset -c CPUS)"
        return (f"{head}; fix: give the process cores no other process uses (taskset -c CPUS, a cpuset), or run "
                "fewer processes on this host")


def usable_cores(affinity: Collection[int] | None = None, quota: float | None = None) -> int:
    """Cores this process may run on: its CPU affinity (``os.sched_getaffinity(0)``, what
    ``taskset`` sets; ``os.cpu_count()`` where there is none) capped by the cgroup CPU quota
    (``cpu.max``: 2.5 CPUs of quota make 3 cores), at least 1. `affinity` and `quota` replace what
    is read from the system (tests)."""
    if affinity is None:
        try:
            affinity = os.sched_getaffinity(0)
        except (AttributeError, OSError):  # not Linux
            affinity = range(os.cpu_count() or 1)
    n = max(1, len(affinity))
    if quota is None:
        quota = _cgroup_quota()
    if quota is not None and quota > 0:
        n = min(n, max(1, math.ceil(quota)))
    return n


def _cgroup_quota() -> float | None:
    """CPUs of this cgroup's quota (cgroup v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``), None
    when there is none or it cannot be read."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            q = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            p = int(f.read())
        return None if q <= 0 or p <= 0 else q / p
    except (OSError, ValueError):
        return None


def host_load(interval: float = 0.1) -> HostLoad:
    """Measure the host: `usable_cores` and what other processes use of those cores.

    With psutil (and `interval` > 0): per-CPU busy time of the usable CPUs (all but idle and
    iowait; a VM's steal counts as busy) over `interval` seconds, less this process's own CPU time
    in that time (all its threads). Without psutil, or with `interval` 0: the 1-minute load
    average (which lags a minute and may count this process and CPUs outside its affinity).
    Blocks for `interval` seconds.
    """
    cores = usable_cores()
    if interval > 0:
        try:
            import psutil
        except ImportError:
            psutil = None
        if psutil is not None:
            try:
                affinity = sorted(os.sched_getaffinity(0))
            except (AttributeError, OSError):
                affinity = list(range(os.cpu_count() or 1))
            own0, t0, before = os.times(), time.monotonic(), psutil.cpu_times(percpu=True)
            time.sleep(interval)
            after, t1, own1 = psutil.cpu_times(percpu=True), time.monotonic(), os.times()
            ids = [i for i in affinity if i < min(len(before), len(after))] or list(range(len(after)))
            busy = 0.0
            for i in ids:
                total = sum(after[i]) - sum(before[i])
                idle = (after[i].idle - before[i].idle) + (getattr(after[i], "iowait", 0.0) - getattr(before[i], "iowait", 0.0))
                busy += (1.0 - idle / total) if total > 0 else 0.0
            busy *= cores / len(ids)  # a quota below the affinity: the share that falls on our cores
            own = ((own1.user + own1.system) - (own0.user + own0.system)) / max(t1 - t0, 1e-6)
            return HostLoad(cores, round(max(0.0, busy - own), 2), f"per-CPU sample over {t1 - t0:.2f} s")
    try:
        load1 = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return HostLoad(cores, 0.0, "no measurement")
    return HostLoad(cores, round(load1, 2), "1-minute load average")


def oversubscribed(load: HostLoad, threads: int) -> bool:
    """Whether other processes and `threads` intra-op threads want more than the usable cores
    (beyond `SLACK` of a core)."""
    return load.others_busy + threads > load.usable_cores + SLACK


def _env_threads(env: Mapping[str, str]) -> int | None:
    """``PIECEWISE_NUM_THREADS`` as a count; None when unset, empty or ``auto``.

    Raises:
        ConfigError: a value that is not a positive whole number or ``auto``.
    """
    raw = env.get(ENV_VAR, "").strip()
    if raw.lower() in ("", "auto"):
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"{ENV_VAR}={raw!r}: give a whole number of intra-op threads of at least 1 "
                          f"(e.g. {ENV_VAR}=1), or 'auto' for piecewise's policy")
    return n


def decide_threads(
    load: HostLoad,
    *,
    torch_threads: int,
    default_threads: Collection[int] = (),
    applied: int | None = None,
    torch_default: int | None = None,
    env: Mapping[str, str] | None = None,
) -> ThreadDecision:
    """The serving thread count for `load` (see the module doc for the rules). Pure: changes nothing.

    Args:
        load: the host (`host_load`).
        torch_threads: torch's intra-op count now (``torch.get_num_threads()``).
        default_threads: the counts torch starts with on this host (logical and physical cores,
            the affinity's size): `torch_threads` outside them was set by a ``torch.set_num_threads``
            call and is kept. Empty: `torch_threads` is taken as torch's default.
        applied: the count the policy set earlier in this process (`torch_threads` equal to it is
            not the user's).
        torch_default: torch's own count, the most the policy runs (default `torch_threads`).
        env: the environment (default ``os.environ``).

    Raises:
        ConfigError: ``PIECEWISE_NUM_THREADS`` is not a positive whole number or ``auto``.

    Example::

        >>> decide_threads(HostLoad(2, 1.0), torch_threads=2, env={}).threads
        1
    """
    env = os.environ if env is None else env
    forced = _env_threads(env)
    if forced is not None:
        return ThreadDecision(forced, ENV_VAR, load, oversubscribed(load, forced))
    for name in USER_VARS:
        if env.get(name, "").strip():
            return ThreadDecision(torch_threads, name, load, oversubscribed(load, torch_threads))
    if default_threads and torch_threads not in default_threads and torch_threads != applied:
        return ThreadDecision(torch_threads, "torch.set_num_threads", load, oversubscribed(load, torch_threads))
    cap = max(1, min(torch_default or torch_threads, load.usable_cores))
    threads = max(1, min(cap, math.floor(load.usable_cores - load.others_busy + SLACK)))
    return ThreadDecision(threads, "policy", load, oversubscribed(load, threads))


def _default_threads() -> set[int]:
    """The counts torch may start with here: logical CPUs, physical cores, the affinity's size."""
    counts = {os.cpu_count() or 1}
    try:
        counts.add(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        pass
    try:
        import psutil

        counts.add(psutil.cpu_count(logical=False) or 1)
    except ImportError:
        pass
    return counts


def serving_threads(interval: float = 0.1, *, load: HostLoad | None = None,
                    default_threads: Collection[int] | None = None) -> ThreadDecision:
    """The decision for this process now (`host_load` over `interval` seconds unless `load` is
    given, then `decide_threads` with torch's current count and `default_threads`, default the
    counts torch starts with on this host); changes nothing. See `apply_serving_threads`.

    Raises:
        ConfigError: ``PIECEWISE_NUM_THREADS`` is not a positive whole number or ``auto``.
    """
    import torch

    _env_threads(os.environ)  # a bad value fails before the sample
    current = torch.get_num_threads()
    ours = _applied is not None and current == _applied
    return decide_threads(load if load is not None else host_load(interval), torch_threads=current,
                          default_threads=_default_threads() if default_threads is None else default_threads,
                          applied=_applied, torch_default=_torch_start if ours else current)


def apply_serving_threads(interval: float = 0.1, *, load: HostLoad | None = None,
                          default_threads: Collection[int] | None = None, how: str = "process") -> ThreadDecision:
    """Decide (`serving_threads`) and apply: ``torch.set_num_threads`` when the policy or
    ``PIECEWISE_NUM_THREADS`` decided (a count the user chose is left alone), and log the
    oversubscription warning once per process when the host is oversubscribed. For inference
    processes: the command line and servers call it at start; a library must not.

    Args:
        interval: seconds `host_load` samples for (blocks that long).
        load: use this instead of measuring (tests, a caller that measured).
        default_threads: the counts torch starts with here (default: read from the host; see
            `decide_threads`).
        how: ``"process"`` (the warning names ``PIECEWISE_NUM_THREADS``) or ``"library"``.

    Returns:
        The `ThreadDecision` (its `describe()` is logged at INFO on logger ``piecewise.threads``).

    Raises:
        ConfigError: ``PIECEWISE_NUM_THREADS`` is not a positive whole number or ``auto``.
    """
    global _applied, _torch_start
    import torch

    decision = serving_threads(interval, load=load, default_threads=default_threads)
    if decision.source in ("policy", ENV_VAR):
        current = torch.get_num_threads()
        if _applied is None or current != _applied:  # torch's own (or the user's default-looking) count
            _torch_start = current
        if current != decision.threads:
            torch.set_num_threads(decision.threads)
        _applied = decision.threads
    log.info("thread policy: %s", decision.describe())
    if decision.oversubscribed:
        _warn_once(decision.warning(how))
    return decision


def _warn_once(text: str) -> bool:
    """Log `text` as this process's one oversubscription warning; False when one was logged before."""
    global _warned
    with _lock:
        if _warned:
            return False
        _warned = True
    log.warning("%s", text)
    return True


def warn_if_oversubscribed(module: object = None, *, load: HostLoad | None = None, background: bool = True) -> None:
    """What `piecewise.compile` does: once per process, for a model on the CPU (`module`'s first
    parameter or buffer; None counts as CPU), check the host against torch's current thread count
    and log the oversubscription warning (naming the fix) if it is oversubscribed. Changes no
    setting. With `background` the check samples in a daemon thread so the caller does not wait
    for it; `load` replaces the measurement (then it runs at once)."""
    global _checked
    if module is not None and not _on_cpu(module):
        return
    with _lock:
        if _checked or _warned:
            return
        _checked = True

    def check() -> None:
        import torch

        try:
            measured = load if load is not None else host_load()
        except OSError as e:  # a host that cannot be measured is no reason to fail a compile
            log.debug("host load not measured: %s", e)
            return
        threads = torch.get_num_threads()
        if oversubscribed(measured, threads):
            _warn_once(ThreadDecision(threads, "torch", measured, True).warning("library"))

    if background and load is None:
        threading.Thread(target=check, name="piecewise-host-check", daemon=True).start()
    else:
        check()


def _on_cpu(module: object) -> bool:
    for getter in ("parameters", "buffers"):
        fn = getattr(module, getter, None)
        if fn is None:
            continue
        for t in fn():
            return t.device.type == "cpu"
    return True

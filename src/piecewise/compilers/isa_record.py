"""The recorded answer of Inductor's CPU vector-ISA probe, shared by the processes of one cache root.

Inductor decides which SIMD ISA its C++ kernels use by building and loading a test library per
candidate ISA (`torch._inductor.cpu_vec_isa.valid_vec_isa_list`, memoised per process; ~1 s on 2
cores). The answer depends only on the machine, the compiler and Inductor's ISA settings
(`record_key`), so a process that probed writes it under ``<root>/isa/<key>.json`` (`save`) and a
later one installs it as its ``valid_vec_isa_list`` (`use_record`) instead of probing again.
This is the one place piecewise patches Inductor state: the patch is process-wide, applied once,
and returns exactly what the probe returned for the same key.

`start_probe` / `wait_for_probe`: with no usable record, probe in background threads while the
caller imports Inductor's runtime modules, and join before the first artifact load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from typing import Any

import torch

log = logging.getLogger("piecewise")

__all__ = ["PROBE_MODULES", "record_key", "record_path", "use_record", "save", "probe", "start_probe", "wait_for_probe"]

_probe_thread: threading.Thread | None = None


#: what the probe imports (Inductor's code cache and C++ builder pull in ~160 modules): imported by
#: `start_probe` on the calling thread, so the probe thread imports nothing while the caller traces
#: and compiles. Two threads importing torch's modules at once can fail a circular import in one of
#: them (seen: ModuleNotFoundError for torch.utils.flop_counter in a cold start).
PROBE_MODULES = ("torch._inductor.codecache", "torch._inductor.cpp_builder", "torch.utils._filelock",
                 "torch.utils.cpp_extension")


def start_probe(root: str | None) -> None:
    """Install the record under `root`, or start probing in the background (once per process)."""
    global _probe_thread
    if _probe_thread is not None:
        return
    if root and use_record(root):
        return
    import importlib

    for name in PROBE_MODULES:
        importlib.import_module(name)
    _probe_thread = threading.Thread(target=probe, args=(root,), name="piecewise-isa-probe", daemon=True)
    _probe_thread.start()


def wait_for_probe() -> None:
    """Join a background probe (``valid_vec_isa_list`` is memoised but not locked: never evaluate
    it twice at once)."""
    if _probe_thread is not None:
        _probe_thread.join()


def record_key() -> str:
    """What Inductor's ISA probe answer depends on: torch build, OS and CPU architecture, the CPU's
    ISA flags, the C++ compiler binaries Inductor would search (path, size, mtime: a compiler
    upgrade probes again) and Inductor's ISA settings."""
    import os
    import platform
    import shutil
    import sys

    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa

    x86 = platform.machine() in ("x86_64", "AMD64")
    cxx = inductor_config.cpp.cxx
    compilers = []
    for name in cxx if isinstance(cxx, (list, tuple)) else (cxx,):
        path = shutil.which(name) if name else None
        st = os.stat(os.path.realpath(path)) if path else None
        compilers.append([name, os.path.realpath(path) if path else None, st and [st.st_size, st.st_mtime_ns]])
    parts = [torch.__version__, sys.platform, platform.machine(), sorted(cpu_vec_isa.x86_isa_checker()) if x86 else [],
             compilers, os.environ.get("CXX"), inductor_config.cpp.vec_isa_ok, inductor_config.cpp.simdlen]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:20]


def record_path(root: str) -> str:
    import os

    return os.path.join(root, "isa", f"{record_key()}.json")


def use_record(root: str) -> bool:
    """Install a recorded probe answer as this process's ``valid_vec_isa_list()``; False (probe
    instead) when there is none, it does not parse, or it names an ISA this torch does not know or
    whose flags this CPU lacks."""
    from torch._inductor import cpu_vec_isa

    from ..cache.store import check_permissions

    if getattr(cpu_vec_isa.valid_vec_isa_list, "recorded", False) or cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
        return True  # already answered in this process
    path = record_path(root)
    if check_permissions(root, path):  # another user could have written it: probe
        return False
    try:
        with open(path) as f:
            names = json.load(f)["valid_vec_isa"]
        known = {str(isa): isa for isa in cpu_vec_isa.supported_vec_isa_list}
        isas = [known[n] for n in names]
    except Exception as e:
        log.info("the recorded vector-ISA probe %s is unusable (%s: %s); probing again", path, type(e).__name__, e)
        return False
    import platform

    if platform.machine() in ("x86_64", "AMD64"):
        flags = set(cpu_vec_isa.x86_isa_checker())
        if not all(f in flags for isa in isas for f in str(isa).split()):
            return False
    def recorded() -> list[Any]:
        return list(isas)

    recorded.recorded = True  # type: ignore[attr-defined]
    cpu_vec_isa.valid_vec_isa_list = recorded  # pick_vec_isa reads it by module global
    return True


def save(root: str, isas: list[Any]) -> None:
    """Write the probe's answer for `use_record` (the cache's atomic write and 0o755 dirs;
    any failure leaves no record)."""
    import os

    from ..cache.store import atomic_write, make_dirs

    try:
        path = record_path(root)
        make_dirs(os.path.dirname(path))
        atomic_write(path, json.dumps({"valid_vec_isa": [str(i) for i in isas], "torch": torch.__version__}).encode())
    except Exception as e:
        log.info("the vector-ISA probe was not recorded under %s (%s: %s); the next process probes again", root,
                 type(e).__name__, e)


def probe(root: str | None = None) -> None:
    """Evaluate Inductor's ``valid_vec_isa_list()`` with each candidate ISA probed in its own thread:
    a probe is a dlopen in a child process (plus a build on a cold Inductor cache), so on x86 the
    3-4 candidates the CPU's flags allow finish in about the time of one. Same probes, same result;
    only the order of waiting changes."""
    import platform

    from torch._inductor import cpu_vec_isa

    if platform.machine() in ("x86_64", "AMD64"):
        flags = set(cpu_vec_isa.x86_isa_checker())
        candidates = [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
        probes = [threading.Thread(target=bool, args=(isa,), daemon=True) for isa in candidates]
        for t in probes:
            t.start()
        for t in probes:
            t.join()
    isas = cpu_vec_isa.valid_vec_isa_list()  # memoised per process; reads the probes' memoised answers
    if root:
        save(root, isas)

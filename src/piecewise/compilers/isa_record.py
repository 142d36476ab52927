"""Inductor's CPU vector-ISA answer, assumed from the CPU's flags or recorded from a probe.

Inductor decides which SIMD ISA its C++ kernels use with `torch._inductor.cpu_vec_isa`: an ISA is
valid when the CPU reports its flags (``x86_isa_checker``: cpuinfo, after the kernel's own
filtering) *and* its test program builds and dlopens (``VecISA.check_build``: one g++ build of
ATen's vector headers with the ISA's flags, then a child Python that dlopens the result). The
build is the costly part: 2.4 s for the build plus 0.4 s for the child on this repository's 2-core
machine with a cold Inductor cache, 0.4 s with a warm one, in every process, since the answer is
memoised per process and codegen asks the picked ISA again (``if picked_vec_isa:``).

The build can only fail when the compiler does not take the ISA's flags or intrinsics; the CPU's
support is already known. So `assume` evaluates Inductor's own decision (`valid_vec_isa_list` and
each valid ISA's ``bool``, which also settles AVX512-BF16, VNNI, AMX and AMX-FP16 and asks the
kernel for AMX permission) with every ``check_build`` answering True, and leaves those answers in
Inductor's memos. That is what Inductor's probe answers wherever the compiler builds what the CPU
runs, and what Inductor itself assumes in Meta's internal builds (``config.is_fbcode()``). Every
kernel build compiles the same headers with the same flags, so a compiler that cannot is found by
the first compile: `probe_if_assumed` then runs Inductor's real probe, records its answer under
``<root>/isa/<key>.json`` (`save`; `record_key` says what it depends on), and the caller compiles
again when the answer changed. A later process with that record installs it (`use_record`)
instead of assuming.

This is the one place piecewise patches Inductor state: process-wide, applied once, and never
while Inductor is compiling.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from typing import Any

import torch

from .._torch.inductor import ISA_PROBE_MODULES

log = logging.getLogger("piecewise")

__all__ = ["PROBE_MODULES", "assume", "probe_if_assumed", "answer_source", "record_key", "record_path", "use_record",
           "save", "probe"]

#: where this process's answer came from: None (not answered by piecewise), "assumed", "record",
#: "probed" or "inductor" (Inductor answered before piecewise was asked)
_source: str | None = None
#: the ISA instances' attributes before `assume` (restored before a real probe)
_saved_attrs: dict[int, dict[str, Any]] = {}
_lock = threading.Lock()


#: what the probe imports (Inductor's code cache and C++ builder pull in ~160 modules): imported by
#: `probe` on the calling thread before its per-ISA threads start, so they import nothing. Two
#: threads importing torch's modules at once can fail a circular import in one of them (seen:
#: ModuleNotFoundError for torch.utils.flop_counter in a cold start).
PROBE_MODULES = ISA_PROBE_MODULES


def answer_source() -> str | None:
    """Where this process's ISA answer came from (see `_source`); None before `assume`."""
    return _source


def assume(root: str | None) -> None:
    """Answer Inductor's ISA question for this process without building anything (once per
    process; later calls return at once).

    A usable record under `root` that differs from the assumption wins: it was written by a real
    probe after an assumed ISA failed to build. When Inductor already answered in this process
    (a plain ``torch.compile`` ran first), its answer stays."""
    global _source
    with _lock:
        if _source is not None:
            return
        from .._torch.inductor import cpu_vec_isa

        if cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
            _source = "inductor"
            return
        recorded = _read_record(root) if root else None
        _saved_attrs.update({id(isa): dict(vars(isa)) for isa in cpu_vec_isa.supported_vec_isa_list})
        names = _assume_builds()
        if recorded is not None and recorded != names:
            _forget_answers()
            if use_record(root):
                _source = "record"
                log.debug("vector ISAs from the probe recorded under %s: %s", root, recorded)
                return
            names = _assume_builds()  # the record is unusable here (an ISA this torch or CPU lacks)
        _source = "assumed"
        log.debug("vector ISAs assumed from the CPU's flags: %s", names)


def probe_if_assumed(root: str | None) -> bool:
    """After a compile failed: when this process's ISA answer was assumed, replace it with
    Inductor's real probe (recorded under `root`). True when the probe answers differently, so
    compiling again can succeed; False when the answer was not assumed or the probe agrees (the
    failure has another cause). Call it only while no compile is running."""
    global _source
    with _lock:
        if _source != "assumed":
            return False
        from .._torch.inductor import cpu_vec_isa

        before = _answer(cpu_vec_isa)
        _forget_answers()
        _source = "probed"
        probe(root)
        after = _answer(cpu_vec_isa)
        if after != before:
            log.warning("Inductor could not build its kernels with the vector ISA this CPU reports (%s); the "
                        "compiler's probe answers %s, recorded for the next processes", before, after)
        return after != before


def _builds(code: str) -> bool:
    """`VecISA.check_build`'s answer under `assume`: the compiler builds what the CPU runs."""
    return True


def _assume_builds() -> list[str]:
    """Evaluate Inductor's ISA decision with every build check answering True; its memos keep the
    answers. Returns the valid ISAs' names."""
    from .._torch.inductor import cpu_vec_isa

    isas = list(cpu_vec_isa.supported_vec_isa_list)
    for isa in isas:
        isa.check_build = _builds  # an instance attribute shadows VecISA.check_build
    try:
        valid = cpu_vec_isa.valid_vec_isa_list()
        for isa in valid:
            bool(isa)  # memoise it too: codegen asks the picked ISA again (aarch64 lists without asking)
    finally:
        for isa in isas:
            vars(isa).pop("check_build", None)
    return [str(isa) for isa in valid]


def _answer(cpu_vec_isa: Any) -> list[Any]:
    """The valid ISAs with the compiler flags their checks settled (AVX512-BF16, AMX-FP16)."""
    return [f"{isa} ({isa.build_arch_flags()})" for isa in cpu_vec_isa.valid_vec_isa_list()]


def _forget_answers() -> None:
    """Clear Inductor's ISA memos and restore the ISA instances' attributes, so the next question
    is answered afresh."""
    from .._torch.inductor import cpu_vec_isa

    fn = cpu_vec_isa.valid_vec_isa_list
    if getattr(fn, "recorded", False):
        cpu_vec_isa.valid_vec_isa_list = fn = fn.original
    fn.cache_clear()
    for isa in cpu_vec_isa.supported_vec_isa_list:
        if id(isa) in _saved_attrs:
            vars(isa).clear()
            vars(isa).update(_saved_attrs[id(isa)])
        for cls in type(isa).__mro__:
            for value in vars(cls).values():
                if hasattr(value, "cache_clear"):
                    value.cache_clear()


def _read_record(root: str) -> list[str] | None:
    """The ISA names recorded under `root`, or None (no record, unreadable, or not trusted)."""
    from ..cache.store import check_permissions

    path = record_path(root)
    if check_permissions(root, path):
        return None
    try:
        with open(path) as f:
            names = json.load(f)["valid_vec_isa"]
        return [str(n) for n in names]
    except Exception as e:
        if not isinstance(e, FileNotFoundError):
            log.info("the recorded vector-ISA probe %s is unusable (%s: %s)", path, type(e).__name__, e)
        return None


def record_key() -> str:
    """What Inductor's ISA probe answer depends on: torch build, OS and CPU architecture, the CPU's
    ISA flags, the C++ compiler binaries Inductor would search (path, size, mtime: a compiler
    upgrade probes again) and Inductor's ISA settings."""
    import os
    import platform
    import shutil
    import sys

    from .._torch.inductor import config as inductor_config
    from .._torch.inductor import cpu_vec_isa

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
    instead) when there is none, it is not trusted or does not parse, or it names an ISA this torch
    does not know or whose flags this CPU lacks. Inductor still builds the picked ISA's test once
    (codegen asks ``bool(picked)``)."""
    from .._torch.inductor import cpu_vec_isa

    if getattr(cpu_vec_isa.valid_vec_isa_list, "recorded", False) or cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
        return True  # already answered in this process
    names = _read_record(root)
    known = {str(isa): isa for isa in cpu_vec_isa.supported_vec_isa_list}
    if names is None or not all(n in known for n in names):
        return False
    isas = [known[n] for n in names]
    import platform

    if platform.machine() in ("x86_64", "AMD64"):
        flags = set(cpu_vec_isa.x86_isa_checker())
        if not all(f in flags for isa in isas for f in str(isa).split()):
            return False

    def recorded() -> list[Any]:
        return list(isas)

    recorded.recorded = True  # type: ignore[attr-defined]
    recorded.original = cpu_vec_isa.valid_vec_isa_list  # type: ignore[attr-defined]
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
    import importlib
    import platform

    from .._torch.inductor import cpu_vec_isa

    for name in PROBE_MODULES:
        importlib.import_module(name)
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

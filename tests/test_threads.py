"""The CPU thread policy of inference processes (piecewise.threads): one thread per usable core
that other processes leave free, the user's own choice kept, ``PIECEWISE_NUM_THREADS`` first, and
one warning per process on an oversubscribed host, naming the fix. Host figures are given as
parameters (`HostLoad`, affinity, quota), never read from this (shared, busy) machine, except in
the one test of the measurement itself."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from piecewise import ConfigError
from piecewise import threads
from piecewise.threads import ENV_VAR, HostLoad, ThreadDecision, decide_threads, oversubscribed, usable_cores


@pytest.fixture
def fresh(monkeypatch):
    """This process's once-only state as in a new process, the user's thread variables unset, and
    torch's thread count restored afterwards."""
    monkeypatch.setattr(threads, "_warned", False)
    monkeypatch.setattr(threads, "_checked", False)
    monkeypatch.setattr(threads, "_applied", None)
    monkeypatch.setattr(threads, "_torch_start", None)
    for name in (ENV_VAR, "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "piecewise.threads" and r.levelno == logging.WARNING]


@pytest.mark.parametrize("usable,others,torch_threads,expected", [
    (2, 0.0, 2, 2),    # quiet: torch's default
    (2, 0.2, 2, 2),    # a little background work leaves both cores
    (2, 0.3, 2, 1),    # a third of a core taken: that core's thread would wait at every barrier
    (2, 1.0, 2, 1),    # one competing process on a core (issue 48's busy host): one thread
    (2, 8.0, 2, 1),    # far more work than cores: still at least one
    (8, 2.5, 8, 5),
    (16, 0.0, 8, 8),   # never above torch's own default (physical cores)
    (1, 0.0, 1, 1),
])
def test_policy_runs_one_thread_per_core_other_processes_leave_free(usable, others, torch_threads, expected):
    d = decide_threads(HostLoad(usable, others), torch_threads=torch_threads, env={})
    assert (d.threads, d.source) == (expected, "policy")
    assert d.oversubscribed == (others + expected > usable + threads.SLACK)


def test_oversubscribed_when_others_and_our_threads_want_more_than_the_usable_cores():
    assert oversubscribed(HostLoad(2, 1.0), 2)
    assert not oversubscribed(HostLoad(2, 1.0), 1)
    assert not oversubscribed(HostLoad(2, 0.2), 2)
    assert oversubscribed(HostLoad(2, 7.5), 1)  # even one thread shares a core
    assert not decide_threads(HostLoad(2, 1.0), torch_threads=2, env={}).oversubscribed
    assert decide_threads(HostLoad(2, 4.0), torch_threads=2, env={}).oversubscribed


@pytest.mark.parametrize("value,expected", [("3", 3), (" 1 ", 1), ("64", 64)])
def test_piecewise_num_threads_overrides_policy_and_user_variables(value, expected):
    d = decide_threads(HostLoad(2, 1.0), torch_threads=2, env={ENV_VAR: value, "OMP_NUM_THREADS": "2"})
    assert (d.threads, d.source) == (expected, ENV_VAR)
    assert d.oversubscribed == (expected > 1)


@pytest.mark.parametrize("value", ["auto", "AUTO", ""])
def test_piecewise_num_threads_auto_is_the_policy(value):
    d = decide_threads(HostLoad(2, 1.0), torch_threads=2, env={ENV_VAR: value})
    assert (d.threads, d.source) == (1, "policy")


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_bad_piecewise_num_threads_is_a_config_error_naming_value_and_remedy(value):
    with pytest.raises(ConfigError) as e:
        decide_threads(HostLoad(2, 0.0), torch_threads=2, env={ENV_VAR: value})
    assert repr(value) in str(e.value) and f"{ENV_VAR}=1" in str(e.value) and "auto" in str(e.value)


@pytest.mark.parametrize("name", ["OMP_NUM_THREADS", "MKL_NUM_THREADS"])
def test_a_count_set_by_the_users_environment_is_kept(name):
    d = decide_threads(HostLoad(2, 1.0), torch_threads=2, env={name: "2"})
    assert (d.threads, d.source, d.oversubscribed) == (2, name, True)


def test_the_count_the_policy_set_is_its_own_to_change_up_to_torchs_default():
    d = decide_threads(HostLoad(4, 0.0), torch_threads=1, default_threads={4}, applied=1, torch_default=4, env={})
    assert (d.threads, d.source) == (4, "policy")
    d = decide_threads(HostLoad(4, 0.0), torch_threads=1, default_threads={4}, env={})  # the user's 1
    assert (d.threads, d.source) == (1, "torch.set_num_threads")


def test_a_count_set_by_torch_set_num_threads_is_kept():
    # 3 is no count torch starts with on a host of 2 logical / 2 physical cores: the user set it
    d = decide_threads(HostLoad(2, 1.0), torch_threads=3, default_threads={2}, env={})
    assert (d.threads, d.source) == (3, "torch.set_num_threads")
    # torch's own default on that host is the policy's to change
    d = decide_threads(HostLoad(2, 1.0), torch_threads=2, default_threads={2}, env={})
    assert (d.threads, d.source) == (1, "policy")


@pytest.mark.parametrize("affinity,quota,expected", [
    ({0, 1, 2, 3}, None, 4),
    ({0, 1, 2, 3}, 2.5, 3),   # a cgroup quota of 2.5 CPUs: 3 cores run at once
    ({2}, 8.0, 1),            # taskset -c 2
    ({0, 1}, 0.5, 1),
    (set(), None, 1),
])
def test_usable_cores_are_the_affinity_capped_by_the_cgroup_quota(affinity, quota, expected):
    assert usable_cores(affinity, quota) == expected


def test_apply_sets_the_policy_count_and_warns_once_on_an_oversubscribed_host(fresh, caplog):
    caplog.set_level(logging.INFO, logger="piecewise.threads")
    torch.set_num_threads(2)
    d = threads.apply_serving_threads(load=HostLoad(2, 1.0), default_threads={2})
    assert (d.threads, d.source, d.oversubscribed) == (1, "policy", False)
    assert torch.get_num_threads() == 1 and not _warnings(caplog)
    assert "thread policy: 1 intra-op thread (policy: 2 usable cores, 1.0 busy with other processes)" in caplog.text
    # applied again (the count it set is not taken for the user's): re-decided on the new load
    d = threads.apply_serving_threads(load=HostLoad(2, 0.0), default_threads={2})
    assert (d.threads, d.source) == (2, "policy") and torch.get_num_threads() == 2
    # load beyond every core: one thread, and one warning however often it is applied
    for _ in range(3):
        d = threads.apply_serving_threads(load=HostLoad(2, 6.0), default_threads={2})
        assert (d.threads, d.oversubscribed) == (1, True) and torch.get_num_threads() == 1
    [warning] = _warnings(caplog)
    assert "6.0 of the 2 cores" in warning and "taskset -c" in warning and "fewer processes" in warning


def test_apply_leaves_the_users_count_alone_and_its_warning_names_the_variable(fresh, caplog, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    for _ in range(2):
        d = threads.apply_serving_threads(load=HostLoad(2, 1.0), default_threads={2})
        assert (d.threads, d.source, d.oversubscribed) == (2, "OMP_NUM_THREADS", True)
        assert torch.get_num_threads() == 2
    [warning] = _warnings(caplog)
    assert "torch runs 2 intra-op threads" in warning and "PIECEWISE_NUM_THREADS=1" in warning
    assert "taskset -c" in warning


def test_apply_honours_piecewise_num_threads(fresh, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    torch.set_num_threads(2)
    d = threads.apply_serving_threads(load=HostLoad(4, 0.0), default_threads={2})
    assert (d.threads, d.source) == (1, ENV_VAR) and torch.get_num_threads() == 1
    monkeypatch.setenv(ENV_VAR, "many")
    with pytest.raises(ConfigError, match="PIECEWISE_NUM_THREADS='many'"):
        threads.apply_serving_threads(load=HostLoad(4, 0.0), default_threads={2})
    assert torch.get_num_threads() == 1


def test_library_check_warns_once_names_torch_set_num_threads_and_changes_nothing(fresh, caplog):
    torch.set_num_threads(2)
    cpu_model = torch.nn.Linear(2, 2)
    threads.warn_if_oversubscribed(torch.nn.Linear(2, 2, device="meta"), load=HostLoad(2, 1.0))
    assert not _warnings(caplog)  # not a CPU model: nothing checked
    threads.warn_if_oversubscribed(cpu_model, load=HostLoad(2, 1.0))
    threads.warn_if_oversubscribed(cpu_model, load=HostLoad(2, 1.0))
    [warning] = _warnings(caplog)
    assert "torch.set_num_threads(1)" in warning and "OMP_NUM_THREADS=1" in warning and "taskset -c" in warning
    assert torch.get_num_threads() == 2


def test_library_check_is_quiet_on_a_host_with_room(fresh, caplog):
    torch.set_num_threads(2)
    threads.warn_if_oversubscribed(torch.nn.Linear(2, 2), load=HostLoad(2, 0.1))
    assert not _warnings(caplog)


def test_warning_text_by_situation():
    too_many = ThreadDecision(2, "torch", HostLoad(4, 3.0, "load"), True)
    assert "use 1 thread: PIECEWISE_NUM_THREADS=1" in too_many.warning("process")
    assert "torch.set_num_threads(1)" in too_many.warning("library")
    beyond = ThreadDecision(1, "policy", HostLoad(2, 5.0, "load"), True)
    assert "PIECEWISE_NUM_THREADS" not in beyond.warning() and "fewer processes" in beyond.warning()


def test_host_load_measures_this_process_cores():
    load = threads.host_load(0.05)
    assert load.usable_cores == usable_cores() == len(os.sched_getaffinity(0)) or load.usable_cores < len(os.sched_getaffinity(0))
    assert load.others_busy >= 0.0 and load.source.startswith("per-CPU sample over")
    assert threads.host_load(0).source == "1-minute load average"


# -- the generation benchmark's competing process (piecewise.bench.generation.competitor) --------------

def _gone(pid: int, within: float) -> bool:
    import psutil

    try:
        psutil.Process(pid).wait(timeout=within)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


def test_the_competing_process_spins_pinned_to_its_cpu_and_stops_by_itself():
    import psutil

    from piecewise.bench.generation import competitor

    cpu = max(os.sched_getaffinity(0))
    p = competitor(cpu, 600)
    try:
        for _ in range(600):  # it pins itself once its interpreter is up
            if psutil.Process(p.pid).cpu_affinity() == [cpu]:
                break
            time.sleep(0.05)
        assert psutil.Process(p.pid).cpu_affinity() == [cpu] and p.poll() is None
    finally:
        p.kill()
        p.wait()
    p = competitor(cpu, 0.3)
    assert p.wait(timeout=120) == 0  # its time is up: it ends on its own


def test_the_competing_process_ends_with_the_process_that_started_it():
    import subprocess
    import sys

    probe = ("import os\nfrom piecewise.bench.generation import competitor\n"
             f"print(competitor({max(os.sched_getaffinity(0))}, 600).pid, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    pid = int(out.stdout.split()[0])
    assert _gone(pid, 60), f"the competing process {pid} outlived its parent"


def test_the_busy_host_table_gives_each_systems_busy_over_quiet_and_over_eager():
    from piecewise.bench.generation import busy_thread_counts, to_markdown

    row = {"system": "busy", "batch": 1, "rounds": 2, "threads": 1, "threads_from": "policy, one core busy", "phase": "busy",
           "round": 0, "step_s": {"quiet": {"hf_eager": [0.040, 0.050], "pw_engine": [0.020, 0.025]},
                                  "busy": {"hf_eager": [0.080, 0.050], "pw_engine": [0.030, 0.050]}},
           "busy_vs_quiet": {"hf_eager": [2.0, 1.0], "pw_engine": [1.5, 2.0]},
           "vs_eager": {"quiet": {"pw_engine": [0.5, 0.5]}, "busy": {"pw_engine": [0.375, 1.0]}}}
    failed = {"system": "busy", "batch": 8, "phase": "busy", "threads_from": "torch default", "error": ["timed out"]}
    md = to_markdown([row, failed])
    assert "| 1 | 1 (policy, one core busy) | hf_eager | 45.0 (40.0–50.0) | 65.0 (50.0–80.0) | 1.50 (1.00–2.00) | 1 | 1 | 2.00, 1.00 |" in md
    assert "| 1 | 1 (policy, one core busy) | pw_engine | 22.5 (20.0–25.0) | 40.0 (30.0–50.0) | 1.75 (1.50–2.00) | 0.50 (0.50–0.50) | 0.69 (0.38–1.00) | 1.50, 2.00 |" in md
    assert "| 8 | torch default | busy | failed: timed out" in md
    counts = dict(busy_thread_counts())
    assert counts["torch default"] == usable_cores()
    assert counts.get("policy, one core busy", 1) == max(1, usable_cores() - 1)


# -- where the policy applies: `piecewise generate` --------------------------------------------------

def test_piecewise_generate_runs_at_the_policys_count(fresh, monkeypatch, capsys):
    from piecewise.cli import main
    from piecewise.hf import chat

    seen = []
    monkeypatch.setattr(chat, "answer", lambda prompt, **kw: seen.append(torch.get_num_threads())
                        or chat.ChatResult("hf", "ok", [1], 0, 0, 0))
    torch.set_num_threads(2)
    monkeypatch.setenv(ENV_VAR, "1")
    assert main(["generate", "--backend", "eager", "hi"]) == 0
    assert seen == [1]
    monkeypatch.setenv(ENV_VAR, "3")
    assert main(["generate", "--backend", "eager", "hi"]) == 0
    assert seen == [1, 3]


def test_piecewise_generate_refuses_a_bad_thread_count_in_one_line(fresh, monkeypatch, capsys):
    from piecewise.cli import main
    from piecewise.hf import chat

    monkeypatch.setattr(chat, "answer", lambda prompt, **kw: pytest.fail("generated despite a bad PIECEWISE_NUM_THREADS"))
    monkeypatch.setenv(ENV_VAR, "lots")
    assert main(["generate", "--backend", "eager", "hi"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "PIECEWISE_NUM_THREADS='lots'" in err and "Traceback" not in err

"""Engine CPU threads: an engine's share, plus the CPUs idle when a big step starts."""

from __future__ import annotations

import torch

from server.engine import cpu_threads
from server.engine.cpu_threads import (
    MIN_TOKENS,
    BorrowIdleCores,
    FixedThreads,
    cpu_threads_policy,
    runnable_tasks,
)


def _policy(share: int, cpus: int, runnable: list[int | None]) -> tuple[BorrowIdleCores, list[int]]:
    calls: list[int] = []
    readings = iter(runnable)
    return BorrowIdleCores(share, cpus, lambda: next(readings), set_threads=calls.append), calls


def test_a_big_step_takes_the_idle_cpus_and_a_busy_machine_leaves_the_share():
    policy, calls = _policy(share=1, cpus=4, runnable=[1, 2, 4, 9, None])
    assert [policy.threads_for(256) for _ in range(5)] == [4, 3, 1, 1, 1]
    policy, calls = _policy(share=2, cpus=4, runnable=[1, 3, 4])
    assert [policy.threads_for(256) for _ in range(3)] == [4, 2, 2]  # never below the share


def test_decode_sized_steps_keep_the_share_without_reading_the_load():
    policy, calls = _policy(share=1, cpus=2, runnable=[])  # a read would raise StopIteration
    assert policy.threads_for(MIN_TOKENS - 1) == 1
    policy.before_step(8)
    assert calls == []


def test_torch_is_told_only_when_the_count_changes():
    policy, calls = _policy(share=1, cpus=2, runnable=[1, 1, 2, 2, 1])
    for _ in range(5):
        policy.before_step(256)
    assert calls == [2, 1, 2]
    policy.before_step(1)
    assert calls == [2, 1, 2, 1] and policy.current == 1


def test_runnable_tasks_reads_the_fourth_field_of_loadavg(tmp_path):
    path = tmp_path / "loadavg"
    path.write_text("0.49 0.26 0.09 3/80 2036\n")
    assert runnable_tasks(str(path)) == 3
    path.write_text("garbage\n")
    assert runnable_tasks(str(path)) is None
    assert runnable_tasks(str(tmp_path / "missing")) is None


def test_the_null_policy_where_nothing_can_be_borrowed(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert isinstance(cpu_threads_policy(torch.device("cuda"), True), FixedThreads)
    assert isinstance(cpu_threads_policy(torch.device("cpu"), False), FixedThreads)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert isinstance(cpu_threads_policy(torch.device("cpu"), True), FixedThreads)  # the share is every CPU
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    policy = cpu_threads_policy(torch.device("cpu"), True)
    assert isinstance(policy, BorrowIdleCores) and (policy.share, policy.cpus) == (1, 2)
    monkeypatch.setattr(cpu_threads, "runnable_tasks", lambda: None)  # no /proc/loadavg here
    assert isinstance(cpu_threads_policy(torch.device("cpu"), True), FixedThreads)

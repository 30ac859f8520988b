"""StepExecutor: a ``concurrent.futures`` executor that runs tasks when a test says so.

Stands in for the worker's I/O and copy thread pools in the scheduler harness: every
task is held for a number of harness steps chosen by the test (``delay_of``), then run
on the caller's thread by ``run_due(step)``, in submission order. A task that takes
a Future argument (a disk fill waiting on its read) runs only once that Future is done.
So a seeded run is fully deterministic, and "a read slower than the load timeout" is a
task held for more steps than the timeout spans.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kv_offload.worker.host_copies import HostCopy


@dataclass(slots=True)
class _Task:
    future: Future
    fn: Callable[..., Any]
    args: tuple
    due: int  # the first step at which it may run


class _RunsWhenWaitedFor(Future):
    """A task's future whose blocking wait runs the task: the waiter gets what a thread
    finishing it would have given (the worker's fence of a background copy)."""

    def __init__(self, executor: StepExecutor) -> None:
        super().__init__()
        self._executor = executor

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            self._executor.run_now([self])
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            self._executor.run_now([self])
        return super().exception(timeout)


class StepExecutor:
    """Executor whose tasks run in ``run_due``; not thread-safe (one test thread).
    ``run_when_waited_for``: a blocking wait on a task's future runs it at once."""

    def __init__(self, delay_of: Callable[[Callable, tuple], int] = lambda fn, args: 0,
                 *, run_when_waited_for: bool = False) -> None:
        self._delay_of = delay_of
        self._run_when_waited_for = run_when_waited_for
        self._tasks: list[_Task] = []
        self._step = 0
        self._shut = False

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future:
        """Queue ``fn(*args)`` for ``delay_of(fn, args)`` steps; RuntimeError after shutdown
        (as ThreadPoolExecutor)."""
        if self._shut:
            raise RuntimeError("cannot schedule new futures after shutdown")
        future = _RunsWhenWaitedFor(self) if self._run_when_waited_for else Future()
        self._tasks.append(_Task(future, fn, args, self._step + self._delay_of(fn, args)))
        return future

    def run_due(self, step: int) -> int:
        """Run every task due by ``step`` (also those that running tasks queue), in
        submission order; returns how many ran. Exceptions land in their futures."""
        self._step = step
        ran = 0
        while True:
            task = next((t for t in self._tasks if t.due <= step and _ready(t.args)), None)
            if task is None:
                return ran
            self._tasks.remove(task)
            ran += 1
            if not task.future.set_running_or_notify_cancel():
                continue
            try:
                result = task.fn(*task.args)
            except BaseException as exc:  # noqa: BLE001 - a task's error belongs to its future
                task.future.set_exception(exc)
            else:
                task.future.set_result(result)

    def run_now(self, futures: list[Future]) -> None:
        """Run the tasks of ``futures`` at once, due or not (what a thread blocking on
        them would wait for), in submission order; tasks not of this executor are
        ignored."""
        wanted = set(map(id, futures))
        for task in [t for t in self._tasks if id(t.future) in wanted]:
            self._tasks.remove(task)
            if task.future.set_running_or_notify_cancel():
                try:
                    task.future.set_result(task.fn(*task.args))
                except BaseException as exc:  # noqa: BLE001 - its future carries it
                    task.future.set_exception(exc)

    def num_pending(self) -> int:
        return len(self._tasks)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._shut = True
        if cancel_futures:
            for task in self._tasks:
                task.future.cancel()
            self._tasks.clear()


def _ready(args: tuple) -> bool:
    """A task waits for the futures and host copies among its arguments."""
    return all(a.done() for a in args if isinstance(a, (Future, HostCopy)))

"""`in_fresh_process`: the warm start's way to run in a process of its own, whose memory is handed back
when it ends (not kept by the driver for the whole RL run)."""

from __future__ import annotations

import os
import signal

import pytest

from reflow.recipes.warmstart import in_fresh_process


def _report_pid(n: int, log) -> dict:
    for i in range(n):
        log(f"line {i}")
    return {"pid": os.getpid(), "parent": os.getppid()}


def _fail(log) -> None:
    log("about to fail")
    raise ValueError("warmstart.demos: no demonstrations")


class _Unpicklable(Exception):
    def __init__(self, handle) -> None:
        super().__init__("holds a lock")
        self.handle = handle


def _fail_unpicklably(log) -> None:
    import threading

    raise _Unpicklable(threading.Lock())


def _die(log) -> None:
    log("dying")
    os.kill(os.getpid(), signal.SIGKILL)


def test_runs_in_another_process_that_is_gone_when_it_returns_and_relays_its_log_in_order():
    lines: list[str] = []
    result = in_fresh_process(_report_pid, lines.append, n=3)
    assert result["pid"] != os.getpid() and result["parent"] == os.getpid()
    assert lines == ["line 0", "line 1", "line 2"]
    with pytest.raises(ProcessLookupError):  # exited and reaped: nothing of it holds memory
        os.kill(result["pid"], 0)


def test_its_exception_comes_back_with_its_type_and_text():
    lines: list[str] = []
    with pytest.raises(ValueError, match=r"warmstart\.demos: no demonstrations"):
        in_fresh_process(_fail, lines.append)
    assert lines == ["about to fail"]
    with pytest.raises(RuntimeError, match="_Unpicklable: holds a lock"):
        in_fresh_process(_fail_unpicklably, lines.append)


def test_a_child_that_dies_without_answering_is_an_error_naming_its_exit_code():
    lines: list[str] = []
    with pytest.raises(RuntimeError, match=r"_die's process ended without a result \(exit code -9\)"):
        in_fresh_process(_die, lines.append)
    assert lines == ["dying"]


class _TwoArgs(Exception):
    """Pickles (its args hold the message) but does not unpickle: __init__ wants two arguments."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key}: {why}")


def _fail_with_two_args(log) -> None:
    raise _TwoArgs("warmstart.lr", "must be > 0")


def test_an_exception_that_would_not_unpickle_here_comes_back_as_its_type_and_text():
    with pytest.raises(RuntimeError, match=r"_TwoArgs: warmstart\.lr: must be > 0"):
        in_fresh_process(_fail_with_two_args, lambda _: None)

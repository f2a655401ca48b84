"""The sandbox benchmark: tool-call latency through the tool server against a plain `docker exec`, and
warm-pool acquires against cold starts, measured in the same run at 1 and 16 concurrent episodes.

Each concurrent episode is a thread with its own sandbox, calling in a loop. The same command goes both
ways: `run_shell("echo hi")` through the server against `docker exec <c> sh -c "echo hi"`, and
`run_python("print(1)")` against `docker exec <c> python3 -c "print(1)"`. Acquire: a pool warmed to the
concurrency hands out sandboxes to episodes that release them straight away (a reset follows in the
background); cold: a sandbox started from nothing (create, attach, start, tool-server hello, i.e. what a
`docker run` of the sandbox costs), and a bare `docker run --rm <image> true` for reference.

Run: `reflow sandbox bench` or `python benchmarks/bench_sandbox.py` (Docker and the image needed).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from reflow.sandbox.base import SandboxLimits, ToolSandbox
from reflow.sandbox.docker_sandbox import DockerSandbox, shared_client
from reflow.sandbox.images import DEFAULT_IMAGE
from reflow.sandbox.pool import SandboxPool


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _summary(seconds: list[float], wall_s: float | None = None) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    out = {"n": len(ms), "p50_ms": _pct(ms, 0.5), "p99_ms": _pct(ms, 0.99), "mean_ms": statistics.fmean(ms)}
    if wall_s:
        out["per_s"] = len(ms) / wall_s
    return out


def _fan_out(workers: int, total: int, fn: Callable[[int], float], pace_s: float = 0.0) -> dict[str, float]:
    """`total` timed calls spread over `workers` threads (fn(worker) returns one latency), back to back
    or, with `pace_s`, one per worker every `pace_s` seconds (an agent thinking between its calls)."""
    per_worker = [total // workers + (1 if w < total % workers else 0) for w in range(workers)]
    out: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(workers)

    def run(worker: int) -> None:
        barrier.wait()
        time.sleep(pace_s * worker / workers)  # paced workers start staggered
        mine = []
        for _ in range(per_worker[worker]):
            start = time.perf_counter()
            mine.append(fn(worker))
            time.sleep(max(0.0, pace_s - (time.perf_counter() - start)))
        with lock:
            out.extend(mine)

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(run, range(workers)))
    return _summary(out, time.perf_counter() - start)


def _timed(call: Callable[[], Any], check: Callable[[Any], bool]) -> float:
    start = time.perf_counter()
    result = call()
    elapsed = time.perf_counter() - start
    if not check(result):
        raise RuntimeError(f"benchmark call failed: {result}")
    return elapsed


def bench_calls(sandboxes: list[ToolSandbox], calls: int, baseline_calls: int) -> dict[str, Any]:
    n = len(sandboxes)
    ok = lambda out: out.ok and out.exit_code == 0  # noqa: E731
    shell = {"command": "echo hi"}
    python = {"code": "print(1)"}
    for sb in sandboxes:  # warm up both paths once
        sb.run_tool_sync("run_shell", shell)
        sb.exec_sync(["sh", "-c", "echo hi"])

    def server(args: dict[str, str], tool: str) -> Callable[[int], float]:
        return lambda w: _timed(lambda: sandboxes[w].run_tool_sync(tool, args), ok)

    def docker_exec(argv: list[str]) -> Callable[[int], float]:
        return lambda w: _timed(lambda: sandboxes[w].exec_sync(argv), ok)

    figures = {
        "server_shell": _fan_out(n, calls, server(shell, "run_shell")),
        "exec_shell": _fan_out(n, baseline_calls, docker_exec(["sh", "-c", "echo hi"])),
        "server_python": _fan_out(n, calls, server(python, "run_python")),
        "exec_python": _fan_out(n, baseline_calls, docker_exec(["python3", "-c", "print(1)"])),
    }
    if n > 1:  # every episode calls once per 100 ms: concurrency without saturating the host
        figures["server_python_paced"] = _fan_out(n, calls, server(python, "run_python"), pace_s=0.1)
        figures["exec_python_paced"] = _fan_out(
            n, baseline_calls, docker_exec(["python3", "-c", "print(1)"]), 0.1
        )
    return figures


def bench_acquire(concurrency: int, acquires: int, limits: SandboxLimits) -> dict[str, Any]:
    pool = SandboxPool(
        lambda: DockerSandbox.create(DEFAULT_IMAGE, limits, pool="bench"),
        size=concurrency,
        max_live=concurrency * 2,
        create_rate=16.0,
        create_burst=concurrency,
        name="bench",
    )
    try:
        pool.wait_ready(concurrency, timeout_s=180)
        warm: list[float] = []

        def episode(worker: int) -> float:
            start = time.perf_counter()
            sb = pool.acquire()
            elapsed = time.perf_counter() - start
            sb.run_tool_sync("run_shell", {"command": "true"})
            pool.release(sb)
            pool.wait_ready(concurrency, timeout_s=60)  # the next acquire finds the pool warm again
            return elapsed

        warm = _fan_out(concurrency, acquires, episode)
        stats = pool.stats
        result = {
            "warm": warm,
            "warm_hits": stats.warm_acquires,
            "cold_misses": stats.cold_acquires,
        }
    finally:
        pool.close()
    client = shared_client()

    def cold_start(worker: int) -> float:
        start = time.perf_counter()
        sb = DockerSandbox.create(DEFAULT_IMAGE, limits, pool="bench")
        elapsed = time.perf_counter() - start
        sb.close_sync()
        return elapsed

    def docker_run(worker: int) -> float:
        start = time.perf_counter()
        client.containers.run(DEFAULT_IMAGE, ["true"], remove=True, network_mode="none")
        return time.perf_counter() - start

    cold_n = max(concurrency, min(acquires, 2 * concurrency))
    result["cold_sandbox"] = _fan_out(concurrency, cold_n, cold_start)
    result["docker_run"] = _fan_out(concurrency, cold_n, docker_run)
    return result


def run_benchmark(
    concurrency: list[int], *, calls: int = 200, acquires: int = 64, print_fn: Callable[..., Any] = print
) -> dict[str, Any]:
    from reflow.sandbox.reaper import reap

    limits = SandboxLimits()
    report: dict[str, Any] = {}
    for c in concurrency:
        sandboxes = list(
            ThreadPoolExecutor(min(c, 8)).map(
                lambda _: DockerSandbox.create(DEFAULT_IMAGE, limits, pool="bench"), range(c)
            )
        )
        try:
            figures = bench_calls(sandboxes, max(calls, c), max(2 * c, calls // 4))
        finally:
            for sb in sandboxes:
                sb.close_sync()
        figures.update(bench_acquire(c, max(acquires, c), limits))
        report[str(c)] = figures
        _print(c, figures, print_fn)
    reap(mine=True)
    return report


def _print(c: int, f: dict[str, Any], print_fn: Callable[..., Any]) -> None:
    def row(label: str, s: dict[str, float]) -> str:
        rate = f"   {s['per_s']:7.1f}/s" if "per_s" in s else ""
        return f"  {label:<48} p50 {s['p50_ms']:8.2f} ms   p99 {s['p99_ms']:8.2f} ms{rate}   (n={s['n']})"

    print_fn(f"{c} concurrent episode(s), back-to-back calls:")
    print_fn(row("tool call via tool server: run_shell echo", f["server_shell"]))
    print_fn(row("plain docker exec: sh -c echo", f["exec_shell"]))
    print_fn(row("tool call via tool server: run_python print", f["server_python"]))
    print_fn(row("plain docker exec: python3 -c print", f["exec_python"]))
    for kind in ("shell", "python"):
        speedup = f[f"exec_{kind}"]["p50_ms"] / max(f[f"server_{kind}"]["p50_ms"], 1e-9)
        print_fn(f"  tool server vs docker exec ({kind}, p50): {speedup:.1f}x faster")
    if "server_python_paced" in f:
        print_fn(f"{c} concurrent episode(s), each calling once per 100 ms:")
        print_fn(row("tool call via tool server: run_python print", f["server_python_paced"]))
        print_fn(row("plain docker exec: python3 -c print", f["exec_python_paced"]))
    print_fn(row("warm pool acquire", f["warm"]) + f"  [{f['warm_hits']} warm, {f['cold_misses']} cold]")
    print_fn(row("cold sandbox start (docker run + tool server)", f["cold_sandbox"]))
    print_fn(row("bare docker run --rm true", f["docker_run"]))

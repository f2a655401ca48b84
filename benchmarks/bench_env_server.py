"""Env server load benchmark: steps/s and step latency of reflow/Calc-v0 sessions through `RemoteEnv`.

The server (`reflow serve-envs`, token auth) runs in its own process on loopback; this process plays
N concurrent sessions, each a loop of whole episodes (create, scripted steps) through the real client,
spread over `--clients` processes as rollout workers would be (one Python client process saturates a
core before the server does).
Two runs per N: closed loop (every session steps again as soon as it has its answer: the throughput
ceiling, where latency is mostly queueing, N / throughput) and paced (each session sends its steps
on a jittered schedule, as a policy generating its turns would, so that all N together offer `--rate`
steps/s: the step latency at that load). It checks that no session is lost (every episode ends "ok", none is
left live on the server) and prints the server's RSS at start, after each run, and after the first
load is played again.

Usage: python benchmarks/bench_env_server.py [--sessions 64,256] [--seconds 8] [--rate 500] [--clients 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import numpy as np

import reflow
from reflow.env import parse_assistant, scripted_policy

ENV_ID = "reflow/Calc-v0"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_server(max_sessions: int) -> tuple[subprocess.Popen, str, str]:
    token = os.urandom(16).hex()
    token_file = Path(tempfile.mkdtemp()) / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    cmd = [sys.executable, "-m", "reflow.server.cli", "--port", "0", "--token-file", str(token_file)]
    cmd += ["--max-sessions", str(max_sessions), "--log-level", "warning", "--env", ENV_ID]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "listening on" not in line:
        raise SystemExit(f"the server did not start: {line!r}")
    url = line.split("listening on ", 1)[1].split()[0]
    for _ in range(300):
        try:
            if httpx.get(url + "/healthz").status_code == 200:
                return proc, url, token
        except httpx.HTTPError:
            time.sleep(0.05)
    raise SystemExit("the server did not become healthy")


async def worker(url: str, token: str, stop_at: float, interval_s: float, seed: int, out: dict) -> None:
    """Whole episodes until `stop_at`; records each step's latency and each episode's status.

    With `interval_s`, steps start on a schedule that averages one per interval (jittered), whatever
    the latency, as a policy would send them; without, each step follows the last answer at once.
    """
    env = reflow.make("reflow/Remote-v0", url=url, env_id=ENV_ID, token=token)
    next_at = time.perf_counter() + random.uniform(0, interval_s)
    try:
        while time.perf_counter() < stop_at:
            seed += 1000
            obs = await env.reset(seed=seed)
            out["sessions"] += 1
            policy, history = scripted_policy(env, 0.0, seed), list(obs.messages)
            while True:
                if interval_s:
                    await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                    next_at += interval_s * random.uniform(0.5, 1.5)
                turn = parse_assistant(policy(history, obs.tools), tools=env.unwrapped.tools)
                t0 = time.perf_counter()
                step = await env.step(turn)
                out["latency"].append(time.perf_counter() - t0)
                history += [turn.to_message(), *step.messages]
                if step.done:
                    out["statuses"][step.info.get("status", "?")] = (
                        out["statuses"].get(step.info.get("status"), 0) + 1
                    )
                    break
    finally:
        await env.close()


async def play(url: str, token: str, sessions: int, seed0: int, seconds: float, interval_s: float) -> dict:
    out: dict = {"latency": [], "statuses": {}, "sessions": 0}
    start = time.perf_counter()
    stop_at = start + seconds
    await asyncio.gather(*(worker(url, token, stop_at, interval_s, seed0 + i, out) for i in range(sessions)))
    out["wall"] = time.perf_counter() - start
    return out


def client_process(
    url: str, token: str, sessions: int, seed0: int, seconds: float, interval_s: float, start_at: float
) -> dict:
    """One load-generating process: waits for the common start, then plays its share of the sessions."""
    time.sleep(max(0.0, start_at - time.time()))
    coro = play(url, token, sessions, seed0, seconds, interval_s)
    try:
        import uvloop  # the load generator's own loop: uvloop when installed (the server extra has it)
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def measure(
    pool: ProcessPoolExecutor,
    clients: int,
    url: str,
    token: str,
    sessions: int,
    seconds: float,
    interval_s: float,
) -> dict:
    """`sessions` spread over `clients` processes (one Python client saturates a core first)."""
    start_at = time.time() + 1.0
    shares = [sessions // clients + (i < sessions % clients) for i in range(clients)]
    futures = [
        pool.submit(client_process, url, token, n, 10_000 * i, seconds, interval_s, start_at)
        for i, n in enumerate(shares)
    ]
    outs = [f.result() for f in futures]
    lat = np.array([x for o in outs for x in o["latency"]]) * 1000
    statuses: dict[str, int] = {}
    for o in outs:
        for k, v in o["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
    return {
        "sessions": sessions,
        "offered_steps_per_s": sessions / interval_s if interval_s else None,
        "steps": len(lat),
        "steps_per_s": len(lat) / max(o["wall"] for o in outs),
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "episodes": sum(o["sessions"] for o in outs),
        "statuses": statuses,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", default="64,256", help="comma-separated concurrent session counts")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each run")
    parser.add_argument("--rate", type=float, default=500.0, help="steps/s all sessions offer in paced runs")
    parser.add_argument("--clients", type=int, default=2, help="load-generating processes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    counts = [int(n) for n in args.sessions.split(",")]
    proc, url, token = start_server(max(counts) + 16)
    results, rss = [], {"start": rss_mb(proc.pid)}
    pool = ProcessPoolExecutor(args.clients, mp_context=multiprocessing.get_context("spawn"))
    try:
        for n in counts:
            for interval_s in (0.0, n / args.rate):
                r = measure(pool, args.clients, url, token, n, args.seconds, interval_s)
                cap = httpx.get(url + "/v1/capacity", headers={"Authorization": f"Bearer {token}"}).json()
                r["left_on_server"] = cap["live_sessions"]
                r["rss_after_mb"] = rss_mb(proc.pid)
                results.append(r)
                load = f"paced at {args.rate:g}/s" if interval_s else "closed loop"
                print(
                    f"{n:4d} sessions, {load:>16}: {r['steps_per_s']:5.0f} steps/s, "
                    f"p50 {r['p50_ms']:6.1f} ms, p99 {r['p99_ms']:6.1f} ms, {r['episodes']} episodes "
                    f"{r['statuses']}, left on server {r['left_on_server']}, server RSS {r['rss_after_mb']:.0f} MB",
                    flush=True,
                )
        # the same load again: memory must stay where it was
        again = measure(pool, args.clients, url, token, counts[0], args.seconds, 0.0)
        rss["after_repeat"] = rss_mb(proc.pid)
        results.append({**again, "repeat": True})
    finally:
        pool.shutdown()
        proc.terminate()
        proc.wait(30)
    lost = sum(r["episodes"] - sum(r["statuses"].values()) for r in results)
    not_ok = sum(v for r in results for k, v in r["statuses"].items() if k != "ok")
    print(
        f"server RSS: start {rss['start']:.0f} MB, after the runs {results[-2]['rss_after_mb']:.0f} MB, "
        f"after repeating the first load {rss['after_repeat']:.0f} MB; episodes lost {lost}, not ok {not_ok}"
    )
    if args.json:
        print(json.dumps({"runs": results, "rss_mb": rss}))
    return 1 if lost or not_ok or any(r.get("left_on_server") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

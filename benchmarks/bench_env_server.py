"""Env server load benchmark: steps/s and step latency of reflow/Calc-v0 sessions.

The server (`reflow serve-envs`, token auth) runs in its own process on loopback. N concurrent
sessions each play whole episodes (create, scripted steps) in a loop, spread over `--clients` load
processes. Clients: `remote` is the real one (`RemoteEnv`, over its `/v1/ws` WebSocket, one socket a
session), the end-to-end figure; `remote-http` is `RemoteEnv(transport="http")` (httpx); `raw` sends
the same requests over plain keep-alive HTTP/1.1, so that the load generator costs little and the
figure is the HTTP server's.
Two runs per N: closed loop (every session steps again as soon as it has its answer: the throughput
ceiling, where latency is mostly queueing, N / throughput) and paced (each session sends its steps on
a jittered schedule, as a policy generating its turns would, so that all N together offer `--rate`
steps/s: the step latency at that load). It checks that no session is lost (every episode ends "ok",
no worker fails, none is left live on the server), samples the server's live sessions (the peak it
held) and prints the server's RSS at start, after each run, and after the first load is played again.

A third client, `ws`, plays the same episodes over OpenEnv's `/ws` protocol (one WebSocket per session).

Usage: python benchmarks/bench_env_server.py [--sessions 64,1024] [--seconds 8] [--rate 500]
       [--clients 2] [--client remote,remote-http,raw,ws] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import multiprocessing
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np

import reflow
from reflow.env import parse_assistant, scripted_policy

ENV_ID = "reflow/Calc-v0"
WARMUP_S = 1.0


def warmup_s(sessions: int, interval_s: float) -> float:
    """What each run leaves out at its start: at least a second, the pacing interval (paced sessions
    start spread over one), and the time to open many sessions (about 500 a second here)."""
    return max(WARMUP_S, interval_s, sessions / 500)


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


class Pacer:
    """With an interval, steps start on a jittered schedule averaging one per interval, whatever the
    latency (as a policy would send them); without, each step follows the last answer at once."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.next_at = time.perf_counter() + random.uniform(0, interval_s)

    async def start(self) -> None:
        """Paced sessions start spread over one interval, not all at once."""
        if self.interval_s:
            await asyncio.sleep(max(0.0, self.next_at - time.perf_counter()))

    async def wait(self) -> None:
        if self.interval_s:
            await asyncio.sleep(max(0.0, self.next_at - time.perf_counter()))
            self.next_at += self.interval_s * random.uniform(0.5, 1.5)


def record_end(out: dict, status: str) -> None:
    out["statuses"][status] = out["statuses"].get(status, 0) + 1


async def remote_worker(
    url: str, token: str, stop_at: float, pacer: Pacer, seed: int, out: dict, transport: str = "auto"
) -> None:
    """Whole episodes through `reflow.make("reflow/Remote-v0")`, as a rollout worker plays them."""
    env = reflow.make("reflow/Remote-v0", url=url, env_id=ENV_ID, token=token, transport=transport)
    await pacer.start()
    try:
        while time.perf_counter() < stop_at:
            seed += 1000
            obs = await env.reset(seed=seed)
            out["sessions"] += 1
            policy, history = scripted_policy(env, 0.0, seed), list(obs.messages)
            while True:
                await pacer.wait()
                turn = parse_assistant(policy(history, obs.tools), tools=env.unwrapped.tools)
                t0 = time.perf_counter()
                step = await env.step(turn)
                out["latency"].append((t0, time.perf_counter() - t0))
                history += [turn.to_message(), *step.messages]
                if step.done:
                    record_end(out, step.info.get("status", "?"))
                    break
    finally:
        await env.close()


class RawHTTP:
    """Just enough HTTP/1.1 over one keep-alive connection for the load generator."""

    def __init__(self, url: str, token: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.headers = (
            f"Host: {self.host}\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\n"
        )
        self.conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        if self.conn is None:
            self.conn = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.conn
        data = json.dumps(body).encode() if body is not None else b""
        writer.write(
            f"{method} {path} HTTP/1.1\r\n{self.headers}Content-Length: {len(data)}\r\n\r\n".encode() + data
        )
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        length = next(int(h.split(":", 1)[1]) for h in head if h.lower().startswith("content-length:"))
        return int(head[0].split()[1]), json.loads(await reader.readexactly(length))

    def close(self) -> None:
        if self.conn is not None:
            self.conn[1].close()


async def raw_worker(url: str, token: str, stop_at: float, pacer: Pacer, seed: int, out: dict) -> None:
    """The same episodes as `remote_worker`, with the scripted policy of a local copy of the env."""
    local, http = reflow.make(ENV_ID), RawHTTP(url, token)
    await pacer.start()
    try:
        while time.perf_counter() < stop_at:
            seed += 1000
            task, rng = local.pick_task(seed), random.Random(seed)
            status, created = await http.call("POST", "/v1/sessions", {"env_id": ENV_ID, "seed": seed})
            assert status == 201, created
            out["sessions"] += 1
            sid, history = created["session_id"], list(created["observation"]["messages"])
            for index in range(1000):
                await pacer.wait()
                turn = parse_assistant(local.demo(task, history, rng, 0.0), tools=local.unwrapped.tools)
                body = {"turn_index": index, "turn": asdict(turn)}
                t0 = time.perf_counter()
                status, step = await http.call("POST", f"/v1/sessions/{sid}/step", body)
                out["latency"].append((t0, time.perf_counter() - t0))
                assert status == 200, step
                result = step["result"]
                history += [turn.to_message(), *result["messages"]]
                if result["terminated"] or result["truncated"]:
                    record_end(out, result["info"].get("status", "?"))
                    break
    finally:
        http.close()


async def ws_worker(url: str, token: str, stop_at: float, pacer: Pacer, seed: int, out: dict) -> None:
    """The same episodes over OpenEnv's `/ws` protocol (reflow/server/openenv_ws.py): one WebSocket per
    session for all its episodes, one frame each way per step."""
    from websockets.asyncio.client import connect

    local = reflow.make(ENV_ID)
    ws_url = url.replace("http://", "ws://", 1) + f"/openenv/{ENV_ID}/ws"
    auth = {"Authorization": f"Bearer {token}"}
    await pacer.start()
    async with connect(
        ws_url, additional_headers=auth, max_size=None, ping_interval=None, open_timeout=120
    ) as ws:
        while time.perf_counter() < stop_at:
            seed += 1000
            task, rng = local.pick_task(seed), random.Random(seed)
            await ws.send(json.dumps({"type": "reset", "data": {"seed": seed}}))
            created = json.loads(await ws.recv())
            assert created["type"] == "observation", created
            out["sessions"] += 1
            history = list(created["data"]["observation"]["messages"])
            while True:
                await pacer.wait()
                turn = parse_assistant(local.demo(task, history, rng, 0.0), tools=local.unwrapped.tools)
                calls = [{"name": c.name, "arguments": c.arguments, "id": c.id} for c in turn.tool_calls]
                frame = json.dumps({"type": "step", "data": {"content": turn.content, "tool_calls": calls}})
                t0 = time.perf_counter()
                await ws.send(frame)
                reply = json.loads(await ws.recv())
                out["latency"].append((t0, time.perf_counter() - t0))
                assert reply["type"] == "observation", reply
                data = reply["data"]
                history += [turn.to_message(), *data["observation"]["messages"]]
                if data["done"]:
                    record_end(out, data["metadata"]["status"])
                    break


WORKERS = {
    "remote": remote_worker,
    "remote-http": functools.partial(remote_worker, transport="http"),
    "raw": raw_worker,
    "ws": ws_worker,
}


async def play(
    kind: str,
    url: str,
    token: str,
    sessions: int,
    seed0: int,
    seconds: float,
    interval_s: float,
    warmup: float,
) -> dict:
    out: dict = {"latency": [], "statuses": {}, "sessions": 0}
    worker = WORKERS[kind]
    start = time.perf_counter()
    stop_at = start + seconds
    ended = await asyncio.gather(
        *(worker(url, token, stop_at, Pacer(interval_s), seed0 + i, out) for i in range(sessions)),
        return_exceptions=True,
    )
    # A worker that raised lost its episode in flight (and no more were played by it).
    failures = [e for e in ended if isinstance(e, BaseException)]
    out["failed_workers"] = len(failures)
    out["first_failure"] = f"{type(failures[0]).__name__}: {failures[0]}"[:300] if failures else None
    # Steady state only: the warm-up (sessions starting) and the tail after the stop (sessions
    # finishing their last episode) are left out.
    out["latency"] = [lat for t0, lat in out["latency"] if start + warmup <= t0 < stop_at]
    return out


def client_process(
    kind: str,
    url: str,
    token: str,
    sessions: int,
    seed0: int,
    seconds: float,
    interval_s: float,
    start_at: float,
    warmup: float,
) -> dict:
    """One load-generating process: waits for the common start, then plays its share of the sessions."""
    time.sleep(max(0.0, start_at - time.time()))
    coro = play(kind, url, token, sessions, seed0, seconds, interval_s, warmup)
    try:
        import uvloop  # the load generator's own loop: uvloop when installed (the server extra has it)
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def measure(
    pool: ProcessPoolExecutor,
    args: argparse.Namespace,
    kind: str,
    url: str,
    token: str,
    sessions: int,
    interval_s: float,
) -> dict:
    """`sessions` spread over the client processes, started together; their figures merged, with the
    peak of live sessions the server reported while they ran."""
    start_at = time.time() + 1.0
    warmup = warmup_s(sessions, interval_s)
    shares = [sessions // args.clients + (i < sessions % args.clients) for i in range(args.clients)]
    futures = [
        pool.submit(
            client_process, kind, url, token, n, 10_000 * i, args.seconds, interval_s, start_at, warmup
        )
        for i, n in enumerate(shares)
    ]
    peak = [0, 0]
    sampler = threading.Thread(
        target=sample_live, args=(url, token, args.server_pid, futures, peak), daemon=True
    )
    sampler.start()
    outs = [f.result() for f in futures]
    sampler.join()
    lat = np.array([x for o in outs for x in o["latency"]]) * 1000
    statuses: dict[str, int] = {}
    for o in outs:
        for k, v in o["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
    return {
        "client": kind,
        "sessions": sessions,
        "offered_steps_per_s": sessions / interval_s if interval_s else None,
        "steps": len(lat),
        "steps_per_s": len(lat) / (args.seconds - warmup),
        "p50_ms": float(np.percentile(lat, 50)) if len(lat) else float("nan"),
        "p99_ms": float(np.percentile(lat, 99)) if len(lat) else float("nan"),
        "episodes": sum(o["sessions"] for o in outs),
        "statuses": statuses,
        "peak_live": peak[0],
        "peak_sockets": peak[1],
        "failed_workers": sum(o["failed_workers"] for o in outs),
        "first_failure": next((o["first_failure"] for o in outs if o["first_failure"]), None),
    }


def open_sockets(pid: int) -> int:
    """How many sockets process `pid` holds (its listening socket included)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed while we looked
            count += os.readlink(fd).startswith("socket:")
    return count


def sample_live(url: str, token: str, server_pid: int, futures: list, peak: list[int]) -> None:
    """The most live sessions /v1/capacity reports and the most sockets the server holds (every 0.2 s)
    until the load processes are done."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=10) as http:
        while not all(f.done() for f in futures):
            with contextlib.suppress(httpx.HTTPError):
                peak[0] = max(peak[0], http.get("/v1/capacity").json()["live_sessions"])
            peak[1] = max(peak[1], open_sockets(server_pid))
            time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", default="64,1024", help="comma-separated concurrent session counts")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each run")
    parser.add_argument("--rate", type=float, default=500.0, help="steps/s all sessions offer in paced runs")
    parser.add_argument("--clients", type=int, default=2, help="load-generating processes")
    parser.add_argument(
        "--client",
        default="remote,raw",
        help="comma-separated: remote (RemoteEnv, WebSocket), remote-http (RemoteEnv over HTTP), "
        "raw (plain HTTP), ws (OpenEnv's /ws, one socket a session)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    counts = [int(n) for n in args.sessions.split(",")]
    proc, url, token = start_server(max(counts) + 16)
    args.server_pid = proc.pid
    results, rss = [], {"start": rss_mb(proc.pid)}
    pool = ProcessPoolExecutor(args.clients, mp_context=multiprocessing.get_context("spawn"))
    try:
        for kind in args.client.split(","):
            for n in counts:
                for interval_s in (0.0, n / args.rate):
                    r = measure(pool, args, kind, url, token, n, interval_s)
                    cap = httpx.get(url + "/v1/capacity", headers={"Authorization": f"Bearer {token}"}).json()
                    r["left_on_server"] = cap["live_sessions"]
                    r["rss_after_mb"] = rss_mb(proc.pid)
                    results.append(r)
                    load = f"paced at {args.rate:g}/s" if interval_s else "closed loop"
                    failed = f", {r['failed_workers']} workers failed ({r['first_failure']})"
                    print(
                        f"{kind:>11} client, {n:4d} sessions, {load:>16}: {r['steps_per_s']:5.0f} steps/s, "
                        f"p50 {r['p50_ms']:6.1f} ms, p99 {r['p99_ms']:6.1f} ms, {r['episodes']} episodes "
                        f"{r['statuses']}, peak live {r['peak_live']} (sockets {r['peak_sockets']}), "
                        f"left on server {r['left_on_server']}, "
                        f"server RSS {r['rss_after_mb']:.0f} MB{failed if r['failed_workers'] else ''}",
                        flush=True,
                    )
        rss["after_runs"] = rss_mb(proc.pid)
        # the first load again: memory must stay where it was
        kind = args.client.split(",")[0]
        results.append({**measure(pool, args, kind, url, token, counts[0], 0.0), "repeat": True})
        rss["after_repeat"] = rss_mb(proc.pid)
    finally:
        pool.shutdown()
        proc.terminate()
        proc.wait(30)
    lost = sum(r["episodes"] - sum(r["statuses"].values()) for r in results)
    not_ok = sum(v for r in results for k, v in r["statuses"].items() if k != "ok")
    failed = sum(r["failed_workers"] for r in results)
    print(
        f"server RSS: start {rss['start']:.0f} MB, after the runs {rss['after_runs']:.0f} MB, "
        f"after repeating the first load {rss['after_repeat']:.0f} MB; episodes lost {lost}, not ok {not_ok}, "
        f"workers failed {failed}"
    )
    if args.json:
        print(json.dumps({"runs": results, "rss_mb": rss}))
    return 1 if lost or not_ok or failed or any(r.get("left_on_server") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

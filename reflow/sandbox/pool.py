"""A warm pool of sandboxes: started ahead of time, handed to episodes, reset or replaced between them.

`acquire` takes a ready sandbox from the idle queue (a ping checks it still answers: a warm acquire
costs that round trip) or, when none is idle and the cap allows, starts one in the caller (a cold
start). `release` gives it back: a background thread resets it (every process killed, the work dirs
emptied) and puts it back in the queue, or replaces it when the reset fails, the sandbox died or it
has served `max_uses` episodes. The same thread keeps `size` sandboxes idle.

Two limits protect the engine: a hard cap on live sandboxes (idle, leased, being reset, starting or
being removed, all counted), and a token bucket on how fast new ones start. `acquire` waits for a
sandbox, up to its timeout, when the cap is reached; `aacquire` also stops waiting when its caller is
cancelled, and hands back a sandbox its thread got after that (nothing else would release it).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from reflow.sandbox.base import _EXECUTOR, Sandbox, SandboxError


class PoolExhausted(SandboxError):
    """No sandbox became available within the acquire timeout (the live cap is reached)."""


class AcquireAbandoned(SandboxError):
    """The caller of `aacquire` was cancelled while its thread was waiting for a sandbox."""


class TokenBucket:
    """At most `rate` starts per second on average, `burst` at once; `take` blocks until allowed."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.stamp = time.monotonic()
        self.lock = threading.Lock()

    def take(self, deadline: float | None = None) -> bool:
        while True:
            with self.lock:
                now = time.monotonic()
                self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
                self.stamp = now
                if self.tokens >= 1:
                    self.tokens -= 1
                    return True
                wait = (1 - self.tokens) / self.rate
            if deadline is not None and time.monotonic() + wait > deadline:
                return False
            time.sleep(wait)


@dataclass
class PoolStats:
    created: int = 0
    destroyed: int = 0
    resets: int = 0
    failed_resets: int = 0
    warm_acquires: int = 0
    cold_acquires: int = 0
    create_errors: int = 0
    last_error: str | None = None
    acquire_s: list[float] = field(default_factory=list)


class SandboxPool:
    """See the module docstring. `factory` starts one sandbox (e.g. `DockerSandbox.create`)."""

    def __init__(
        self,
        factory: Callable[[], Sandbox],
        *,
        size: int = 2,
        max_live: int = 32,
        create_rate: float = 8.0,
        create_burst: int = 4,
        max_uses: int = 100,
        name: str = "pool",
    ) -> None:
        if max_live < 1 or size > max_live:
            raise ValueError("need 1 <= max_live and size <= max_live")
        self.factory = factory
        self.size, self.max_live, self.max_uses, self.name = size, max_live, max_uses, name
        self.bucket = TokenBucket(create_rate, create_burst)
        self.idle: deque[Sandbox] = deque()
        self.dirty: deque[Sandbox] = deque()
        self.leased: set[Sandbox] = set()
        self.starting = 0
        self.resetting = 0
        self.removing = 0
        self.stats = PoolStats()
        self.closed = False
        self.cond = threading.Condition()
        self.owner_pid = os.getpid()
        self._thread = threading.Thread(target=self._maintain, name=f"reflow-{name}", daemon=True)
        self._thread.start()
        _live_pools.add(self)

    # ---- counting -------------------------------------------------------------------------------------
    # Every sandbox is in exactly one place at every moment (moves happen under the lock), so `live` is
    # exact: idle, leased, waiting for its reset, being reset, being started, or being removed.
    @property
    def live(self) -> int:
        """Sandboxes that exist or are being made or removed (what the cap bounds)."""
        return (
            len(self.idle)
            + len(self.dirty)
            + len(self.leased)
            + self.resetting
            + self.starting
            + self.removing
        )

    def snapshot(self) -> dict[str, int]:
        with self.cond:
            return {
                "live": self.live,
                "idle": len(self.idle),
                "leased": len(self.leased),
                "resetting": len(self.dirty) + self.resetting,
                "starting": self.starting,
                "removing": self.removing,
            }

    # ---- acquire and release --------------------------------------------------------------------------
    def acquire(
        self,
        timeout_s: float = 120.0,
        episode_timeout_s: float | None = None,
        abandoned: threading.Event | None = None,
    ) -> Sandbox:
        """A ready sandbox for one episode (blocks up to `timeout_s`, or until `abandoned` is set)."""
        start = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        while True:
            with self.cond:
                if self.closed:
                    raise SandboxError(f"pool {self.name} is closed")
                while not self.idle and self.live >= self.max_live:
                    if abandoned is not None and abandoned.is_set():
                        raise AcquireAbandoned("the caller stopped waiting for a sandbox")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise PoolExhausted(f"no sandbox free within {timeout_s:g}s ({self.max_live} live)")
                    self.cond.wait(left)
                    if self.closed:
                        raise SandboxError(f"pool {self.name} is closed")
                if self.idle:
                    sandbox: Sandbox | None = self.idle.popleft()
                    self.leased.add(sandbox)
                else:
                    sandbox = None
                    self.starting += 1
                self.cond.notify_all()  # the maintainer may top the idle queue up again
            if sandbox is not None:
                if sandbox.ping_sync():
                    with self.cond:
                        self.stats.warm_acquires += 1
                    break
                with self.cond:
                    self.leased.discard(sandbox)
                    self.removing += 1
                self._spawn_remove(sandbox)
                continue
            try:
                sandbox = self._create(deadline)
            except BaseException:
                with self.cond:
                    self.starting -= 1
                    self.cond.notify_all()
                raise
            with self.cond:
                self.starting -= 1
                closed = self.closed
                if closed:
                    self.removing += 1
                else:
                    self.leased.add(sandbox)
                    self.stats.cold_acquires += 1
            if closed:  # closed while we were starting it: close() did not know about this one
                self._spawn_remove(sandbox)
                raise SandboxError(f"pool {self.name} is closed")
            break
        sandbox.begin_episode(episode_timeout_s or sandbox.limits.episode_timeout_s)
        self.stats.acquire_s.append(time.perf_counter() - start)
        del self.stats.acquire_s[:-10000]
        return sandbox

    def release(self, sandbox: Sandbox, *, discard: bool = False) -> None:
        """Give a sandbox back after its episode; it is reset (or replaced) in the background."""
        with self.cond:
            if sandbox not in self.leased:
                return
            self.leased.discard(sandbox)
            sandbox.uses += 1
            if discard or self.closed or sandbox.closed or sandbox.uses >= self.max_uses:
                self.removing += 1
                self._spawn_remove(sandbox)
            else:
                self.dirty.append(sandbox)
            self.cond.notify_all()

    async def aacquire(self, timeout_s: float = 120.0, episode_timeout_s: float | None = None) -> Sandbox:
        """`acquire` in a thread, bounded by the caller: when the awaiting task is cancelled (a server's
        step deadline) the thread stops waiting, and a sandbox it got all the same goes straight back."""
        abandoned = threading.Event()
        future = _EXECUTOR.submit(self.acquire, timeout_s, episode_timeout_s, abandoned)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            abandoned.set()
            with self.cond:
                self.cond.notify_all()  # wake the thread if it waits on the live cap
            future.add_done_callback(self._give_back_abandoned)
            raise

    def _give_back_abandoned(self, future: concurrent.futures.Future[Sandbox]) -> None:
        if not future.cancelled() and future.exception() is None:
            self.release(future.result())

    # ---- making and removing --------------------------------------------------------------------------
    def _create(self, deadline: float | None = None) -> Sandbox:
        if not self.bucket.take(deadline):
            raise PoolExhausted("the sandbox creation rate limit left no time to start one")
        try:
            sandbox = self.factory()
        except Exception as e:
            self.stats.create_errors += 1
            self.stats.last_error = str(e)
            raise
        self.stats.created += 1
        return sandbox

    def _remove(self, sandbox: Sandbox) -> None:
        try:
            sandbox.close_sync()
        except Exception as e:
            self.stats.last_error = str(e)
        finally:
            with self.cond:
                self.removing -= 1
                self.stats.destroyed += 1
                self.cond.notify_all()

    def _spawn_remove(self, sandbox: Sandbox) -> None:
        """Remove in a thread of its own (no executor: this also runs at interpreter exit).

        The caller has already counted it in `removing`."""
        threading.Thread(
            target=self._remove, args=(sandbox,), name=f"reflow-{self.name}-rm", daemon=True
        ).start()

    def _maintain(self) -> None:
        """The background thread: reset released sandboxes, keep `size` idle."""
        backoff = 0.0
        while True:
            with self.cond:
                while not self.closed and not self.dirty and not self._wants_more():
                    self.cond.wait(1.0)
                if self.closed:
                    return
                if self.dirty:
                    sandbox: Sandbox | None = self.dirty.popleft()
                    self.resetting += 1
                else:
                    sandbox = None
                    self.starting += 1
            if sandbox is not None:
                ok = False
                try:
                    ok = sandbox.reset_sync()
                except Exception as e:
                    self.stats.last_error = str(e)
                with self.cond:
                    self.resetting -= 1
                    if ok and not self.closed:
                        self.stats.resets += 1
                        self.idle.append(sandbox)
                    else:
                        self.stats.failed_resets += 1
                        self.removing += 1
                    self.cond.notify_all()
                if not ok or self.closed:
                    self._spawn_remove(sandbox)
                continue
            try:
                new = self._create()
                backoff = 0.0
            except Exception:
                new = None
                backoff = min(max(backoff * 2, 0.5), 30.0)
            with self.cond:
                self.starting -= 1
                if new is not None:
                    if self.closed:
                        self.removing += 1
                    else:
                        self.idle.append(new)
                        new = None
                self.cond.notify_all()
            if new is not None:
                self._spawn_remove(new)
            if backoff:
                time.sleep(backoff)

    def _wants_more(self) -> bool:
        return len(self.idle) + self.starting < self.size and self.live < self.max_live

    def wait_ready(self, n: int | None = None, timeout_s: float = 60.0) -> bool:
        """Block until `n` (default `size`) sandboxes are idle; for benchmarks and warm starts."""
        n = self.size if n is None else n
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while len(self.idle) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
        return True

    def close(self) -> None:
        """Remove every sandbox of the pool, leased ones too. Safe to call more than once."""
        with self.cond:
            if self.closed:
                return
            self.closed = True
            doomed = [*self.idle, *self.dirty, *self.leased]
            self.idle.clear()
            self.dirty.clear()
            self.leased.clear()
            self.removing += len(doomed)
            self.cond.notify_all()
        for sandbox in doomed:
            self._spawn_remove(sandbox)
        self._thread.join(timeout=30)
        # A sandbox the maintainer was starting when we closed is removed by it; wait for that too.
        deadline = time.monotonic() + 30
        with self.cond:
            while (self.starting or self.removing) and time.monotonic() < deadline:
                self.cond.wait(0.1)
        _live_pools.discard(self)

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(_EXECUTOR, self.close)

    def __repr__(self) -> str:
        return f"<SandboxPool {self.name} {self.snapshot()}>"


_live_pools: weakref.WeakSet[SandboxPool] = weakref.WeakSet()


@atexit.register
def _close_pools_at_exit() -> None:
    for pool in list(_live_pools):
        if pool.owner_pid != os.getpid():
            continue  # a forked child must not remove its parent's sandboxes
        with contextlib.suppress(Exception):
            pool.close()

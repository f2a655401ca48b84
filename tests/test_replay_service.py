"""The replay actor's service object: concurrent calls (it runs as a threaded Ray actor)."""

import threading

from replay_helpers import make_group

from reflow.policy.dual_cycle import CycleConfig
from reflow.runtime.replay_service import ReplayService


def test_concurrent_plans_never_hand_out_the_same_fresh_group(tmp_path):
    service = ReplayService(str(tmp_path / "replay.sqlite"), "run", CycleConfig())
    for i in range(40):
        service.add_group(*make_group(f"g{i}", [0.0, 1.0]))
    plans, barrier = [], threading.Barrier(8)

    def plan(step: int) -> None:
        barrier.wait()
        for _ in range(5):
            batch = service.plan_and_consume(1, 0, 0.0, False, step)
            if batch is not None:
                plans.append(batch.group_ids)

    threads = [threading.Thread(target=plan, args=(s,)) for s in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    handed = [g for ids in plans for g in ids]
    assert len(handed) == len(set(handed)) == 40  # each group once, none lost
    assert service.reuse_histogram() == {1: 40}


def test_the_actor_exposes_every_store_method_its_callers_call():
    # The actor holds its store rather than inheriting it: a `replay.<method>.remote(...)` call on a
    # method it does not expose would fail only when a run reaches it.
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    called = {
        name
        for folder in ("reflow", "benchmarks", "tests")
        for path in (root / folder).rglob("*.py")
        for name in re.findall(r"\breplay\.(\w+)\.remote\b", path.read_text())
    }
    assert called and not {n for n in called if not callable(getattr(ReplayService, n, None))}

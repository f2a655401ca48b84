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

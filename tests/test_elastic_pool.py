"""The elastic pool on Ray: slots change role mid-run without losing a group or
turning an engine's weights back, the re-formed FSDP2 group trains like a freshly formed one, each
change's cost is measured per part, and roles placed on different nodes of a multi-node cluster
exchange weights through Ray's object store. The observation arithmetic is tested without Ray."""

import uuid

import pytest
import torch
from run_helpers import PARITY_ENV, SMALL_ROLLOUT, TINY_MODEL

from reflow.config import load_config
from reflow.policy.elastic import ElasticConfig, ElasticPolicy, Interval, RoleChangeCost, Totals, observe
from reflow.runtime.actuator import worker_to_drain

# A tiny model and the parity env (see tests/test_agent_train.py): seconds per group.
BASE = [
    *PARITY_ENV,
    "mode=async",
    *TINY_MODEL,
    *(o for o in SMALL_ROLLOUT if not o.startswith("rollout.groups_per_step")),
    "train.lr=1e-2",
    "resources.threads_per_slot=1",
]


# -- the observation, as arithmetic ----------------------------------------------------------------


def test_observation_rates_and_idle_ratios_from_an_interval():
    then = Totals(wall_s=10.0, rollout_busy_s=12.0, generated=40, trainer_busy_s=3.0, trained=32)
    now = Totals(wall_s=30.0, rollout_busy_s=42.0, generated=100, trainer_busy_s=8.0, trained=64)
    interval = Interval.between(then, now)
    assert interval == Interval(
        seconds=20.0, rollout_busy_s=30.0, generated=60, trainer_busy_s=5.0, trained=32
    )
    obs = observe(
        interval, step=4, version=4, steps_since_change=4, rollout_slots=2, train_slots=1,
        batch_size=16, replay_share=0.5,
    )  # fmt: skip
    assert obs.rollout_rate == pytest.approx(60 / 30)  # per busy slot-second
    assert obs.train_rate == pytest.approx(32 / (5 * 1))
    assert obs.rollout_idle == pytest.approx(1 - 30 / (2 * 20))
    assert obs.train_idle == pytest.approx(1 - 5 / 20)
    assert obs.reuse == pytest.approx(2.0)  # half of every batch replayed: each sample trained twice
    two_ranks = observe(interval, step=4, version=4, steps_since_change=4, rollout_slots=2, train_slots=2,
                        batch_size=16)  # fmt: skip
    assert two_ranks.train_rate == pytest.approx(obs.train_rate / 2)  # the same step on two slots
    assert two_ranks.reuse == 1.0


def test_observation_of_an_idle_side_has_no_rate_and_the_policy_holds():
    interval = Interval(seconds=5.0, rollout_busy_s=0.0, generated=0, trainer_busy_s=6.0, trained=8)
    obs = observe(
        interval, step=9, version=9, steps_since_change=9, rollout_slots=1, train_slots=1, batch_size=8
    )
    assert obs.rollout_rate == 0.0 and obs.rollout_idle == 1.0
    assert obs.train_idle == 0.0  # busy a little longer than the interval (an eval pause): clamped
    assert ElasticPolicy().decide(obs).action == "hold"
    with pytest.raises(ValueError, match="backwards"):
        Interval.between(Totals(wall_s=2.0), Totals(wall_s=1.0))


def test_observation_feeds_the_policy_a_move_when_rollout_starves_the_trainer():
    # 2 rollout slots make 1 sample/s each, 2 train slots could train 4/s each: training waits
    interval = Interval(seconds=10.0, rollout_busy_s=20.0, generated=20, trainer_busy_s=2.5, trained=20)
    cost = RoleChangeCost(actor_start_s=1.0, weight_load_s=0.5, group_reform_s=0.5)
    obs = observe(interval, step=6, version=6, steps_since_change=6, rollout_slots=2, train_slots=2,
                  batch_size=8, to_rollout_cost=cost)  # fmt: skip
    decision = ElasticPolicy(ElasticConfig(min_dwell_steps=2)).decide(obs)
    # T(2, 2) = min(2 x 1, 2 x 4) = 2/s; T(3, 1) = min(3, 4) = 3/s: step 4 s -> 2.67 s, x10 steps >> 2 s x 1.5
    assert decision.action == "to_rollout"
    assert decision.cost_s == pytest.approx(2.0)


def test_the_drained_worker_is_the_one_with_the_fewest_groups_in_flight():
    assert worker_to_drain([3, 1, 2]) == 1
    assert worker_to_drain([2, 2]) == 1  # ties: the last (highest slot)
    with pytest.raises(ValueError):
        worker_to_drain([])


class _RecordingCluster:
    """What `ElasticRuntime` needs of a `Cluster`; `move` records the call and returns a change."""

    def __init__(self, roles):
        from types import SimpleNamespace

        self.slots = [SimpleNamespace(index=i, role=r) for i, r in enumerate(roles)]
        self.moves = []
        self.lent = []  # no engine lent beside the trainer

    @property
    def rollout_slots(self):
        return [s for s in self.slots if s.role == "rollout"]

    @property
    def rollout(self):
        return [f"worker-{s.index}" for s in self.rollout_slots]

    @property
    def trainers(self):
        return [f"rank-on-{s.index}" for s in self.slots if s.role == "train"]

    def move(self, slot, to_role, in_flight=None, drain_timeout_s=None):
        from reflow.runtime.role_change import RoleChange

        self.moves.append((slot, to_role, in_flight))
        index = slot if isinstance(slot, int) else [s.index for s in self.slots if s.role == slot][-1]
        from_role = self.slots[index].role
        self.slots[index].role = to_role
        cost = RoleChangeCost(actor_start_s=4.0, weight_load_s=0.5, group_reform_s=1.5)
        return RoleChange(index, from_role, to_role, 6, cost, drain_s=0.25, wall_s=6.3, roles=["x"])


def test_the_runtime_moves_the_least_busy_worker_and_remembers_the_measured_cost():
    from reflow.runtime.elastic import ElasticRuntime

    cluster = _RecordingCluster(["rollout", "train", "rollout", "rollout"])
    runtime = ElasticRuntime(cluster, ElasticPolicy(ElasticConfig(min_dwell_steps=0)), batch_size=32)
    # 3 rollout slots make 4 samples/s each, 1 train slot trains 2/s: rollout waits on training;
    # T(3, 1) = 2/s, T(2, 2) = 4/s: a step 16 s -> 8 s, 80 s over 10 steps > 1.5 x the assumed 30 s
    interval = Interval(seconds=10.0, rollout_busy_s=10.0, generated=40, trainer_busy_s=10.0, trained=20)
    in_flight = {"ref-a": (0, ["g1"]), "ref-b": (0, ["g2"]), "ref-c": (2, ["g3"]), "ref-d": (1, ["g4"])}
    event, change = runtime.at_boundary(interval, step=6, version=6, in_flight=in_flight)
    # workers 1 and 2 (slots 2 and 3) have one group each: the last of them drains, with its group only
    assert cluster.moves == [(3, "train", {"ref-c": ["g3"]})], event["why"]
    assert event["what"] == "to_train: slot 3: rollout -> train" and "gain" in event["why"]
    assert event["cost_s"] == pytest.approx(6.0) and event["drain_s"] == 0.25
    assert runtime.costs["to_train"] == change.cost and runtime.costs["to_rollout"] is None
    # asked again at the same version: no second move
    event, change = runtime.at_boundary(interval, step=6, version=6)
    assert change is None and event["what"] == "hold" and "already moved" in event["why"]


def test_a_move_takes_a_slot_that_can_change_role_and_names_one_that_cannot():
    from reflow.runtime.cluster import Cluster, Slot

    cluster = object.__new__(Cluster)  # pick_slot reads the slots only
    cluster.slots = [Slot(0, "rollout"), Slot(1, "rollout"), Slot(2, "train")]
    assert cluster.pick_slot("rollout", "train").index == 1  # a role: its last slot
    assert cluster.pick_slot(0, "train").index == 0
    with pytest.raises(ValueError, match="last 'train' slot"):
        cluster.pick_slot("train", "rollout")
    with pytest.raises(ValueError, match="already has role"):
        cluster.pick_slot(2, "train")
    with pytest.raises(ValueError, match="no slot 7"):
        cluster.pick_slot(7, "train")
    with pytest.raises(ValueError, match="unknown role 'eval'"):
        cluster.pick_slot(0, "eval")


def test_placement_config_is_checked():
    from reflow.errors import ConfigError

    cfg = load_config(
        None, [*BASE, "resources.placement={rollout: {node_resource: a}, train: {strategy: SPREAD}}"]
    )
    assert cfg.resources.placement["rollout"].node_resource == "a"
    assert cfg.resources.placement["train"].strategy == "SPREAD"
    with pytest.raises(ConfigError, match="placement"):
        load_config(None, [*BASE, "resources.placement={train: {strategy: SIDEWAYS}}"])


# -- on Ray ------------------------------------------------------------------------------------------


def _model_path(config) -> str:
    from reflow.models.presets import resolve_model_path

    return str(resolve_model_path(config.model.name, **config.model_overrides))


def _generate(cluster, worker: int, seeds: list[int]) -> list:
    import ray

    return ray.get(cluster.rollout[worker].generate.remote(seeds))


def _stored(cluster, group_ids: list[str]) -> dict[str, dict]:
    import ray

    groups = ray.get([cluster.replay.group.remote(g) for g in group_ids])
    return {g.group_id: [e.to_dict() for e in g.episodes] for g in groups}


def _sync(cluster, version: int) -> list[int]:
    import ray

    ref = cluster.state_dict_ref()
    return ray.get([w.update_weights.remote(ref, version) for w in cluster.rollout])


def _full_state(cluster) -> list:
    """Rank 0's (weights, rest of the state); every rank is called (a collective)."""
    import ray

    refs = [t.full_state.options(num_returns=2).remote() for t in cluster.trainers]
    return ray.get(list(refs[0]))


def _assert_cost_parts(change) -> None:
    cost = change.cost
    for part in (cost.actor_start_s, cost.weight_load_s, cost.group_reform_s):
        assert part > 0
    # timed one after another on the driver: the parts and the drain make up the wall time
    assert cost.total_s + change.drain_s == pytest.approx(change.wall_s, rel=0.05, abs=0.05)


def _fresh_group_step(config, model_path, replay, state, group_ids, step):
    """A freshly formed 2-rank group loads `state` and trains one step: (metrics, full weights)."""
    import ray

    from reflow.runtime.trainer_rank import TrainerRank

    ranks = [
        ray.remote(TrainerRank).options(num_cpus=1).remote(config, model_path, replay, r, 2) for r in (0, 1)
    ]
    try:
        master = ray.get(ranks[0].master_address.remote())
        ray.get([r.setup.remote(master) for r in ranks])
        ray.get([r.load_full_state.remote(*state) for r in ranks])
        metrics = ray.get([r.train_step.remote(group_ids, step) for r in ranks])[0]
        weights = ray.get([r.state_dict.remote() for r in ranks])[0]
    finally:
        for r in ranks:
            ray.kill(r)
    return metrics, weights


@pytest.mark.slow
@pytest.mark.parametrize("lora", [[], ["model.lora.r=4"]], ids=["full", "lora"])
def test_role_changes_both_ways_keep_groups_versions_and_gradients(tmp_path, ray_env, lora):
    """Also under LoRA, where the weights and Adam moments that move are the adapters'."""
    import ray

    from reflow.runtime.cluster import Cluster

    ray.init(address="local", num_cpus=6, include_dashboard=False)
    slots = "resources.slots=[rollout, rollout, train]"
    config = load_config(None, [*BASE, f"out_dir={tmp_path}", slots, *lora])
    model_path = _model_path(config)
    cluster = Cluster(config, model_path, tmp_path)
    try:
        reports = _generate(cluster, 0, [0, 1]) + _generate(cluster, 1, [2, 3])
        acked = [r.group_id for r in reports]
        before = _stored(cluster, acked)
        cluster.train_step(acked[:2], 1)
        assert _sync(cluster, 1) == [1, 1]
        engine_versions = cluster.weight_versions()

        # rollout -> train while slot 1 has two groups in flight: they finish and are stored
        ids = [uuid.uuid4().hex, uuid.uuid4().hex]
        for g in ids:
            ray.get(cluster.replay.begin_group.remote(g, 1))
        in_flight = {cluster.rollout[1].generate.remote([10, 11], ids): ids}
        pre_move = _full_state(cluster)
        assert all(".lora_" in k for k in pre_move[0]) == bool(lora)  # LoRA: the adapters alone
        change = cluster.move(1, "train", in_flight)
        assert change.roles == cluster.roles() == ["rollout", "train", "train"]
        assert (change.from_role, change.to_role, change.version) == ("rollout", "train", 1)
        assert sorted(r.group_id for r in change.drained) == sorted(ids) and not change.abandoned
        assert _stored(cluster, acked) == before  # the acknowledged groups are untouched
        assert set(_stored(cluster, ids)) == set(ids)  # the drained ones are stored
        assert ray.get(cluster.replay.in_flight.remote()) == 0
        assert ray.get([t.version.remote() for t in cluster.trainers]) == [1, 1]
        _assert_cost_parts(change)

        # the re-formed group holds the pre-move state and trains like a fresh group of its size
        reformed = _full_state(cluster)
        for key, value in pre_move[0].items():
            assert torch.equal(reformed[0][key], value), key
        assert reformed[1]["step"] == pre_move[1]["step"] == 1
        moments = pre_move[1]["optimizer"]["state"]
        assert moments  # one Adam step was taken: its moments exist and carried over, per parameter
        for name, param_state in moments.items():
            for key, value in param_state.items():
                assert torch.equal(reformed[1]["optimizer"]["state"][name][key], value), (name, key)
        metrics = cluster.train_step(acked[2:], 2)
        weights = ray.get(cluster.state_dict_ref())
        fresh_metrics, fresh_weights = _fresh_group_step(
            config, model_path, cluster.replay, pre_move, acked[2:], 2
        )
        for key in ("loss", "grad_norm", "trained_tokens", "rows"):
            assert metrics[key] == pytest.approx(fresh_metrics[key], abs=1e-6), key
        moved = False
        for key, value in weights.items():
            assert torch.allclose(value, fresh_weights[key], atol=1e-6), key
            moved |= not torch.equal(value, pre_move[0][key])
        assert moved  # the step changed the weights (with the carried Adam moments)

        # train -> rollout: the last train slot becomes a rollout worker on the current weights
        back = cluster.move("train", "rollout")
        assert back.roles == ["rollout", "train", "rollout"] and back.version == 2
        assert ray.get(cluster.trainers[0].version.remote()) == 2
        _assert_cost_parts(back)
        versions = cluster.weight_versions()
        assert versions[1] == 2 and versions[0] >= engine_versions[0]
        assert _sync(cluster, 2) == [2, 2]
        assert _stored(cluster, acked) == before
        new = _generate(cluster, 1, [20])  # the new worker plays groups with v2 weights
        assert new[0].policy_version == 2
        metrics = cluster.train_step([new[0].group_id], 3)  # the group of one rank trains
        assert metrics["rows"] == 4 and ray.get(cluster.trainers[0].version.remote()) == 3
    finally:
        cluster.shutdown()


@pytest.mark.slow
def test_a_drain_past_its_timeout_returns_the_groups_it_abandons(tmp_path, ray_env):
    import ray

    from reflow.runtime.cluster import Cluster

    ray.init(address="local", num_cpus=4, include_dashboard=False)
    config = load_config(
        None,
        [
            *BASE,
            f"out_dir={tmp_path}",
            "env.id=test/Slow-v0",
            "env.kwargs={reset_s: 120}",  # no episode gets past its reset during the test
            "resources.slots=[rollout, rollout, train]",
        ],
    )
    cluster = Cluster(config, _model_path(config), tmp_path)
    try:
        ids = [uuid.uuid4().hex for _ in range(2)]
        for g in ids:
            ray.get(cluster.replay.begin_group.remote(g, 0))
        in_flight = {cluster.rollout[1].generate.remote([i], [g]): [g] for i, g in enumerate(ids)}
        change = cluster.move(1, "train", in_flight, drain_timeout_s=1.0)
        assert sorted(change.abandoned) == sorted(ids) and not change.drained and not change.failed
        assert change.drain_s >= 1.0
        assert ray.get(cluster.replay.in_flight.remote()) == 0  # their admission slots are free again
        assert ray.get(cluster.replay.count.remote()) == 0  # nothing half-stored
        assert cluster.roles() == ["rollout", "train", "train"]
        _assert_cost_parts(change)
    finally:
        cluster.shutdown()


def _node_of(actor) -> str:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def _engine_weights(worker) -> dict[str, torch.Tensor]:
    import ray

    return ray.get(
        worker.__ray_call__.remote(
            lambda self: {k: v.clone() for k, v in self.engine.model.state_dict().items()}
        )
    )


@pytest.mark.slow
def test_roles_on_different_nodes_sync_weights_and_change_roles(tmp_path, ray_env):
    import ray
    from ray.cluster_utils import Cluster as RayNodes

    from reflow.runtime.cluster import Cluster

    nodes = RayNodes(initialize_head=True, head_node_args={"num_cpus": 0})
    node_a = nodes.add_node(num_cpus=2, resources={"rollout_node": 1}, object_store_memory=150 * 2**20)
    node_b = nodes.add_node(num_cpus=1, resources={"train_node": 1}, object_store_memory=150 * 2**20)
    ray.init(address=nodes.address)
    config = load_config(
        None,
        [
            *BASE,
            f"out_dir={tmp_path}",
            "resources.slots=[rollout, rollout, train]",
            "resources.placement={rollout: {node_resource: rollout_node, strategy: PACK}, "
            "train: {node_resource: train_node}}",
        ],
    )
    cluster = Cluster(config, _model_path(config), tmp_path)
    try:
        assert [_node_of(w) for w in cluster.rollout] == [node_a.node_id] * 2
        assert _node_of(cluster.trainers[0]) == node_b.node_id
        reports = _generate(cluster, 0, [0, 1])
        cluster.train_step([r.group_id for r in reports], 1)
        # the weights travel from node B to the engines on node A through the object store
        assert _sync(cluster, 1) == [1, 1]
        trained = ray.get(cluster.state_dict_ref())
        for worker in cluster.rollout:
            engine = _engine_weights(worker)
            assert all(torch.equal(engine[k], v) for k, v in trained.items())
        # a rollout slot on node A joins the trainer on node B: one FSDP2 group across the nodes
        change = cluster.move("rollout", "train")
        assert [_node_of(t) for t in cluster.trainers] == [node_a.node_id, node_b.node_id]
        _assert_cost_parts(change)
        cluster.train_step([r.group_id for r in reports], 2)
        assert _sync(cluster, 2) == [2]
        trained = ray.get(cluster.state_dict_ref())
        engine = _engine_weights(cluster.rollout[0])
        assert all(torch.equal(engine[k], v) for k, v in trained.items())
    finally:
        cluster.shutdown()
        ray.shutdown()
        nodes.shutdown()


def test_the_loop_gives_a_drain_a_timeout():
    """A move to training waits `elastic.drain_timeout_s` at most for the drained worker's stragglers
    (the loop used to wait for the slowest one, however long)."""
    from reflow.recipes.run_state import RunState
    from reflow.runtime.elastic import ElasticDriver

    config = load_config(None, [*BASE, "mode=reflow"])
    assert ElasticDriver(None, config, RunState(), 0.0).runtime.actuator.drain_timeout_s == 30.0
    config = load_config(None, [*BASE, "mode=reflow", "elastic.drain_timeout_s=5"])
    assert ElasticDriver(None, config, RunState(), 0.0).runtime.actuator.drain_timeout_s == 5.0
    with pytest.raises(Exception, match="drain_timeout_s"):
        load_config(None, [*BASE, "mode=reflow", "elastic.drain_timeout_s=0"])


def test_an_abandoned_group_stored_before_the_kill_arrives_after_all(tmp_path, ray_env):
    """A group the drain gave up on can still be stored before its worker is stopped: it is then in the
    store (planned, trained) and must reach the loop as drained, not stay counted as abandoned."""
    import ray
    from replay_helpers import make_group

    from reflow.policy.dual_cycle import CycleConfig
    from reflow.runtime.replay_service import ReplayService
    from reflow.runtime.role_change import stored_after_all

    ray.init(address="local", num_cpus=1, include_dashboard=False)
    replay = ray.remote(ReplayService).remote(str(tmp_path / "replay.sqlite"), "r", CycleConfig())
    ray.get(replay.add_group.remote(*make_group("late", [0.0, 1.0])))
    late, gone = stored_after_all(replay, ["late", "never"])
    assert [r.group_id for r in late] == ["late"] and late[0].has_spread and gone == ["never"]


def test_a_move_to_training_drains_the_worker_with_the_least_work_counting_what_it_runs_for_lent_engines():
    """Worker 1 has no group of its own but runs 5 episodes a lent engine handed over (2 groups of 4):
    worker 0 with one group drains instead (the served episodes would fall back and re-prefill)."""
    from types import SimpleNamespace

    from reflow.runtime.actuator import RayActuator

    moved = []
    cluster = SimpleNamespace(
        rollout=["r0", "r1"],
        rollout_slots=[SimpleNamespace(index=0), SimpleNamespace(index=1)],
        move=lambda slot, role, drain, timeout: (
            moved.append((slot, role, drain)) or SimpleNamespace(cost=None)
        ),
    )
    actuator = RayActuator(cluster)
    actuator.in_flight = {"ref-a": (0, ["g-a"])}
    decision = SimpleNamespace(action="to_train")  # all `move_slot` reads of an `ElasticDecision`
    actuator.move_slot(decision)
    assert moved[-1][0] == 1  # without lending: the idle worker 1
    actuator.lent = SimpleNamespace(group_size=4, served_loads=lambda: [0, 5])
    actuator.move_slot(decision)
    assert moved[-1] == (0, "train", {"ref-a": ["g-a"]})

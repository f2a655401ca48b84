"""The runtime on Ray: the run's cluster of device slots and the actors placed on them (rollout workers,
trainer ranks, the replay service), the only layer that knows envs, engines, replay and training
together, and the drivers that run the scheduling policies (`reflow.policy`) on them.

- `cluster`: `Cluster`, the slots and their actors; `role_change`: one slot's move, measured.
- `workers`: `RolloutWorker` (an engine and env instances); `trainer_rank`: `TrainerRank`; `engines`:
  which engine a worker builds; `worker_tail`: a worker's side of the tail (progress, migrations, limits).
- `replay_service`: the replay store as an actor.
- `elastic`: `ElasticDriver` and `ElasticRuntime`, the elastic policy at each version boundary;
  `lending`: `LentEngines`, the engines lent beside the trainer ranks (`elastic.lend`).
- `tail`: `TailGate` and `TailRuntime`, the tail policy before the loop starts groups.
- `actuator`: `RayActuator`, the `reflow.policy.actuator.Actuator` that applies decisions to actors.
"""

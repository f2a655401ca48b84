"""Scheduling: the orchestration on Ray (the resource pool of device slots and the actors placed on
them: rollout workers, trainer ranks, the replay store), the only layer that knows envs, engines,
replay and training together; and the scheduler's policies (`elastic`, `tail`), plain objects with no
Ray, clock or I/O that the Ray runtime and the simulator both drive."""

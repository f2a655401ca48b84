"""Orchestration on Ray: the resource pool of device slots and the actors placed on them (rollout
workers, trainer ranks, the replay store). The only layer that knows envs, engines, replay and training
together."""

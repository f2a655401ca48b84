"""Overrides for the short `agent-train` runs the integration tests make: a tiny model without a warm
start and small groups, so that a step takes seconds on a CPU. Tests add the env and their own keys."""

TINY_MODEL = [
    "model=tiny",
    "model_overrides={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 2, "
    "num_key_value_heads: 1, head_dim: 16}",
    "warmstart.enabled=false",
]
SMALL_ROLLOUT = [
    "rollout.group_size=4",
    "rollout.groups_per_step=2",
    "rollout.max_new_tokens=8",
    "rollout.stop=[e, a, o]",  # an untrained model's replies end early, at varied lengths
    "rollout.max_batch_size=16",
]
PARITY_ENV = ["env.plugins=[fake_envs:register_test_envs]", "env.id=test/Parity-v0"]
"""The parity env: reward spread without a warm start."""
QUICK_RUN = [
    "train.lr=1e-2",
    "train.checkpoint_every=100",
    "eval.every=0",
    "eval.episodes=4",
    "eval.max_new_tokens=8",
    "resources.threads_per_slot=1",
]
"""A few steps of a tiny run that learns visibly, with no checkpoint or evaluation between its ends."""
LONG_TAIL_RUN = [
    *QUICK_RUN,
    "env.plugins=[tail_envs:register_tail_envs]",
    "env.id=test/LongParity-v0",
    "env.kwargs={step_s: 0.3}",
    "rollout.max_new_tokens=12",
]
"""A short run on the long-tail env (`tail_envs`, on the PYTHONPATH): the tail scheduler's tests."""


def train_and_read(overrides: list[str], resume: bool = False) -> tuple[dict, list[dict]]:
    """`agent-train` with `overrides` on a fresh local Ray (shut down after), or its `resume`: its
    summary and the records of its metrics.jsonl."""
    import json

    import ray

    from reflow.config import load_config
    from reflow.recipes.agent_train import train

    config = load_config(None, overrides)
    try:
        summary = train(config, resume=resume)
    finally:
        ray.shutdown()
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, rows

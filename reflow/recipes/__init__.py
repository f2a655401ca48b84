"""Recipes: the top-level jobs (rollout, warm-start, and later agent-train), each one file that joins
envs, engines, rollout and training with plain function calls."""

"""Training: warm-start SFT (`sft`), GRPO advantages (`advantages`), the policy losses (`losses`),
per-token log-probs (`logprobs`), the RL trainer with FSDP2 across ranks (`trainer`), stored groups to
rows (`batch`) and checkpoints (`checkpoint`). Imports the replay store and the model, never envs or
engines."""

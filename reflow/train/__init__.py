"""Training: warm-start SFT now; losses, the RL trainer, checkpoints and weight sync come with F4."""

"""What only a Flow-GRPO user or a real-scale run needs, beside the paper's mechanisms: the recipes'
presets (presets.py), the EMA of the trained weights for evaluation (ema.py) and batch-level
advantages across ranks (batch_rewards.py)."""

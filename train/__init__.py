"""Pass 2: DDP training of the DSpark draft from the shard store (`python -m train` under torchrun)."""

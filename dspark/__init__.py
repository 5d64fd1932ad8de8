"""dspark: the DSpark draft model, its objective, the shard-store format and drafter export."""

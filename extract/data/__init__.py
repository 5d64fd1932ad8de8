"""Pass 1a, data preparation: prompts -> target-regenerated conversations -> tokenized, loss-masked sets."""

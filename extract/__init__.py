"""Pass 1: data preparation, the vLLM server lifecycle, and hidden-state extraction into shard stores."""

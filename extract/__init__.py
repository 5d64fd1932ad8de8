"""Pass 1: data preparation, the vLLM server lifecycle, and hidden-state extraction into shard stores."""

import logging

# httpx logs every request at INFO; the stages' progress bars already say what is going on.
logging.getLogger("httpx").setLevel(logging.WARNING)

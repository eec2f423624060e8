"""Train-step builders. Each returns a pure `step(state, batch) -> (state, metrics)`; the trainer jits it."""

ENGINES = ("gspmd", "shard_map")

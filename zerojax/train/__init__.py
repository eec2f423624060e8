"""The framework over the engines: `zj.shard`, `Trainer`, `verify`, `fit`, resume, preemption,
checkpoints, progress and TensorBoard. Knows no config file and no CLI."""

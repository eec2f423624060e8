"""The rules and pure functions everything else reads: the mesh and its axes, the stage table, the
per-leaf rule, the state layout, axis rules and activation constraints, precision, the optimizer's
state, the train state, offload, remat, tree paths and the default loss. Imports nothing above it."""

"""A user's NNX or Linen model as pure functions: FSDP units, gather on read, the unit VJP, layer
stacks (`zj.Stacked`, lifted transforms) and the checks of a model against its loss and batch."""

"""One module per reduction class; each registers its backends with `rlkernel.dispatch`."""

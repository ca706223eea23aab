"""A learner: inner steps, ship-and-carry deltas, installs, its local state and publisher."""

"""Search over the strategy space (the space itself; the evolutionary search comes with the simulator)."""

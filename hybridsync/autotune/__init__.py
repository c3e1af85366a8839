"""Autotuning: search with the simulator, measure the best candidates, refit, confirm the winner."""

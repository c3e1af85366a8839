"""Trials: measured (model, cluster, strategy) -> step times, and the store that keeps them.

Kept free of heavy imports: ``hybridsync.trials.store`` needs only the standard library.
"""

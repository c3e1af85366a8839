"""The runtime simulator: analytic cost model + XGBoost, fit on measured trials (torch-free).

``Simulator`` (``simulator.py``) is the entry point; ``analytic.py`` holds the alpha-beta
model, ``encoding.py`` the array form of candidate strategies, ``features.py`` the learned
model's inputs and ``evaluate.py`` the metrics and held-out evaluation.
"""

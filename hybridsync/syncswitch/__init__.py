"""Sync-Switch (issue 14): BSP <-> ASP switching of the PS-routed variables in flight.

``policy.py`` (the strategy's ``sync`` section and the elastic straggler policy, pure),
``controller.py`` (each rank's side of a switch), ``tune.py`` and ``cli.py`` (choosing the
switch point offline), ``digits.py`` and ``evaluate.py`` (the evaluation task on the
emulated cluster). The servers' side is ``hybridsync/backends/ps/coordinator.py``.
"""

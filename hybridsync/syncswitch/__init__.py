"""Sync-Switch (issue 14) experiments: choosing and evaluating BSP <-> ASP switching of the PS variables.

``tune.py`` and ``cli.py`` (choosing the switch point offline), ``digits.py`` and
``evaluate.py`` (the evaluation task on the emulated cluster). The runtime side lives
elsewhere: the policy value in ``hybridsync/sync_policy.py``, each rank's controller in
``hybridsync/hooks/syncswitch.py``, the servers' in ``hybridsync/backends/ps/coordinator.py``.
"""

"""Everything that starts and stops jobs: ``hybridsync-run`` (``launcher``, which starts
horovodrun through ``horovodrun``: its build check without TensorFlow's log), jobs across an
emulated cluster (``emulated``, ``rendezvous``), child processes that never outlive their
owner (``procs``) and run configs (``config``)."""

"""Everything that starts and stops jobs: ``hybridsync-run`` (``launcher``), jobs across an
emulated cluster (``emulated``, ``rendezvous``), child processes that never outlive their
owner (``procs``) and run configs (``config``)."""

"""Everything that starts and stops jobs: ``hybridsync-run`` (``launcher``), jobs across an
emulated cluster (``emulated``, ``rendezvous``, ``cluster_cli``: ``hybridsync cluster``), child
processes that never outlive their owner (``procs``), run configs (``config``) and
``hybridsync profile`` (``profile``)."""

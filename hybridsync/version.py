"""hybridsync's version, in a module of its own so that any module can read it without importing the package's face."""
__version__ = "0.1.0"

RUNTIME_REVISION = 2
"""Raised whenever the runtime starts to send some strategy differently on some cluster, so that a
stored trial of it no longer measures what runs now. Every trial records it (``frameworks.versions``,
``"runtime"``); ``hybridsync.trials.revisions`` lists what each revision changed and so which stored
trials it outdates."""

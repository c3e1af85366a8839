"""The router: ``plan`` (pure data: pieces, messages, fingerprint) and ``runtime`` (hooks,
submit, wait, write back). It knows backends only through their protocol."""

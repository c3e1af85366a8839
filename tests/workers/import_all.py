"""Run with an installed hybridsync (``tests/test_install.py``): import each module named in
``argv[1]`` (a JSON list), and print, as one JSON line, the file each came from (or the
error) and the modules pkgutil finds installed, so that a module present in the wheel but
not in the source tree shows too."""
import importlib
import json
import pkgutil
import sys

import hybridsync

if __name__ == "__main__":
    found = {}
    for name in json.loads(sys.argv[1]):
        try:
            found[name] = importlib.import_module(name).__file__
        except Exception as e:  # noqa: BLE001 - reported for the test to judge
            found[name] = f"ERROR {type(e).__name__}: {e}"
    installed = ["hybridsync"] + [m.name for m in pkgutil.walk_packages(hybridsync.__path__, "hybridsync.")]
    print(json.dumps({"found": found, "installed": installed}))

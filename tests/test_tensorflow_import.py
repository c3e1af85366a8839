"""``import hybridsync`` never needs TensorFlow; ``import hybridsync.tensorflow`` without it says what is missing."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO

WITHOUT_TENSORFLOW = """
import sys
sys.modules["tensorflow"] = None  # "import tensorflow" raises ImportError, as where it is not installed
import hybridsync
assert hybridsync.Strategy.from_dict({"default": {"route": "ps"}}).default.route == "ps"
try:
    import hybridsync.tensorflow
except ImportError as error:
    print(error)
"""


@pytest.mark.multiprocess
def test_without_tensorflow_hybridsync_imports_and_its_tensorflow_module_says_what_is_missing():
    proc = subprocess.run([sys.executable, "-c", WITHOUT_TENSORFLOW], capture_output=True, text=True, timeout=120,
                          cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hybridsync.tensorflow needs TensorFlow" in proc.stdout and "make test" in proc.stdout, proc.stdout


@pytest.mark.multiprocess  # importing TensorFlow (the package's __init__) runs `uname -p`
def test_tensorflow_variable_names_are_unique_and_stable():
    pytest.importorskip("tensorflow", reason="TensorFlow is not installed here")
    from hybridsync.tensorflow.names import variable_name, variable_names

    class Variable:
        def __init__(self, name: str, path: str | None = None) -> None:
            self.name, self.path = name, path

    assert variable_name(Variable("dense/kernel:0")) == "dense/kernel"
    assert variable_name(Variable("kernel", path="dense_1/kernel")) == "dense_1/kernel"  # Keras 3
    names = variable_names([Variable("a:0"), Variable("a:0"), Variable("b:0"), Variable("a:0")])
    assert names == ["a", "a_1", "b", "a_2"] and len(set(names)) == len(names)

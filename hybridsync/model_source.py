"""Where ``load_model_variables`` (what a command's ``--model`` names) was: it lives in
``hybridsync.cli`` now, beside the commands that take ``--model``; this name keeps old imports working."""
from __future__ import annotations

from hybridsync.cli import load_model_variables

__all__ = ["load_model_variables"]

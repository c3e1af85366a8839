"""The old home of ``VariableInfo`` and of plain model description files: both live in
``hybridsync.description`` now (one home for model descriptions); these names keep old imports working."""
from __future__ import annotations

from hybridsync.description import (_ITEMSIZE, DTYPES, FLOATING_DTYPES, VariableInfo,  # noqa: F401
                                    itemsize, load_model_description, parse_model_description, parse_variable_entries,
                                    save_model_description, sparse_parameter_names, variables_from_model,
                                    variables_from_parameters)

__all__ = ["DTYPES", "FLOATING_DTYPES", "VariableInfo", "itemsize", "load_model_description", "parse_model_description",
           "parse_variable_entries", "save_model_description", "sparse_parameter_names", "variables_from_model",
           "variables_from_parameters"]

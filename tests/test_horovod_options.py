"""Horovod's groups/num_groups rules mapped onto merge groups (no Horovod job needed)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hybridsync.horovod_options import grouped_names, normalize_groups, strategy_with_groups
from hybridsync.router.plan import build_plan
from hybridsync.strategy import Strategy
from hybridsync.variables import variables_from_parameters

pytestmark = pytest.mark.unit


def model() -> nn.Module:
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 1))
    m[1].bias.requires_grad_(False)
    return m


def names_of(m: nn.Module) -> dict:
    return {p: name for name, p in m.named_parameters()}


def test_integer_groups_split_trainable_parameters_in_order_like_horovod():
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    # 5 trainable parameters (1.bias is frozen) in 2 groups: Horovod's split_list gives 3 + 2.
    assert grouped_names(2, opt.param_groups, names_of(m)) == [["0.weight", "0.bias", "1.weight"],
                                                               ["2.weight", "2.bias"]]


def test_listed_groups_keep_trainable_members_only():
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    groups = [[m[0].weight, m[1].bias], [m[1].bias.new_zeros(1)], [m[2].weight, m[2].bias]]
    assert grouped_names(groups, opt.param_groups, names_of(m)) == [["0.weight"], ["2.weight", "2.bias"]]


@pytest.mark.parametrize("groups, text", [(-1, "non-negative integer"), ([[1.0]], "torch.Tensor"),
                                          ("x", "non-negative integer")])
def test_bad_groups_are_value_errors(groups, text):
    with pytest.raises(ValueError, match=text):
        normalize_groups(groups, 0)


def test_repeated_parameter_in_groups_is_a_value_error():
    p = nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match="only appear once"):
        normalize_groups([[p], [p]], 0)


def test_num_groups_is_deprecated_spelling_of_groups():
    with pytest.warns(DeprecationWarning):
        assert normalize_groups(None, 3) == 3


def test_groups_become_merge_groups_after_the_strategys_own():
    strategy = Strategy.from_dict({"variables": {"2.weight": {"group": 4}, "2.bias": {"group": 4}}})
    merged = strategy_with_groups(strategy, [["0.weight", "0.bias"], ["1.weight"]])
    assert [merged.config_for(n).group for n in ("0.weight", "0.bias", "1.weight", "2.weight")] == [5, 5, 6, 4]
    plan = build_plan(variables_from_parameters(model().named_parameters()), merged)
    assert sorted(len(m.pieces) for m in plan.messages if m.name.startswith("hybridsync.group")) == [1, 2, 2]


def test_groups_clashing_with_strategy_groups_name_the_variables():
    strategy = Strategy.from_dict({"variables": {"0.weight": {"group": 1}, "2.bias": {"group": 1}}})
    with pytest.raises(ValueError, match="0.weight") as e:
        strategy_with_groups(strategy, [["0.weight", "0.bias"]])
    assert "2.bias" not in str(e.value)

"""The --nnodes precedence rule, as pure decisions: --nnodes > ELASTIC_NNODES > PET_NNODES > 1:1.

Milliseconds, no processes. tests/agent/test_nnodes_cli.py runs the same rule through a
real `elastic agent`.
"""

from __future__ import annotations

import pytest

from agent.node.nnodes import NNodesError, environment_nnodes, parse_nnodes, resolve_nnodes, settle_nnodes

KUBEFLOW_TRAINER = {"PET_NNODES": "2"}  # what Trainer v2's torch runtime injects for numNodes: 2


@pytest.mark.parametrize(("flag", "env", "value", "source"), [
    (None, {}, "1:1", "default"),
    (None, {"PET_NNODES": "1:4"}, "1:4", "PET_NNODES"),
    (None, {"ELASTIC_NNODES": "1:4"}, "1:4", "ELASTIC_NNODES"),
    (None, {"ELASTIC_NNODES": "1:4", "PET_NNODES": "2"}, "1:4", "ELASTIC_NNODES"),
    ("2:3", {"ELASTIC_NNODES": "1:4", "PET_NNODES": "2"}, "2:3", "--nnodes"),
    ("2:3", {}, "2:3", "--nnodes"),
    # empty counts as unset: a blank ConfigMap entry does not pin the job to nothing
    (None, {"ELASTIC_NNODES": "", "PET_NNODES": "2"}, "2", "PET_NNODES"),
    ("", {"ELASTIC_NNODES": " 1:4 "}, "1:4", "ELASTIC_NNODES"),
])
def test_the_most_explicit_setting_wins(flag: str | None, env: dict[str, str], value: str, source: str) -> None:
    chosen = resolve_nnodes(flag, env)
    assert (chosen.value, chosen.source) == (value, source)


def test_a_fixed_pet_nnodes_under_an_elastic_range_is_overridden_with_one_warning_naming_both() -> None:
    chosen = resolve_nnodes(None, {**KUBEFLOW_TRAINER, "ELASTIC_NNODES": "1:4"})
    assert (chosen.low, chosen.high) == (1, 4)
    assert chosen.warning is not None and "\n" not in chosen.warning
    assert "PET_NNODES=2" in chosen.warning and "ELASTIC_NNODES=1:4" in chosen.warning
    assert "elastic between 1 and 4 nodes" in chosen.warning

    by_flag = resolve_nnodes("1:4", KUBEFLOW_TRAINER)
    assert by_flag.warning is not None and "PET_NNODES=2" in by_flag.warning and "--nnodes 1:4" in by_flag.warning


@pytest.mark.parametrize(("flag", "env"), [
    (None, {"ELASTIC_NNODES": "1:4"}),  # no PET_NNODES at all
    (None, {"ELASTIC_NNODES": "1:4", "PET_NNODES": "1:4"}),  # the same range
    (None, {"ELASTIC_NNODES": "2", "PET_NNODES": "2:2"}),  # the same range, spelled differently
    (None, {"PET_NNODES": "2"}),  # PET_NNODES itself wins: nothing was overridden
    ("3", {}),
])
def test_no_warning_when_nothing_is_overridden(flag: str | None, env: dict[str, str]) -> None:
    assert resolve_nnodes(flag, env).warning is None


def test_a_pet_nnodes_that_differs_otherwise_is_still_named() -> None:
    chosen = resolve_nnodes("2", {"PET_NNODES": "1:4"})  # the user fixed the size on purpose
    assert chosen.value == "2" and chosen.warning == "PET_NNODES=1:4 is ignored: --nnodes 2 wins"
    garbage = resolve_nnodes(None, {"ELASTIC_NNODES": "1:4", "PET_NNODES": "two"})
    assert garbage.value == "1:4" and "PET_NNODES=two is not N or MIN:MAX" in str(garbage.warning)


@pytest.mark.parametrize(("flag", "env", "names"), [
    ("4:1", {}, "--nnodes '4:1': need 1 <= MIN <= MAX"),
    ("0", {}, "--nnodes '0': need 1 <= MIN <= MAX"),
    ("1:2:3", {}, "--nnodes '1:2:3' is not N or MIN:MAX"),
    (None, {"ELASTIC_NNODES": "one:four"}, "ELASTIC_NNODES 'one:four' is not N or MIN:MAX"),
    (None, {"PET_NNODES": "-1"}, "PET_NNODES '-1': need 1 <= MIN <= MAX"),
])
def test_a_bad_winner_is_one_line_naming_where_it_came_from_and_the_fix(
    flag: str | None, env: dict[str, str], names: str
) -> None:
    with pytest.raises(NNodesError) as caught:
        resolve_nnodes(flag, env)
    message = str(caught.value)
    assert message.startswith(names) and "\n" not in message
    assert "give N or MIN:MAX" in message


def test_a_bad_value_that_loses_does_not_stop_the_job() -> None:
    assert resolve_nnodes("1:2", {"ELASTIC_NNODES": "nonsense"}).value == "1:2"


def test_parse_nnodes() -> None:
    assert parse_nnodes("4", "x") == (4, 4)
    assert parse_nnodes(" 1:4 ", "x") == (1, 4)


def test_after_argparse_a_value_other_than_the_environments_came_from_the_flag() -> None:
    env = {**KUBEFLOW_TRAINER, "ELASTIC_NNODES": "1:4"}
    assert environment_nnodes(env) == "1:4"
    assert settle_nnodes("1:4", env).source == "ELASTIC_NNODES"  # the parser's default: no flag
    by_flag = settle_nnodes("2", env)  # `--nnodes 2`: the user fixed it; PET_NNODES agrees
    assert (by_flag.source, by_flag.value, by_flag.warning) == ("--nnodes", "2", None)
    assert environment_nnodes({}) == "1:1" and settle_nnodes("1:1", {}).source == "default"

"""What :mod:`elastic.inplace.gloo_private` relies on in torch's private gloo options.

If this fails after a torch upgrade, ``ELASTIC_HEAL_IFNAME`` must be re-checked: heals would
fall back to the collectives' own link (with one warning). One process, in milliseconds.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from elastic.inplace import gloo_private, heal_link
from elastic.inplace.heal_link import GroupWire


def test_this_torch_binds_a_gloo_group_to_an_interface() -> None:
    assert gloo_private.unsupported_reason() is None
    group = gloo_private.group_on(dist.HashStore(), 0, 1, "lo", timedelta(seconds=5))
    value = torch.tensor([3.0])
    group.allreduce([value]).wait()
    assert group.size() == 1 and value.item() == 3.0


def test_an_interface_that_does_not_exist_is_an_error_not_a_silent_default() -> None:
    with pytest.raises(RuntimeError):
        gloo_private.group_on(dist.HashStore(), 0, 1, "no-such-if0", timedelta(seconds=5))


def test_a_torch_without_the_options_heals_over_the_collectives_link_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Stands in for a future torch: the attribute cannot be removed from the real one otherwise.
    monkeypatch.setattr(dist, "ProcessGroupGloo", SimpleNamespace(create_device=lambda **_: None))
    monkeypatch.setattr(heal_link, "_warned", False)
    monkeypatch.setenv("ELASTIC_HEAL_IFNAME", "lo")
    assert "no _Options" in (gloo_private.unsupported_reason() or "")
    with caplog.at_level(logging.WARNING, logger="elastic.trainer"):
        for _ in range(2):
            wire = heal_link.open_wire({1: 0}, 0, torch.device("cpu"), "gloo", dist.HashStore(), "1",
                                       timedelta(seconds=5))
            assert isinstance(wire, GroupWire)
    warned = [r.getMessage() for r in caplog.records if "ELASTIC_HEAL_IFNAME=lo is not used" in r.getMessage()]
    assert len(warned) == 1, warned

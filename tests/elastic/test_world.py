"""Which world a run trains in, and what each answers where the two recovery paths differ.

Milliseconds: no process group is made. The worlds' behaviour with real agents is in
tests/elastic/inplace (in place) and tests/agent/test_recovery.py (torchrun's world).
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch.distributed as dist

from elastic import contract
from elastic.fixed_world import FixedWorld
from elastic.inplace.channel import WorkerChannel
from elastic.inplace.in_place_world import InPlaceWorld
from elastic.world import TrainingWorld, choose_world


def a_run(world_size: int = 2) -> types.SimpleNamespace:
    return types.SimpleNamespace(dist=types.SimpleNamespace(world_size=world_size, rank=0, is_main=True),
                                 _where="[a rank 0]")


def test_plain_torchrun_or_in_place_off_trains_in_torchruns_world(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(contract.CONTROL_DIR_ENV, raising=False)
    assert isinstance(choose_world(a_run(), "gloo", 30.0, None, True), FixedWorld)  # type: ignore[arg-type]
    monkeypatch.setenv(contract.CONTROL_DIR_ENV, str(tmp_path))
    assert isinstance(choose_world(a_run(), "gloo", 30.0, False, True), FixedWorld)  # type: ignore[arg-type]


def test_under_elastic_agent_with_a_torch_that_reconfigures_the_world_is_in_place(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(contract.CONTROL_DIR_ENV, str(tmp_path))
    world = choose_world(a_run(), "gloo", 30.0, None, True)  # type: ignore[arg-type]
    assert isinstance(world, InPlaceWorld) and world.backend == "gloo"
    assert not world.restarts_from_disk and not world.in_setup_world


def test_a_torch_without_the_reconfigure_api_gets_torchruns_world_and_tells_the_agent_why(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(contract.CONTROL_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delattr(dist, "_reconfigure", raising=False)  # as on an older torch (test_fallback: with agents)
    world = choose_world(a_run(), "gloo", 30.0, None, True)  # type: ignore[arg-type]
    assert isinstance(world, FixedWorld)
    status = json.loads((tmp_path / contract.worker_status_file(0)).read_text())
    assert status["mode"] == "restart" and "_reconfigure" in status["reason"]


def test_torchruns_world_agrees_only_on_a_stop_and_never_offers_a_world_to_switch_to(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(contract.ROUND_ENV, "4")
    pair, alone = FixedWorld(a_run(2), "gloo", 30.0, True), FixedWorld(a_run(1), "gloo", 30.0, True)  # type: ignore[arg-type]
    assert pair.round == 4 and pair.restarts_from_disk
    assert pair.control_value(agree_stop=True) == 0 and pair.control_value(agree_stop=False) is None
    assert alone.control_value(agree_stop=True) is None  # a world of one decides a stop alone
    assert pair.replaced_by() is None and not any(pair.offers(ready) for ready in (-1, 0, 4, 5, 99))
    with pytest.raises(NotImplementedError):
        pair.switch(5)


def test_torchruns_world_ends_the_worker_with_exit_1_when_a_peer_is_lost(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    with pytest.raises(SystemExit) as exit_info:
        FixedWorld(a_run(2), "gloo", 30.0, True).lost_peer(7, "its connection closed", "")  # type: ignore[arg-type]
    assert exit_info.value.code == 1
    assert "lost a peer in step 7 (its connection closed)" in (tmp_path / "error.json").read_text()


def test_the_in_place_world_always_agrees_on_the_newest_ready_round_and_switches_only_to_a_newer_one(
        tmp_path: Path) -> None:
    world = InPlaceWorld(a_run(), WorkerChannel(tmp_path, 0), "gloo", 30.0, True)  # type: ignore[arg-type]
    assert world.round == -1 and world.replaced_by() is None
    assert world.control_value(agree_stop=False) == 0  # rounds are agreed on every step, a stop or not
    assert world.offers(0) and world.offers(3) and not world.offers(-1)


def test_every_world_answers_every_moment_of_the_run() -> None:
    abstract = {name for name, value in vars(TrainingWorld).items() if getattr(value, "__isabstractmethod__", False)}
    assert abstract == {"round", "connect", "start", "control_value", "lost_peer", "peers_stopped", "close"}
    for world in (FixedWorld, InPlaceWorld):
        assert not world.__abstractmethods__, world

"""Which world a run trains in, and what each answers where the two recovery paths differ.

Milliseconds: no process group is made. The worlds' behaviour with real agents is in
tests/elastic/inplace (in place) and tests/agent/test_recovery.py (torchrun's world).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic import contract
from elastic.fixed_world import FixedWorld
from elastic.inplace.channel import WorkerChannel
from elastic.inplace.in_place_world import InPlaceWorld
from elastic.distributed import DistInfo
from elastic.formation import Holding, Source, StatePlan
from elastic.grad_sync import CollectiveFailure
from elastic.world import TrainingWorld, choose_world


def test_plain_torchrun_or_in_place_off_trains_in_torchruns_world(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(contract.CONTROL_DIR_ENV, raising=False)
    assert isinstance(choose_world("gloo", 30.0, None, True), FixedWorld)
    monkeypatch.setenv(contract.CONTROL_DIR_ENV, str(tmp_path))
    assert isinstance(choose_world("gloo", 30.0, False, True), FixedWorld)


def test_under_elastic_agent_with_a_torch_that_reconfigures_the_world_is_in_place(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(contract.CONTROL_DIR_ENV, str(tmp_path))
    world = choose_world("gloo", 30.0, None, True)
    assert isinstance(world, InPlaceWorld) and world.backend == "gloo"
    assert not world.restarts_from_disk and not world.in_setup_world


def test_a_torch_without_the_reconfigure_api_gets_torchruns_world_and_tells_the_agent_why(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(contract.CONTROL_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delattr(dist, "_reconfigure", raising=False)  # as on an older torch (test_fallback: with agents)
    world = choose_world("gloo", 30.0, None, True)
    assert isinstance(world, FixedWorld)
    status = json.loads((tmp_path / contract.worker_status_file(0)).read_text())
    assert status["mode"] == "restart" and "_reconfigure" in status["reason"]


def test_torchruns_world_agrees_only_on_a_stop_and_never_offers_a_world_to_switch_to(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(contract.ROUND_ENV, "4")
    world = FixedWorld("gloo", 30.0, True)
    assert world.round == 4 and world.restarts_from_disk
    assert world.control_value(agree_stop=True, world_size=2) == 0
    assert world.control_value(agree_stop=False, world_size=2) is None
    assert world.control_value(agree_stop=True, world_size=1) is None  # a world of one decides a stop alone
    assert world.replaced_by() is None and not any(world.offers(ready) for ready in (-1, 0, 4, 5, 99))
    with pytest.raises(CollectiveFailure, match="a peer was lost while torchrun's world formed"):
        world.incomplete("a member died")  # torchrun's world never forms again in the same process


def test_torchruns_world_ends_the_worker_with_exit_1_when_a_peer_is_lost(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    with pytest.raises(SystemExit) as exit_info:
        FixedWorld("gloo", 30.0, True).lost_peer(7, "its connection closed", "", "[a rank 0]")
    assert exit_info.value.code == 1
    assert "lost a peer in step 7 (its connection closed)" in (tmp_path / "error.json").read_text()


def test_the_in_place_world_always_agrees_on_the_newest_ready_round_and_switches_only_to_a_newer_one(
        tmp_path: Path) -> None:
    world = InPlaceWorld(WorkerChannel(tmp_path, 0), "gloo", 30.0, True)
    assert world.round == -1 and world.replaced_by() is None
    assert world.control_value(agree_stop=False, world_size=2) == 0  # rounds are agreed on every step, a stop or not
    assert world.offers(0) and world.offers(3) and not world.offers(-1)


def test_every_world_answers_every_moment_of_the_run() -> None:
    abstract = {name for name, value in vars(TrainingWorld).items() if getattr(value, "__isabstractmethod__", False)}
    assert abstract == {"round", "connect", "join", "plan", "control_value", "lost_peer", "peers_stopped", "close"}
    for world in (FixedWorld, InPlaceWorld):
        assert not world.__abstractmethods__, world


def test_torchruns_world_plans_a_restore_from_disk_on_every_rank_and_a_fresh_start_without_a_heal() -> None:
    world = FixedWorld("gloo", 30.0, True)
    info = DistInfo(1, 2, 0, torch.device("cpu"), "gloo", "a")
    world._info = info
    assert world.join(0).dist == info and not world.join(0).rendezvous
    plan = world.plan(Holding(rank=1, has_state=True, step=9), info)
    assert plan.source is Source.DISK and plan.check_same_step and plan.init_sync
    fresh = plan.fresh(4)
    assert fresh.source is Source.FRESH and fresh.sources == {} and fresh.init_sync  # DDP's broadcast aligns it


def test_in_place_an_empty_disk_means_rank_0s_fresh_state_is_sent_to_every_other_rank() -> None:
    fresh = StatePlan(Source.DISK, fresh_from_rank0=True).fresh(3)
    assert fresh == StatePlan(Source.FRESH, step=0, sources={1: 0, 2: 0})
    assert fresh.healed == [1, 2] and fresh.senders() == [0]


def test_no_world_imports_the_run() -> None:
    """A world answers with records (elastic.formation) and never reaches into ElasticRun:
    none of them imports the trainer, even for a type (no cycle trainer -> world -> trainer)."""
    root = Path(__file__).resolve().parents[2] / "elastic"
    for path in ("world.py", "fixed_world.py", "formation.py", "inplace/in_place_world.py"):
        tree = ast.parse((root / path).read_text())
        imported = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not any(name.endswith("trainer") for name in imported), (path, imported)
        names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        assert "run" not in names and "ElasticRun" not in names, path  # no run handed in, nothing of it read

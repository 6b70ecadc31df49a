"""The loop's registered state, run.rank & co, the step result and a script's own DDP: no processes.

What a user would check: a dict the loop holds is the very object that gets the restored
values (no stale reference), a best-loss kept in a holder comes back, what snapshots cannot
store is refused at ``register`` with one line naming the entry, the state reaches a file
and the heal's wire format and comes back, ``RANK`` follows a re-formation, and
``run.step(loss)`` says whether the batch was trained. The last tests run a real
``ElasticRun`` in a world of one inside this process (gloo over a file store): a resume
from disk gives the registered dict the values of the step the snapshot holds.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from checkpoints import SnapshotStore
from checkpoints.wire import decode, encode
from elastic.distributed import ElasticRunError
from elastic.inplace.channel import RoundOffer
from elastic.inplace.membership import World, _place
from elastic.jobs.mlp import SyntheticClassification, as_batch
from elastic.own_group import taken_over_line, unwrap_ddp
from elastic.sampler import ElasticSampler
from elastic.step_result import StepResult
from elastic.train_state import TrainState
from elastic.user_state import Holder, UserState
from elastic.worker_env import Place, rank_env, update_env

# ---------------------------------------------------------------------- registration and restore


def test_a_registered_dict_is_restored_in_place_so_the_loops_own_reference_sees_it() -> None:
    counters = {"epoch": 0, "steps": 0, "loss_sum": 0.0}
    user = UserState()
    assert user.register("counters", counters) is counters
    saved = user.capture()
    counters.update(steps=7, loss_sum=3.5, stray=1)  # the loop goes on after the capture
    assert saved == {"counters": {"epoch": 0, "steps": 0, "loss_sum": 0.0}}, "capture must be a copy"
    user.restore({"counters": {"epoch": 2, "steps": 40, "loss_sum": 12.25}})
    assert counters == {"epoch": 2, "steps": 40, "loss_sum": 12.25}  # same object, survivors' values, no stray key


def test_a_list_and_a_tensor_are_restored_in_place() -> None:
    history: list[float] = [1.0, 2.0]
    acc = torch.zeros(3)
    user = UserState()
    user.register("history", history)
    user.register("acc", acc)
    user.restore({"history": [0.5, 0.25, 0.125], "acc": torch.tensor([1.0, 2.0, 3.0])})
    assert history == [0.5, 0.25, 0.125]
    assert acc.tolist() == [1.0, 2.0, 3.0]


def test_objects_with_state_dict_a_holder_and_an_ema_model_travel_through_their_state_dicts() -> None:
    best = Holder(math.inf)
    ema = nn.Linear(3, 2)
    user = UserState()
    user.register("best", best)
    user.register("ema", ema)
    donor = nn.Linear(3, 2)
    user.restore({"best": {"value": 0.125}, "ema": donor.state_dict()})
    assert best.value == 0.125
    assert torch.equal(ema.weight, donor.weight) and torch.equal(ema.bias, donor.bias)


def test_restored_values_wait_for_a_name_registered_later() -> None:
    """A joiner is healed while its ElasticRun is built, before its script registers anything."""
    user = UserState()
    user.restore({"counters": {"steps": 40}})
    counters = user.register("counters", {"steps": 0})
    assert counters == {"steps": 40}
    user.register("other", {"x": 1})  # nothing restored for it: it keeps its own value
    assert user.capture() == {"counters": {"steps": 40}, "other": {"x": 1}}


def test_a_snapshot_without_user_state_leaves_registered_values_alone() -> None:
    counters = {"steps": 3}
    user = UserState()
    user.register("counters", counters)
    user.restore(None)
    assert counters == {"steps": 3}


def test_a_tensor_in_a_dict_goes_back_to_the_device_of_the_one_it_replaces() -> None:
    device = torch.device("meta")  # stands for a GPU: any device but the CPU the heal delivers to
    stats = {"loss_sum": torch.zeros((), device=device)}
    user = UserState()
    user.register("stats", stats)
    user.restore({"stats": {"loss_sum": torch.tensor(2.5)}})
    assert stats["loss_sum"].device == device


@pytest.mark.parametrize("value", [0.0, 3, "text"])
def test_a_plain_value_is_refused_with_the_idiom_that_works(value: Any) -> None:
    with pytest.raises(ElasticRunError) as err:
        UserState().register("best", value)
    message = str(err.value)
    assert "in place" in message and "Holder" in message and "{'value':" in message


def test_what_snapshots_cannot_hold_is_refused_at_register_naming_the_entry() -> None:
    class Opaque:
        pass

    with pytest.raises(ElasticRunError, match=r"registered state 'stats'\['when'\]"):
        UserState().register("stats", {"when": Opaque()})
    with pytest.raises(ElasticRunError, match="a .*Opaque has no state_dict"):
        UserState().register("opaque", Opaque())


def test_a_name_is_registered_once_per_object() -> None:
    user = UserState()
    counters: dict[str, int] = {}
    user.register("counters", counters)
    assert user.register("counters", counters) is counters  # again, the same object: fine
    with pytest.raises(ElasticRunError, match="registered already"):
        user.register("counters", {})
    with pytest.raises(ElasticRunError, match="non-empty str"):
        user.register("", {})


def test_a_restore_that_does_not_fit_says_which_name() -> None:
    user = UserState()
    user.register("ema", nn.Linear(3, 2))
    with pytest.raises(ElasticRunError, match="registered state 'ema' does not match"):
        user.restore({"ema": nn.Linear(4, 2).state_dict()})


# ---------------------------------------------------------------------- the run's state tree


def _train_state() -> TrainState:
    model = nn.Linear(4, 2)
    return TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), ElasticSampler(32, seed=0))


def test_registered_state_rides_in_the_trees_heal_and_snapshot_carry() -> None:
    sender, receiver = _train_state(), _train_state()
    sender.user.register("counters", {"epoch": 1, "loss_sum": torch.tensor(4.5)})
    sender.user.register("best", Holder(0.75))
    mine = receiver.user.register("counters", {"epoch": 0, "loss_sum": torch.tensor(0.0)})
    best = receiver.user.register("best", Holder(math.inf))
    tree = sender.capture()
    assert set(tree["user"]) == {"counters", "best"}

    tensors: list[torch.Tensor] = []
    wired = decode(encode(tree, lambda t: tensors.append(t) or len(tensors) - 1), tensors)  # the heal's format
    receiver.load(wired)
    assert mine["epoch"] == 1 and float(mine["loss_sum"]) == 4.5 and best.value == 0.75


def test_registered_state_survives_a_snapshot_on_disk(tmp_path: Path) -> None:
    state = _train_state()
    state.user.register("counters", {"epoch": 2, "steps": [1, 2, 3], "loss_sum": torch.tensor(1.5)})
    store = SnapshotStore(tmp_path, keep=2)
    store.save(5, state.capture(), world_size=1)
    _, loaded = store.load_latest()
    fresh = _train_state()
    counters = fresh.user.register("counters", {"epoch": 0, "steps": [], "loss_sum": torch.tensor(0.0)})
    fresh.load(loaded)
    assert counters["epoch"] == 2 and counters["steps"] == [1, 2, 3] and float(counters["loss_sum"]) == 1.5


def test_nothing_registered_adds_nothing_to_the_tree() -> None:
    assert "user" not in _train_state().capture()


# ---------------------------------------------------------------------- RANK and the like


def test_the_environment_follows_the_world_a_worker_is_in_now() -> None:
    env = {"RANK": "2", "WORLD_SIZE": "3", "GROUP_RANK": "2", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    changed = update_env(Place(rank=0, world_size=2, group_rank=0, group_world_size=2, local_world_size=1, round=7),
                         env)
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "2" and env["GROUP_RANK"] == "0"
    assert env["ROLE_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "2" and env["ELASTIC_ROUND"] == "7"
    assert env["LOCAL_RANK"] == "0" and "LOCAL_WORLD_SIZE" not in changed  # unchanged values are not rewritten
    assert "MASTER_PORT" not in rank_env(Place(0, 1, 0, 1, 1))


def test_the_place_comes_from_the_agents_offer() -> None:
    offer = RoundOffer(round=9, participants=("b", "c"), node_rank=1, rank_base=2, world_size=4, store="h:1",
                       nprocs=(2, 2))
    place = _place(offer, World(9, 3, 4, ("b", "c")))
    assert place == Place(rank=3, world_size=4, group_rank=1, group_world_size=2, local_world_size=2, round=9)


# ---------------------------------------------------------------------- the step result


def test_the_step_result_is_true_only_when_the_batch_was_trained() -> None:
    assert StepResult(True, 12, 0)
    assert not StepResult(False, 12, 0)
    assert StepResult(True, 32, 0, epoch_end=True).epoch_end


# ---------------------------------------------------------------------- a real run, world of one, in this process


def _run(tmp: Path, model: nn.Module, steps: int) -> Any:
    from elastic.run_config import DataConfig, SnapshotConfig
    from elastic.trainer import ElasticRun

    torch.manual_seed(0)
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return ElasticRun(model, torch.optim.SGD(inner.parameters(), lr=0.1), SyntheticClassification(40, seed=1),
                      global_batch_size=8, steps=steps, snapshot_dir=tmp / "snap",
                      snapshots=SnapshotConfig(every_steps=3, writer="thread"), metrics=False,
                      data=DataConfig(collate_fn=as_batch), handle_sigterm=False)


def _loop(run: Any, counters: dict[str, Any], results: list[StepResult]) -> None:
    for x, y in run:
        loss = F.cross_entropy(run.model(x), y)
        result = run.step(loss)
        results.append(result)
        if result:
            counters["steps"] += 1
            counters["loss_sum"] += float(loss.detach())
            if result.epoch_end:
                counters["epochs"] += 1


def test_a_run_reports_each_step_and_a_resume_from_disk_restores_the_loops_dict(world_of_one: None,
                                                                                tmp_path: Path) -> None:
    torch.manual_seed(0)
    run = _run(tmp_path, nn.Linear(16, 4), steps=6)
    assert (run.rank, run.local_rank, run.world_size, run.is_main, run.epoch) == (0, 0, 1, True, 0)
    counters = run.register("counters", {"steps": 0, "epochs": 0, "loss_sum": 0.0})
    results: list[StepResult] = []
    _loop(run, counters, results)
    assert [r.step for r in results] == [1, 2, 3, 4, 5, 6] and all(results)
    assert [r.epoch_end for r in results] == [False, False, False, False, True, False]  # 40 samples, batches of 8
    assert run.epoch == 1
    at_six = dict(counters)

    again = _run(tmp_path, nn.Linear(16, 4), steps=8)  # resumes from the final snapshot, step 6
    assert again.step_count == 6
    mine = {"steps": 0, "epochs": 0, "loss_sum": 0.0}
    assert again.register("counters", mine) is mine and mine == at_six
    _loop(again, mine, [])
    assert mine["steps"] == 8 and mine["epochs"] == 1


def test_a_plain_number_registered_with_a_run_is_one_error_line(world_of_one: None, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path, nn.Linear(16, 4), steps=2)
    with pytest.raises(SystemExit) as exit_info:
        run.register("best", 0.5)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("error: run.register('best', 0.5)") == 1


def test_a_ddp_the_script_built_is_unwrapped_and_its_calls_reach_the_runs_own(world_of_one: None,
                                                                             tmp_path: Path) -> None:
    torch.manual_seed(0)
    mine = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
    before = mine.module.weight.detach().clone()
    run = _run(tmp_path, mine, steps=2)
    assert run.model is not mine and run.model.module is mine.module
    for x, y in run:
        assert torch.equal(mine(x), run.model(x))
        assert run.step(F.cross_entropy(mine(x), y))  # the loop may keep calling its own wrapper
    assert run.step_count == 2 and not torch.equal(mine.module.weight, before)


def test_unwrapping_leaves_a_plain_module_alone_and_the_line_says_what_was_taken() -> None:
    plain = nn.Linear(2, 2)
    assert unwrap_ddp(plain, object()) == (plain, False)
    line = taken_over_line(True, "gloo, world of 3")
    assert "process group (gloo, world of 3) was replaced by an in-place one" in line and "unwrapped" in line

"""The replica check's pure parts: the fingerprint, the vote, the line, the setting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elastic.consistency import fingerprint as fp_module
from elastic.consistency.check import Mismatch, describe
from elastic.consistency.fingerprint import HASH_TENSOR, METHOD, fingerprint, tensor_hash
from elastic.consistency.inject import flip_bit, target
from elastic.consistency.report import check_interval
from elastic.consistency.vote import vote
from elastic.distributed import ElasticRunError


def test_torch_hash_tensor_is_what_the_fingerprint_assumes() -> None:
    """Fails loudly if torch drops or changes ``hash_tensor``: ranks on different torch
    builds would then compare different functions (the vote tells them apart by METHOD)."""
    assert METHOD == HASH_TENSOR, "torch.hash_tensor is gone: the replica check fell back to BLAKE2b"
    t = torch.arange(10, dtype=torch.float32)
    assert int(torch.hash_tensor(t)) == 4609997168567123968  # XOR of the float64 bits (torch 2.14.1)
    assert tensor_hash(t).dtype == torch.int64 and tensor_hash(t).dim() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])
def test_any_single_flipped_bit_changes_the_hash(dtype: torch.dtype) -> None:
    t = (torch.randn(64, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    before = int(tensor_hash(t))
    for bit in range(t.element_size() * 8):
        u = t.clone()
        flip_bit(u, 5, bit)
        if torch.isnan(u).any() and not torch.isnan(t).any() and dtype != torch.float64:
            continue  # a NaN payload may canonicalise when upcast: NaNs are the non-finite check's
        assert int(tensor_hash(u)) != before, f"{dtype} bit {bit}"


def test_fallback_hash_sees_a_flip_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp_module, "METHOD", fp_module.BLAKE2B)
    t = torch.randn(8)
    u = t.clone()
    flip_bit(u, 0, 0)
    assert int(tensor_hash(t)) != int(tensor_hash(u))


def _model_and_adam() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_fingerprint_names_the_entry_and_group_that_differ() -> None:
    model, opt = _model_and_adam()
    a = fingerprint(model, opt, {"ema": torch.zeros(2), "best": {"loss": 1.5}})
    flip_bit(target(model, opt, "1.weight.exp_avg_sq"), 0, 3)
    b = fingerprint(model, opt, {"ema": torch.zeros(2), "best": {"loss": 1.5}})
    assert b.differing(a) == ["1.weight.exp_avg_sq"]
    assert a.digests()[1] == b.digests()[1] and a.digests()[2] != b.digests()[2] and a.digests()[3] == b.digests()[3]
    c = fingerprint(model, opt, {"ema": torch.zeros(2), "best": {"loss": 1.25}})
    assert c.differing(b) == ["registered 'best'['loss']"]


def test_a_swap_of_two_equal_shaped_tensors_changes_the_digest() -> None:
    """Each tensor's hash is order-blind within it (XOR); the digest is not, across tensors."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a = fingerprint(model, opt, None).digests()
    with torch.no_grad():
        first, second = model[0].bias.clone(), model[1].bias.clone()
        model[0].bias.copy_(second)
        model[1].bias.copy_(first)
    assert fingerprint(model, opt, None).digests() != a


def test_vote_names_the_outlier_or_everyone() -> None:
    ok, bad = [1, 10, 20, 30], [1, 10, 21, 30]
    assert vote([ok, ok, ok]).agreed
    v = vote([ok, bad, ok])
    assert not v.agreed and v.majority == (0, 2) and v.suspects == (1,)
    v = vote([ok, bad])
    assert not v.agreed and v.majority == () and v.suspects == (0, 1)
    v = vote([ok, bad, ok, bad])  # an even split: no side is trusted
    assert v.suspects == (0, 1, 2, 3) and not v.has_majority
    v = vote([ok, bad, [1, 10, 22, 30], ok, ok])
    assert v.majority == (0, 3, 4) and v.suspects == (1, 2)
    v = vote([ok, [2, 10, 20, 30]])  # one rank hashes another way: not comparable, not corruption
    assert v.agreed and v.methods_differ


def test_the_line_names_node_tensors_step_and_the_way_back() -> None:
    m = Mismatch(12, 8, vote([[1, 0], [1, 1], [1, 0]]), ["a", "b", "c"], {1: ["0.weight", "0.bias"]})
    assert describe(m) == ("silent data corruption at step 12: node b (rank 1; differs in 0.weight, 0.bias) "
                           "disagrees with the majority of 2 of 3 replicas; every replica returns to step 8, the "
                           "last state all agreed on, and retrains 4 step(s)")
    m = Mismatch(9, 8, vote([[1, 0], [1, 1]]), ["a", "b"], {0: ["x"], 1: ["x"]})
    assert "no majority decides; node a (rank 0) and node b (rank 1) are all suspects (differing: x)" in describe(m)


def test_the_interval_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASTIC_CHECK_EVERY_STEPS", raising=False)
    assert check_interval(None) == 100 and check_interval(0) == 0 and check_interval(7) == 7
    monkeypatch.setenv("ELASTIC_CHECK_EVERY_STEPS", "25")
    assert check_interval(None) == 25 and check_interval(3) == 3
    for bad in ("x", "-1"):
        monkeypatch.setenv("ELASTIC_CHECK_EVERY_STEPS", bad)
        with pytest.raises(ElasticRunError, match="ELASTIC_CHECK_EVERY_STEPS"):
            check_interval(None)
    with pytest.raises(ElasticRunError, match="check_every_steps"):
        check_interval(-3)


def test_flip_bit_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="empty"):
        flip_bit(torch.zeros(0))
    with pytest.raises(ValueError, match="outside"):
        flip_bit(torch.zeros(2), 0, 32)
    model, opt = _model_and_adam()
    with pytest.raises(KeyError, match="no parameter"):
        target(model, opt, "nope.exp_avg")


def test_an_sdc_command_round_trips_and_a_bad_one_is_refused() -> None:
    from agent.node.commands import SDC, Command

    c = Command(SDC, 0.0, 1.7e9, "0.weight.exp_avg_sq")
    assert Command.from_json(c.to_json()) == c
    for bad in ('{"action": "sdc", "issued_at": 1.0, "what": 3}', '{"action": "sdc", "issued_at": 1.0, "what": ""}',
                '{"action": "sdc", "issued_at": 1.0, "what": "' + "x" * 201 + '"}'):
        with pytest.raises(ValueError, match="tensor name"):
            Command.from_json(bad.encode())


def test_a_flip_request_is_taken_once_and_a_bad_one_is_one_line(
        tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from elastic.consistency.inject import FlipRequests, request_flip

    monkeypatch.setenv("ELASTIC_HEARTBEAT_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    model, opt = _model_and_adam()
    requests = FlipRequests()
    before = fingerprint(model, opt, None)
    requests.poll(model, opt, 5, "[n rank 0]")  # nothing asked: nothing done
    assert fingerprint(model, opt, None).hashes == before.hashes
    path = request_flip(tmp_path, 0, "1.weight.exp_avg")
    requests.poll(model, opt, 5, "[n rank 0]")
    assert not path.exists() and fingerprint(model, opt, None).differing(before) == ["1.weight.exp_avg"]
    assert "flipped bit 22 of element 0 of 1.weight.exp_avg after step 5" in caplog.text
    request_flip(tmp_path, 0, "no.such")
    requests.poll(model, opt, 6, "[n rank 0]")
    assert "fault injection request not carried out" in caplog.text


def test_a_flip_request_answers_with_the_tensor_it_changed_or_the_tensors_there_are(
        tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``elastic inject-sdc`` prints, through the agent: the worker's own answer. A tensor
    that does not exist was one ERROR line in the worker's log and the command said nothing
    (exit 0); the default was called ``first`` in every line, never by its name."""
    from elastic.consistency.inject import FlipRequests, request_flip, take_flip_result

    monkeypatch.setenv("ELASTIC_HEARTBEAT_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    model, opt = _model_and_adam()
    requests = FlipRequests()
    assert take_flip_result(tmp_path) is None
    request_flip(tmp_path, 0, "no.such", request_id=1.5)
    before = fingerprint(model, opt, None)
    requests.poll(model, opt, 6, "[n rank 0]")
    answer = take_flip_result(tmp_path)
    assert answer is not None and answer["id"] == 1.5 and answer["done"] is False
    assert answer["line"] == ("[n rank 0] did not carry it out: no parameter or optimizer state named 'no.such'; "
                              "parameters: 0.weight, 0.bias, 1.weight, 1.bias; optimizer state: "
                              "<parameter>.{exp_avg,exp_avg_sq,step}, e.g. 0.weight.exp_avg"), answer
    assert fingerprint(model, opt, None).hashes == before.hashes and take_flip_result(tmp_path) is None
    request_flip(tmp_path, 0, "first", "nan", request_id=2.5)
    requests.poll(model, opt, 7, "[n rank 0]")
    assert take_flip_result(tmp_path) == {
        "id": 2.5, "done": True, "line": "[n rank 0] wrote a NaN into element 0 of 0.weight after step 7"}
    assert fingerprint(model, opt, None).differing(before) == ["0.weight"]


def test_kill_and_freeze_commands_are_unchanged() -> None:
    from agent.node.commands import FREEZE, KILL, Command

    for c in (Command(KILL, 0.0, 1.7e9), Command(FREEZE, 3.0, 1.7e9)):
        assert Command.from_json(c.to_json()) == c and b"what" not in c.to_json()


def test_a_check_is_due_every_n_steps_and_before_every_snapshot_by_steps() -> None:
    from elastic.consistency.check import ReplicaCheck

    check = ReplicaCheck(100, snapshot_every_steps=30)
    assert [s for s in range(1, 201) if check.due(s)] == [30, 60, 90, 100, 120, 150, 180, 200]
    assert not any(ReplicaCheck(0, snapshot_every_steps=30).due(s) for s in range(1, 100))  # off is off
    assert [s for s in range(0, 9) if ReplicaCheck(4).due(s)] == [4, 8]


def test_a_non_finite_replica_is_the_outlier_and_all_non_finite_is_divergence() -> None:
    ok, nan = [1, 10, 20, 30], [1, 11, 20, 30]
    v = vote([ok, nan], [False, True])  # two replicas: the finite one is right
    assert not v.agreed and v.majority == (0,) and v.suspects == (1,) and v.nonfinite == (1,)
    v = vote([ok, ok, ok], [False, False, True])  # a NaN whose bits hash alike is still named
    assert not v.agreed and v.majority == (0, 1) and v.suspects == (2,)
    v = vote([ok, nan, [1, 12, 20, 30]], [False, False, True])  # no majority among the finite
    assert not v.has_majority and v.suspects == (0, 1, 2)
    for rows in ([ok, ok], [ok, nan]):  # NaN everywhere, whatever its bits: diverged, nobody named
        v = vote(rows, [True, True])
        assert v.diverged and not v.agreed and v.suspects == () and v.majority == ()
    assert vote([ok, ok], [False, False]).agreed and vote([ok, ok]).agreed


@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_fingerprint_flags_a_non_finite_value_anywhere(kind: str) -> None:
    from elastic.consistency.fingerprint import nonfinite_entries
    from elastic.consistency.inject import poison

    model, opt = _model_and_adam()
    assert fingerprint(model, opt, {"ema": torch.zeros(2)}).finite
    for what in ("0.bias", "1.weight.exp_avg_sq"):
        m, o = _model_and_adam()
        poison(target(m, o, what), kind)
        assert not fingerprint(m, o, None).finite and nonfinite_entries(m, o, None) == [what]
    ema = torch.zeros(2)
    ema[1] = float(kind)
    assert not fingerprint(model, opt, {"ema": ema}).finite
    assert nonfinite_entries(model, opt, {"ema": ema}) == ["registered 'ema'"]
    big = torch.full((4,), 3e38)  # finite values whose float32 sum would overflow: still finite
    assert fingerprint(model, opt, {"big": big}).finite


def test_poison_refuses_what_it_cannot_do() -> None:
    from elastic.consistency.inject import poison

    with pytest.raises(ValueError, match="int64"):
        poison(torch.zeros(2, dtype=torch.int64), "nan")
    with pytest.raises(ValueError, match="unknown corruption"):
        poison(torch.zeros(2), "zap")
    t = torch.zeros(3)
    poison(t, "bit")
    assert t[0] != 0 and torch.isfinite(t).all()


def test_the_line_says_non_finite_and_names_the_tensors() -> None:
    m = Mismatch(12, 8, vote([[1, 0], [1, 1]], [False, True]), ["a", "b"], {1: ["0.weight"]}, {1: ["0.weight"]})
    assert describe(m).startswith("non-finite values in one replica at step 12: node b (rank 1; non-finite "
                                  "values in 0.weight) disagrees with the majority of 1 of 2 replicas")


def test_an_sdc_command_carries_its_kind() -> None:
    from agent.node.commands import SDC, Command

    for kind in ("nan", "inf", "bit"):
        c = Command(SDC, 0.0, 1.7e9, "0.weight", kind)
        assert Command.from_json(c.to_json()) == c
    assert b"kind" not in Command(SDC, 0.0, 1.7e9, "0.weight").to_json()  # as before for a bit flip
    with pytest.raises(ValueError, match="sdc kind"):
        Command.from_json(b'{"action": "sdc", "issued_at": 1.0, "what": "x", "kind": "zap"}')


def test_a_check_request_is_taken_once_and_answered_once(
        tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic.consistency.ondemand import OFF, CheckRequests, request_check, take_result

    monkeypatch.setenv("ELASTIC_HEARTBEAT_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    asks = CheckRequests()
    assert not asks.poll(True, 3) and take_result(tmp_path) is None
    request_check(tmp_path, 17.5)
    assert asks.poll(True, 3) and asks.poll(True, 4)  # open until answered
    asks.answer(5, True, "the 2 replicas agree at step 5")
    assert not asks.poll(True, 6)
    assert take_result(tmp_path) == {"id": 17.5, "step": 5, "agreed": True,
                                     "line": "the 2 replicas agree at step 5"}
    assert take_result(tmp_path) is None
    request_check(tmp_path, 18.0)
    assert not asks.poll(False, 7)  # the check is off: answered at once, nothing to agree on
    assert take_result(tmp_path) == {"id": 18.0, "step": 7, "agreed": False, "line": OFF}


def test_the_check_bit_sits_between_rounds_and_the_stop_bit() -> None:
    from elastic.consistency.ondemand import CHECK_BIT
    from elastic.stopping import STOP_BIT

    assert CHECK_BIT < STOP_BIT and CHECK_BIT & STOP_BIT == 0 and CHECK_BIT > 1 << 40


def test_the_timeline_detail_names_step_tensors_and_rollback() -> None:
    from elastic.consistency.report import timeline_detail

    m = Mismatch(12, 8, vote([[1, 0], [1, 1], [1, 0]]), ["a", "b", "c"], {1: ["0.weight", "0.bias"]})
    assert timeline_detail(m) == "step 12, differs: 0.weight, 0.bias; back to step 8, 4 step(s) retrained"
    m = Mismatch(12, 8, vote([[1, 0], [1, 1]], [False, True]), ["a", "b"], {1: ["0.weight"]}, {1: ["0.bias"]})
    assert timeline_detail(m).startswith("step 12, non-finite: 0.bias;")

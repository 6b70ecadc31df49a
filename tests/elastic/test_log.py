"""What reaches a user's console from the library: the stand-in rule, and the words of its lines.

No processes: the rule is checked against Python's own logging, with the root logger and
the ``elastic`` logger put back as they were after each test (pytest's own capture
handlers on the root are set aside meanwhile, as a user's script has none).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic import contract
from elastic.distributed import DistInfo
from elastic.fixed_world import exit_for_restart
from elastic.grad_sync import GradSync
from elastic.log import (
    BY_THE_AGENTS,
    StandIn,
    how_noticed,
    parse_level,
    reformed_line,
    show_library_lines,
)
from elastic.metrics.training import NoMetrics

GLOO = ("Got the following error when running the callback: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/"
        "gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:33680: Connection reset by peer")


@contextlib.contextmanager
def bare_script(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """A process whose script set up no logging; yields what the stand-in writes (stderr).

    Inside the test's body: pytest adds its own capture handlers to the root around the
    call, and they would count as the user's configuration."""
    root, library = logging.getLogger(), logging.getLogger("elastic")
    saved = (list(root.handlers), root.level, list(library.handlers), library.level, library.propagate)
    root.handlers, library.handlers = [], []
    root.setLevel(logging.WARNING)
    library.setLevel(logging.NOTSET)
    library.propagate = True
    stderr = io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    try:
        yield stderr
    finally:
        root.handlers, library.handlers = saved[0], saved[2]
        root.setLevel(saved[1])
        library.setLevel(saved[3])
        library.propagate = saved[4]


def user_handler(logger: logging.Logger) -> io.StringIO:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logger.addHandler(handler)
    return out


def test_without_any_logging_set_up_the_library_speaks_at_info_on_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    with bare_script(monkeypatch) as stderr:
        assert isinstance(show_library_lines(), StandIn)
        logging.getLogger("elastic.trainer").info("[a rank 0] lost node b")
        logging.getLogger("elastic.trainer").debug("raw gloo error")
        root = logging.getLogger()
        assert root.handlers == [] and root.level == logging.WARNING  # the root is the user's, untouched
    assert stderr.getvalue().count("lost node b") == 1
    assert "INFO elastic.trainer: [a rank 0] lost node b" in stderr.getvalue()
    assert "raw gloo" not in stderr.getvalue()


def test_a_user_who_configured_logging_first_gets_each_line_once_at_the_levels_they_chose(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with bare_script(monkeypatch) as stderr:
        theirs = user_handler(logging.getLogger())  # basicConfig(level=WARNING)
        assert show_library_lines() is None
        assert logging.getLogger("elastic").level == logging.NOTSET
        logging.getLogger("elastic.trainer").info("an info line")
        logging.getLogger("elastic.trainer").warning("a warning")
    assert theirs.getvalue() == "elastic.trainer: a warning\n"
    assert stderr.getvalue() == ""


def test_configuring_logging_after_the_stand_in_never_duplicates_a_line(monkeypatch: pytest.MonkeyPatch) -> None:
    with bare_script(monkeypatch) as stderr:
        show_library_lines()  # the worker bootstrap, before the user's script runs
        theirs = user_handler(logging.getLogger())  # the script's basicConfig
        logging.getLogger("elastic.inplace.membership").warning("once")
        assert show_library_lines() is None  # ElasticRun, later: the stand-in goes, the level is the user's again
        library = logging.getLogger("elastic")
        assert library.level == logging.NOTSET and not any(isinstance(h, StandIn) for h in library.handlers)
    assert theirs.getvalue().count("once") == 1 and "once" not in stderr.getvalue()


def test_a_handler_of_their_own_on_the_library_logger_replaces_the_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    with bare_script(monkeypatch) as stderr:
        show_library_lines()
        library = logging.getLogger("elastic")
        library.propagate = False
        theirs = user_handler(library)
        library.info("into their file")
    assert theirs.getvalue().count("into their file") == 1 and stderr.getvalue() == ""


def test_the_stand_in_is_installed_once_however_often_it_is_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    with bare_script(monkeypatch):
        first, second = show_library_lines(), show_library_lines()
        assert first is not None and first is second
        assert sum(isinstance(h, StandIn) for h in logging.getLogger("elastic").handlers) == 1


@pytest.mark.parametrize("value, shown, hidden", [("WARNING", "a warning", "an info"), ("debug", "a debug", "")])
def test_the_environment_turns_the_stand_in_up_or_down(monkeypatch: pytest.MonkeyPatch, value: str, shown: str,
                                                       hidden: str) -> None:
    monkeypatch.setenv(contract.LOG_LEVEL_ENV, value)
    with bare_script(monkeypatch) as stderr:
        show_library_lines()
        log = logging.getLogger("elastic.trainer")
        log.debug("a debug")
        log.info("an info")
        log.warning("a warning")
    assert shown in stderr.getvalue()
    assert not hidden or hidden not in stderr.getvalue()


def test_off_means_no_stand_in_at_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(contract.LOG_LEVEL_ENV, "off")
    with bare_script(monkeypatch):
        assert show_library_lines() is None
        assert logging.getLogger("elastic").handlers == [] and logging.getLogger("elastic").level == logging.NOTSET
    assert parse_level("none") is None and parse_level("bogus") == logging.INFO and parse_level("10") == 10


# ---------------------------------------------------------------------- the words


def test_a_peer_loss_is_said_in_words_never_as_gloo_s_message() -> None:
    assert how_noticed(GLOO) == "its connection closed"
    assert how_noticed("Connection closed by peer [127.0.0.1]:1234") == "its connection closed"
    assert how_noticed("[c10d] wait timeout after 30000ms") == "a collective timed out"
    from elastic.collectives import CollectiveFailure
    from elastic.log import Noticed

    # the run's own failures say how by their type, never by their words
    assert how_noticed(CollectiveFailure("round 7 replaces this world", noticed=Noticed.BY_THE_AGENTS)) == BY_THE_AGENTS
    assert how_noticed(CollectiveFailure("local rank 1 of this node abandoned step 5",
                                         noticed=Noticed.NODE_ABANDONED)) == "a rank of its node abandoned the step"
    assert how_noticed(CollectiveFailure(GLOO)) == "its connection closed"  # a torch error's first line: its words
    assert how_noticed(Noticed.TIMED_OUT) == "a collective timed out"
    assert how_noticed(GLOO, replaced=True) == BY_THE_AGENTS  # the agents' round came first (a frozen peer)
    assert how_noticed("something else") == "a collective failed"


def test_one_reformation_line_names_who_was_lost_how_and_says_it_was_warm() -> None:
    line = reformed_line(lost=["b"], joined=[], lost_ranks={"a": [0], "b": [1, 2]}, failed_step=65,
                         noticed="its connection closed", seconds=0.123, old_world=3, new_world=1, at_step=64,
                         round_number=7)
    assert line == ("lost node b (ranks 1, 2) in step 65: its connection closed; re-formed in place in 0.12 s, warm "
                    "(no process restarted): world of 3 -> 1 at step 64, round 7")
    assert "pair.cc" not in line and "\n" not in line


def test_a_join_and_a_failure_with_nobody_lost_are_said_too() -> None:
    joined = reformed_line(lost=[], joined=["c"], lost_ranks={}, failed_step=None, noticed="", seconds=0.6,
                           old_world=2, new_world=3, at_step=1390, round_number=8,
                           note=", ranks [2] healed from [0] (307.4 MB in 0.52 s)")
    assert joined.startswith("node c joined; re-formed in place in 0.60 s, warm")
    assert "ranks [2] healed from [0]" in joined
    same = reformed_line(lost=[], joined=[], lost_ranks={}, failed_step=12, noticed="its connection closed",
                         seconds=2.5, old_world=3, new_world=3, at_step=11, round_number=4)
    assert same.startswith("step 12 failed (its connection closed), with every node still in the world; re-formed")
    many = reformed_line(lost=["b", "c"], joined=[], lost_ranks={"b": [4, 5, 6, 7]}, failed_step=3,
                         noticed=BY_THE_AGENTS, seconds=3.0, old_world=12, new_world=4, at_step=2, round_number=9)
    assert many.startswith("lost nodes b (ranks 4-7), c in step 3: the agents' new round left it out; re-formed")
    given_up = reformed_line(lost=[], joined=[], lost_ranks={}, failed_step=5, noticed=BY_THE_AGENTS, seconds=0.5,
                             old_world=2, new_world=2, at_step=4, round_number=3)
    assert given_up.startswith("step 5 was given up for the agents' new round, with every node still in the world")


def test_on_the_restart_path_a_survivor_leaves_with_one_line_exit_1_and_its_error_file(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with bare_script(monkeypatch) as stderr:
        show_library_lines()
        with pytest.raises(SystemExit) as exit_info:
            exit_for_restart("[a rank 1]", 65, how_noticed(GLOO))
    assert exit_info.value.code == 1  # as before: the agent restarts it (refunded once the round shows b gone)
    said = stderr.getvalue()
    assert said.count("\n") == 1 and "Traceback" not in said and "pair.cc" not in said
    assert "[a rank 1] lost a peer in step 65 (its connection closed); the agent restarts this worker" in said
    message = json.loads(error_file.read_text())["message"]["message"]
    assert message.startswith("CollectiveFailure: lost a peer in step 65")


def test_building_ddp_for_elastic_run_shows_no_deprecation_warning_but_others_still_show() -> None:
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        info = DistInfo(0, 1, 0, torch.device("cpu"), "gloo", "a")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            GradSync(nn.Linear(4, 2), NoMetrics()).build(info)
            warnings.warn("the user's own", FutureWarning, stacklevel=1)
        assert [str(w.message) for w in seen] == ["the user's own"]
    finally:
        dist.destroy_process_group()

"""The sharded layers and the group API at TP = 2 (then PP = 2) on gloo over loopback.

Two processes run every check of `tp_worker.CHECKS` in one start (a process and its
torch import cost seconds on a small CI machine); each check is reported here as a
test of its own. A rank that dies ends the run at once, a run that stalls is killed
at a deadline: a failure, never a hang.
"""

from __future__ import annotations

import pytest

from tests.distributed.ranks import RankRun, assert_check_passed, run_ranks
from tests.distributed.tp_worker import CHECK_NAMES

WORLD = 2
DEADLINE_S = 90


@pytest.fixture(scope="module")
def rank_run(tmp_path_factory) -> RankRun:
    return run_ranks(
        "tests.distributed.tp_worker", WORLD, tmp_path_factory.mktemp("tp2"), DEADLINE_S
    )


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_at_tp2(rank_run, name):
    assert_check_passed(rank_run, name)

"""The per-node launcher's linger on exit 2/3 (launch/node.py: finish): it ends as soon as every node
of this attempt of the job has left its file in the run's logs/, and lasts its whole length
otherwise (another attempt's files, no shared directory). tests/slurm runs it on two nodes."""

from __future__ import annotations

import signal
import time

import pytest
from ftcore.launch import node


@pytest.fixture
def attempt(monkeypatch, tmp_path):
    """Job 7, restart 1, step 0; the launcher's signal handlers put back afterwards."""
    for k, v in (("SLURM_JOB_ID", "7"), ("SLURM_RESTART_COUNT", "1"), ("SLURM_STEP_ID", "0")):
        monkeypatch.setenv(k, v)
    saved = {s: signal.getsignal(s) for s in node.FORWARDED}
    logs = tmp_path / "run" / "logs"
    (logs / "node_exits").mkdir(parents=True)
    yield logs
    for s, h in saved.items():
        signal.signal(s, h)


def timed(*args) -> tuple[int, float]:
    t0 = time.monotonic()
    status = node.finish(*args)
    return status, time.monotonic() - t0


def test_the_linger_ends_once_every_node_is_done(attempt):
    (attempt / "node_exits" / "7.1.0.node1").write_text("3\n")
    status, took = timed(3, 2, 60.0, attempt, 0)
    assert status == 3 and took < 30, took  # not the 60 s linger
    assert (attempt / "node_exits" / "7.1.0.node0").read_text() == "3\n"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # srun's TERM cannot turn 3 into 143


@pytest.mark.parametrize("where", ["other_attempt", "no_directory"])
def test_the_whole_linger_without_every_node(attempt, where):
    (attempt / "node_exits" / "7.0.0.node1").write_text("3\n")  # restart 0: not this attempt
    exits = attempt if where == "other_attempt" else attempt.parent / "missing"
    status, took = timed(2, 2, 1.0, exits, 0)
    assert status == 2 and took >= 1.0
    assert not (attempt.parent / "missing").exists()  # the launcher makes no run directory


def test_a_crash_or_one_node_ends_at_once_and_leaves_nothing(attempt):
    assert timed(1, 2, 60.0, attempt, 0)[1] < 30  # a crash
    assert timed(3, 1, 60.0, attempt, 0)[1] < 30  # one node: nobody to wait for
    assert not any((attempt / "node_exits").iterdir())


def test_exits_dir_is_the_last_run_dir_given():
    assert node.exits_dir(["+exp=x", "run.dir=/a", "x=1", "run.dir=b"]) == node.Path("b/logs")
    assert node.exits_dir(["+exp=x"]) is None


def test_node_files_are_never_written_through_a_planted_link(attempt, tmp_path):
    """issue 51 item 4: a pre-created run directory with `node_exits/<attempt>.node0` linked to a
    file of the victim's. The node file is created anew (O_EXCL|O_NOFOLLOW): the link is not
    followed, the victim's file keeps its bytes (it was truncated and rewritten before)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (attempt / "node_exits" / "7.1.0.node0").symlink_to(victim)
    status, _ = timed(3, 2, 0.2, attempt, 0)
    assert status == 3 and victim.read_text() == "precious\n"


def test_another_users_logs_directory_gets_nothing(attempt):
    """A run directory someone else created (owned by nobody): the launcher writes nothing in it,
    not even a node file in a node_exits/ it may write to."""
    import os
    import pwd

    if os.getuid() != 0:
        pytest.skip("needs root to make a directory another user owns")
    nobody = pwd.getpwnam("nobody").pw_uid
    for d in (attempt.parent, attempt, attempt / "node_exits"):
        os.chown(d, nobody, -1)
        os.chmod(d, 0o777)
    timed(2, 2, 0.2, attempt, 0)
    assert not any((attempt / "node_exits").iterdir())

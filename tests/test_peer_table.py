"""PeerTable: which peers a failed exchange names (single process: the peers are real child processes)."""

from __future__ import annotations

import os
import subprocess

import numpy as np

from evenflow.runtime.comm import PeerTable

HOST = 7


def _table(*pids: int) -> PeerTable:
    table = PeerTable(rank=0)
    table.note(np.array([os.getpid(), *pids]), np.array([HOST] * (1 + len(pids))))
    return table


def test_a_running_peer_is_not_named_and_an_exited_one_is():
    running = subprocess.Popen(["sleep", "30"])
    exited = subprocess.Popen(["true"])
    exited.wait()  # reaped: its pid is gone (a zombie would count as exited too)
    try:
        assert _table(running.pid).who_died().startswith("Every rank on this host is still running")
        assert _table(running.pid, exited.pid).who_died().startswith("Rank(s) [2] (pid")
    finally:
        running.kill()
        running.wait()


def test_a_peer_that_is_still_exiting_is_named():
    # gloo reports the closed socket before the kernel marks the peer exited: the check waits a bounded while.
    exiting = subprocess.Popen(["sleep", "0.3"])
    try:
        assert _table(exiting.pid).who_died().startswith("Rank(s) [1] (pid")
    finally:
        exiting.wait()


def test_peers_on_other_hosts_are_not_checked():
    table = PeerTable(rank=0)
    table.note(np.array([os.getpid(), 1]), np.array([HOST, HOST + 1]))
    assert "ranks [1] are on other hosts and could not be checked" in table.who_died()
    assert PeerTable(rank=0).who_died().startswith("A peer rank most likely died")  # no reports yet

"""`ripplemesh bench restart` runs end to end: every kind of service killed -9 and back, once
restarted as a new process and once as a fork of the warm zygote, both reported side by side."""

from __future__ import annotations

import io
import os

import pytest
from rich.console import Console

from ripplemesh.bench.restart import KINDS, run_restart_bench

pytestmark = pytest.mark.timeout(300)


def test_every_kind_comes_back_in_both_modes_and_the_table_says_so() -> None:
    out = io.StringIO()
    spawn_before = os.environ.get("RIPPLEMESH_SPAWN")
    figures = run_restart_bench(rounds=1, console=Console(file=out, width=140))
    printed = out.getvalue()
    for kind in KINDS:
        assert figures[f"{kind}_exec_median_s"] > 0 and figures[f"{kind}_warm_median_s"] > 0, printed
        assert kind in printed
    assert "warm / exec" in printed and "`up` started" in printed
    assert os.environ.get("RIPPLEMESH_SPAWN") == spawn_before  # the bench put it back

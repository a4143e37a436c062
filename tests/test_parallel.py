"""The two-worker schedule (tests/parallel.py): its list names files that exist, and the reorder keeps
each file's tests together and in order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from tests.parallel import LONGEST, cpu_seconds, longest_first, scope_of, slowest_files

ROOT = Path(__file__).resolve().parent.parent


def test_every_longest_file_exists() -> None:
    """A renamed file would drop out of the schedule silently and might start last."""
    assert [p for p in LONGEST if not (ROOT / p).is_file()] == []
    assert len(set(LONGEST)) == len(LONGEST)


def test_longest_files_come_first_and_the_rest_keep_their_order() -> None:
    ids = ["tests/a/test_x.py::one", "tests/a/test_x.py::two", f"{LONGEST[1]}::b1", "tests/b/test_y.py::one",
           f"{LONGEST[0]}::a1", f"{LONGEST[1]}::b2", f"{LONGEST[0]}::a2"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    longest_first(items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [f"{LONGEST[0]}::a1", f"{LONGEST[0]}::a2", f"{LONGEST[1]}::b1",
                                         f"{LONGEST[1]}::b2", "tests/a/test_x.py::one", "tests/a/test_x.py::two",
                                         "tests/b/test_y.py::one"]


def test_the_real_node_files_are_one_scope_and_every_other_file_its_own() -> None:
    """The real-node tier's files share one machine-wide node: handed to two workers, two `up`s would take the
    same bridge and containerd."""
    assert scope_of("tests/realnode/test_user_path.py::t") == scope_of("tests/realnode/test_two_nodes.py::u")
    assert scope_of("tests/runtime/test_a.py::t") == "tests/runtime/test_a.py"
    assert scope_of("tests/runtime/test_a.py::t") != scope_of("tests/runtime/test_b.py::t")


def test_slowest_files_sums_each_files_phases_and_ranks_by_wall_time() -> None:
    phases = [("tests/a.py::one", 2.0, 1.0), ("tests/b.py::x", 5.0, 0.5), ("tests/a.py::two", 4.0, 3.0),
              ("tests/c.py::y", 0.1, 0.1)]
    assert slowest_files(phases, top=2) == [("tests/a.py", 6.0, 4.0), ("tests/b.py", 5.0, 0.5)]


def test_cpu_seconds_counts_a_reaped_child() -> None:
    before = cpu_seconds()
    subprocess.run([sys.executable, "-c", "sum(range(3_000_000))"], check=True)
    assert cpu_seconds() > before

"""Suite-wide settings.

Hypothesis profiles, chosen by the environment variable ``HYPOTHESIS_PROFILE`` (``dev`` when unset):

- ``ci`` (``.ci/test``): hypothesis' default example counts, derandomized so that a failure on CI is the
  same failure on a second run and on a laptop, with the reproduction blob printed;
- ``dev``: a quarter of the examples, random, for a quick run while editing.

Both have no per-example deadline and no "too slow" health check: those are wall-clock limits (200 ms per
example by default) and the CI machine is shared and noisy, so a slow example there says nothing about
the code. Every other health check stays on. Tests that set their own ``@settings`` inherit the profile
for what they leave out.

Tests run in parallel under pytest-xdist (``-n 2 --dist loadgroup``, ``.ci/test``): servers bind port 0
(or a free port, retried when taken) and write under ``tmp_path``. Tests marked ``serial`` never run at
the same time as each other: they share one xdist group, so one worker runs them in turn (the benchmark
runs, each of which wants the machine's cores to itself). The longest tests are handed out first, and the
engine's compiled loops are compiled once per run, before any test (``pytest_sessionstart``).
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

try:
    import fcntl
except ImportError:  # (not on Windows: each process then compiles for itself)
    fcntl = None  # type: ignore[assignment]

_WALL_CLOCK = [HealthCheck.too_slow]
settings.register_profile("ci", derandomize=True, print_blob=True, deadline=None, suppress_health_check=_WALL_CLOCK)
settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=_WALL_CLOCK)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


# The tests that take longest on the 2-core CI machine (7-45 s each; the rest take under 3 s), longest
# first: a node id, or the prefix of several (a parametrised test, a file). They start first, so that the
# two workers end within a few seconds of each other rather than one running a long test while the other
# has nothing left.
_LONGEST_FIRST = (
    "tests/replay/test_replay_hostile.py::test_a_sample_longer_than_2_24_positions_is_replayed_whole",
    "tests/server/test_hostile.py::test_peak_memory_per_body_stays_within_three_times_its_size",
    "tests/server/test_load.py::test_concurrent_clients_lose_and_double_nothing",
    "tests/server/test_schemathesis.py::test_api_conforms_and_never_fails[POST /v1/runs/{run}/mismatch]",
    "tests/engine/test_kernels.py::test_token_spans_read_each_cut_s_weight_bits_as_numpy_says",
    "tests/test_demo.py::test_the_suggested_bound_is_where_the_drift_model_puts_it",
    "tests/replay/test_what_if.py::test_nine_bounds_from_one_parse_equal_nine_separate_replays",
    "tests/server/test_durability.py::test_sigkill_under_concurrent_load_changes_no_answer_counter_or_metric_under_any_policy",
    "tests/html_report/test_choosing.py",  # (its demo directory is a module fixture: the file's tests together)
    "tests/test_demo.py::test_the_demo_directory_replays_to_the_metrics_it_logged_costs_included",
    "tests/test_replay_crosscheck.py::test_hypothesis_streams_match_the_reference",
    "tests/html_report/test_report.py::test_a_run_with_trainer_logprobs_shows_what_staleness_costs",
    "tests/engine/test_checkpoint_damage.py",
    "tests/engine/test_properties.py::test_metrics_equal_a_naive_recount_of_the_shipped_batches",
    "tests/replay/test_what_if.py::test_bounds_replayed_on_two_processes_give_what_one_process_gives",
    "tests/replay/test_replay_hostile.py::test_gzip_bzip2_and_xz_files_are_read_as_the_plain_file",
    "tests/server/test_exporters.py::test_otlp_and_wandb_from_the_serve_command",
    "tests/test_demo.py",
    "tests/test_replay_crosscheck.py",
    "tests/engine/test_small_adds.py",
    "tests/engine/test_kernels.py::test_token_cuts_equal_the_numpy_runs",
    "tests/records/test_simd_records.py::test_a_line_is_read_as_the_general_path_reads_it_or_left_to_it",
    "tests/exporters/test_mismatch_exporters.py::test_counters_of_two_processes_add_up_to_those_of_the_whole",
    "tests/server/test_schemathesis.py",
)


def _is_xdist_controller(config: pytest.Config) -> bool:
    """The process that hands tests to the xdist workers and runs none itself."""
    return config.pluginmanager.has_plugin("dsession")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the engine's numba loops once, before any test: on a fresh machine the first compile
    takes seconds, which would otherwise land inside whichever test (or served request) comes first.

    Under xdist the controller compiles them, on a thread, while its workers collect the tests (seconds
    of imports and assertion rewriting); each worker then waits for it (a file lock) and loads the loops
    from numba's disk cache in a fraction of a second. So they are compiled once, not once per process
    (and never by two processes at once: numba's cache index is not safe against two processes adding
    different loops to it at the same time). Without xdist, or without ``fcntl``, the process compiles
    them itself, here."""
    if _is_xdist_controller(session.config) and fcntl is not None:
        session.config.stash[_WARM_UP] = _ControllerWarmUp()
    elif not hasattr(session.config, "workerinput"):
        _warm_up()


def _warm_up() -> None:
    from staleness_metrics.engine.warm_up import warm_up

    warm_up()


class _ControllerWarmUp:
    """The xdist controller's compile: the lock is taken before any worker starts; the compile runs on a
    thread from the moment the first worker is up (started before, it would slow the workers' start:
    the compile holds the GIL that the controller's start of the workers needs)."""

    def __init__(self) -> None:
        assert fcntl is not None
        self.handle, self.path = tempfile.mkstemp(prefix="staleness-warm-up-", suffix=".lock")
        fcntl.flock(self.handle, fcntl.LOCK_EX)
        self.started = False
        self.released = False

    def start(self) -> None:
        if not self.started:
            self.started = True
            threading.Thread(target=self._compile_then_release, name="warm-up", daemon=True).start()

    def _compile_then_release(self) -> None:
        try:
            _warm_up()
        except Exception:  # (each worker then compiles for itself, and reports what fails in its tests)
            pass
        finally:
            self.release()

    def release(self) -> None:
        assert fcntl is not None
        if not self.released:
            self.released = True
            os.unlink(self.path)  # (a worker that opens the file later finds the compile done)
            fcntl.flock(self.handle, fcntl.LOCK_UN)
            os.close(self.handle)


_WARM_UP = pytest.StashKey[_ControllerWarmUp]()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Tell each xdist worker where the controller's warm-up lock is."""
    warm_up = node.config.stash.get(_WARM_UP, None)
    if warm_up is not None:
        node.workerinput["staleness_warm_up_lock"] = warm_up.path


@pytest.hookimpl(optionalhook=True)
def pytest_testnodeready(node: Any) -> None:
    """The first worker is up: the controller starts compiling."""
    warm_up = node.config.stash.get(_WARM_UP, None)
    if warm_up is not None:
        warm_up.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """No worker came up: the lock is let go all the same."""
    warm_up = session.config.stash.get(_WARM_UP, None)
    if warm_up is not None and not warm_up.started:
        warm_up.release()


def pytest_collection_finish(session: pytest.Session) -> None:
    """An xdist worker, its tests collected: wait for the controller's compile, then load the loops."""
    worker_input: dict[str, Any] | None = getattr(session.config, "workerinput", None)
    if worker_input is None:
        return
    path = worker_input.get("staleness_warm_up_lock")
    if path is not None and fcntl is not None:
        try:
            with open(path, "rb") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
        except FileNotFoundError:  # the controller's compile was done before this worker asked
            pass
    _warm_up()  # (from the disk cache; compiled here if the controller could not)


def _set_node_id(item: pytest.Item, nodeid: str) -> None:
    """Give ``item`` the node id ``nodeid``: pytest 9 keeps it structured in ``_id`` (``_nodeid``, which
    xdist still sets, is read by no one), earlier versions as the string ``_nodeid``."""
    if hasattr(item, "_id"):
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(nodeid)
    else:
        item._nodeid = nodeid


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest tests first (``_LONGEST_FIRST``); tests marked ``serial`` share one xdist group: the
    ``loadgroup`` scheduler runs them on one worker, one after the other (without xdist the marker
    changes nothing)."""

    def rank(item: pytest.Item) -> int:
        for position, prefix in enumerate(_LONGEST_FIRST):
            if item.nodeid == prefix or item.nodeid.startswith((f"{prefix}::", f"{prefix}[")):
                return position
        return len(_LONGEST_FIRST)

    # schemathesis makes a test per API operation, named ``test_x[POST /v1/runs/{run}/ship]``, but under
    # pytest 9 each gets the node id of the function alone; xdist hands tests out by node id, and ran the
    # first operation only. Each gets its name back in its node id.
    counts = Counter(item.nodeid for item in items)
    for item in items:
        if counts[item.nodeid] > 1 and item.parent is not None and item.name != item.nodeid.rsplit("::", 1)[-1]:
            _set_node_id(item, f"{item.parent.nodeid}::{item.name}")
    items.sort(key=rank)  # (stable: the rest keep their order)
    loadgroup = bool(getattr(config.option, "loadgroup", False))
    for item in items:
        if item.get_closest_marker("serial") is not None:
            item.add_marker(pytest.mark.xdist_group("serial"))
            if loadgroup:  # the group in the node id, where xdist's scheduler reads it (as xdist would set it)
                _set_node_id(item, f"{item.nodeid}@serial")

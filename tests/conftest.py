"""Suite-wide: keep what the CLI and `lazarus up` leave for the operator (the endpoint file)
out of the real home directory; keep benchmarks out of a plain `pytest`; mark the fast tier;
say in one line what a run skipped and why; and in CI (CI=true) fail the run on a skip nobody
expected."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).parent / "bench"

# In CI a skip is a failure unless listed here: a test that skips because chromium or user
# namespaces are missing says the CI machine is broken, and a green run would hide it.
# node id (or a directory ending in "/") -> the skip reason that is expected there (the test
# must skip with that reason).
EXPECTED_SKIPS = {
    # runs where NVML does not work; a GPU runner tests the real backend instead
    "tests/unit/test_gpu_monitor.py::test_without_nvml_auto_falls_back_to_the_simulated_backend_and_says_why":
        "this machine has a working NVML",
    # every GPU test, on a machine without CUDA; tests/gpu/run.sh runs them where it is
    "tests/gpu/": "needs a CUDA device",
}
if os.geteuid() != 0:
    # needs root for its nodes' network namespaces: expected to skip only where there is none
    # (CI runs as root, so there the only partition test cannot vanish from a green run)
    EXPECTED_SKIPS["tests/e2e/test_partition.py::"
                   "test_a_node_cut_off_from_etcd_and_a_node_cut_off_from_its_peers"] = (
        "network namespaces are not available here")
    # starts ranks as a second Unix user, which only root may (CI runs as root)
    for name in ("test_ranks_of_their_own_user_recover_in_place_and_cannot_reach_the_clusters_secrets",
                 "test_a_non_root_agent_asked_to_run_as_another_user_says_it_cannot",
                 "test_an_agent_that_is_not_root_starts_ranks_that_hold_no_capability"):
        EXPECTED_SKIPS[f"tests/e2e/test_run_as.py::{name}"] = "--run-as needs root"
    EXPECTED_SKIPS["tests/deploy/test_systemd.py::test_the_units_commands_run_a_daemon_and_an_agent"] = (
        "needs root")

# The fast tier, `pytest -m "not slow"` (docs/testing.md): every unit test, and of the tests that start
# whole clusters or trainings only this one: a real local cluster recovering from a worker
# crash and a node loss, bit for bit on its reference. Everything else under these
# directories is `slow`.
SLOW_DIRS = ("e2e", "integration", "deploy")
FAST = {"tests/e2e/test_recovery.py::test_worker_crash_and_node_loss_restore_from_memory_bit_exact"}


# The CPU suite trains on the CPU (gloo) on a GPU machine too: it puts several ranks on one
# machine, more than it may have GPUs. tests/gpu asks for CUDA in its own processes.
os.environ.setdefault("LAZARUS_DEVICE", "cpu")


@pytest.fixture(scope="session", autouse=True)
def _lazarus_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("lazarus-home")
    old = os.environ.get("LAZARUS_HOME")
    os.environ["LAZARUS_HOME"] = str(home)  # inherited by every process a test starts
    yield home
    if old is None:
        os.environ.pop("LAZARUS_HOME", None)
    else:
        os.environ["LAZARUS_HOME"] = old


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items):
    # Everything under tests/bench is a benchmark, marked or not: a plain `pytest` (addopts
    # `-m 'not bench'`) never runs one.
    tests = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(BENCH_DIR):
            item.add_marker(pytest.mark.bench)
            item.add_marker(pytest.mark.slow)  # `-m "not slow"` replaces addopts' `-m`
        elif (any(item.path.is_relative_to(tests / d) for d in SLOW_DIRS)
              and item.nodeid not in FAST):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; without xdist, never called
def pytest_xdist_make_scheduler(config, log):
    """Which tests one pytest-xdist worker runs together, in order (`pytest -n 2`, README): a
    module's tests, so that its module-scoped fixtures (clusters, reference runs) are made
    once; and every end-to-end test, so that their session-wide reference runs
    (tests/e2e/helpers.py) are shared and no two whole clusters train at once. (xdist's own
    `--dist loadgroup` marks do nothing under pytest 9: it renames a node attribute pytest 9
    no longer reads.)

    Longest first, so that the run ends on small units: the end-to-end tests (46-47% of the
    tests' time, docs/testing.md) go to a worker at once, then the integration and deploy
    modules, then the unit modules, each tier in xdist's order (most tests first). xdist's
    order alone, most tests first, handed the e2e group (29 tests) out eleventh and left the
    integration modules of one or a few tests (a 64 s write budget, whole clusters) for last:
    one worker then ran on alone for the last 20-87 s, 5-10 s in this order (four CI runs'
    durations replayed, docs/testing.md)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndEndToEnd(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "tests/e2e/" if module.startswith("tests/e2e/") else module

        def _assign_work_unit(self, node) -> None:
            # min() keeps the first of the lowest tier in xdist's order
            first = min(self.workqueue, key=_tier)
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return ModulesAndEndToEnd(config, log)


def _tier(scope: str) -> int:
    """A scope's place in the workers' queue: whole clusters, then processes, then units."""
    if scope.startswith("tests/e2e/"):
        return 0
    return 1 if scope.startswith(("tests/integration/", "tests/deploy/")) else 2


def pytest_configure(config):
    check_skips_in_ci(config, EXPECTED_SKIPS)
    config.pluginmanager.register(SkipLine(), "lazarus-skip-line")
    config.pluginmanager.register(CpuTable(), "lazarus-cpu-table")


class SkipLine:
    """One line at the end of every run: what was skipped and why, so that a plain `pytest`
    that skipped a module for a missing tool says so (CI also fails on an unexpected one)."""

    def __init__(self):
        self.reasons: dict[str, int] = {}

    def _note(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = _skip_reason(report)
            self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def pytest_runtest_logreport(self, report) -> None:
        self._note(report)

    def pytest_collectreport(self, report) -> None:
        self._note(report)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.reasons:
            total = sum(self.reasons.values())
            terminalreporter.write_line(
                f"skipped {total}: " + "; ".join(f"{n} x {reason}" for reason, n in
                                                 sorted(self.reasons.items(),
                                                        key=lambda kv: -kv[1])))


def _cpu_s() -> float:
    """CPU-seconds of this process and of every process it started and reaped (a cluster's
    etcd, daemons, agents, and through them their ranks)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class CpuTable:
    """The CPU each test module cost, the costliest listed at the end of the run. On CI's two
    busy cores the suite's time is its CPU, which --durations misreads: a test that waits
    out a lease holds its worker, not a core. A process left unreaped (an orphan of a
    SIGKILLed agent) is not counted."""

    TOP = 20

    def __init__(self):
        self._began: float | None = None
        self.by_module: dict[str, float] = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item) -> None:
        self._began = _cpu_s()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        if call.when == "teardown" and self._began is not None:
            # on the report, so that an xdist worker's figure reaches the controller
            outcome.get_result().user_properties.append(("cpu_s", _cpu_s() - self._began))
            self._began = None

    def pytest_runtest_logreport(self, report) -> None:
        for key, value in report.user_properties:
            if key == "cpu_s":
                module = report.nodeid.split("::", 1)[0]
                self.by_module[module] = self.by_module.get(module, 0.0) + value

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.by_module:
            return
        total = sum(self.by_module.values())
        tr = terminalreporter
        tr.write_line(f"CPU of the tests, {total:.0f} CPU-s in all; the costliest modules:")
        for module, cpu in sorted(self.by_module.items(), key=lambda kv: -kv[1])[:self.TOP]:
            tr.write_line(f"  {cpu:7.1f} CPU-s  {module}")


def check_skips_in_ci(config: pytest.Config, expected: dict[str, str]) -> None:
    """When CI is true, make the run fail on any skip not in `expected`."""
    if os.environ.get("CI", "").lower() in ("true", "1"):
        config.pluginmanager.register(UnexpectedSkips(expected), "lazarus-unexpected-skips")


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # (path, line, "Skipped: <reason>")
        return longrepr[2].removeprefix("Skipped: ")
    return str(longrepr)


class UnexpectedSkips:
    """Collects skipped tests and modules outside the expected list; the run then fails and
    the summary names each one with its reason."""

    def __init__(self, expected: dict[str, str]):
        self.expected = expected
        self.found: list[tuple[str, str]] = []

    def _check(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if not report.skipped or hasattr(report, "wasxfail"):  # an xfail is declared, not a skip
            return
        reason = _skip_reason(report)
        want = self.expected.get(report.nodeid)
        if want is None:  # a key ending in "/" covers every test under that directory
            want = next((w for k, w in self.expected.items()
                         if k.endswith("/") and report.nodeid.startswith(k)), None)
        if want is None or want not in reason:
            self.found.append((report.nodeid, reason))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._check(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._check(report)  # a module-level skip or importorskip

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.found and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.found:
            return
        terminalreporter.write_sep("=", f"{len(self.found)} unexpected skip(s) in CI", red=True)
        for nodeid, reason in self.found:
            terminalreporter.write_line(f"{nodeid}: {reason}")
        terminalreporter.write_line("install what they need (deploy/setup-local.sh), or list them "
                                    "in EXPECTED_SKIPS of tests/conftest.py with their reason")

"""In CI (CI=true) a skipped test fails the run unless tests/conftest.py expects that skip;
outside CI skips stay skips. Each case runs a small pytest session of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import EXPECTED_SKIPS

pytest_plugins = ["pytester"]

CONFTEST = """
from tests.conftest import check_skips_in_ci

def pytest_configure(config):
    check_skips_in_ci(config, {"test_it.py::test_on_a_gpu": "needs a GPU"})
"""

TESTS = """
import pytest

def test_runs():
    pass

def test_needs_chromium():
    pytest.skip("chromium is not installed")

def test_on_a_gpu():
    pytest.skip("needs a GPU")
"""


@pytest.fixture
def session(pytester, monkeypatch):
    pytester.makeconftest(CONFTEST)

    def run(ci: str | None, tests: str = TESTS) -> pytest.RunResult:
        if ci is None:
            monkeypatch.delenv("CI", raising=False)
        else:
            monkeypatch.setenv("CI", ci)
        pytester.makepyfile(test_it=tests)
        return pytester.runpytest("-rs")
    return run


def test_an_unexpected_skip_fails_the_run_in_ci_and_is_named_with_its_reason(session):
    result = session("true")
    result.assert_outcomes(passed=1, skipped=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*= 1 unexpected skip(s) in CI =*",
                                 "test_it.py::test_needs_chromium: chromium is not installed"])
    assert "test_it.py::test_on_a_gpu:" not in result.stdout.str()


def test_expected_skips_alone_pass_in_ci(session):
    result = session("true", TESTS.replace('pytest.skip("chromium is not installed")', "pass"))
    result.assert_outcomes(passed=2, skipped=1)
    assert result.ret == pytest.ExitCode.OK
    assert "unexpected skip" not in result.stdout.str()


def test_an_expected_test_skipping_for_another_reason_fails_in_ci(session):
    result = session("true", TESTS.replace('"needs a GPU"', '"etcd is not installed"'))
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*= 2 unexpected skip(s) in CI =*"])
    result.stdout.fnmatch_lines(["test_it.py::test_on_a_gpu: etcd is not installed"])


def test_a_skipped_module_fails_in_ci(session):
    result = session("1", 'import pytest\npytest.importorskip("no_such_module_here")\n'
                          "def test_x():\n    pass\n")
    assert result.ret != pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["test_it.py: could not import 'no_such_module_here'*"])


def test_outside_ci_skips_are_only_reported(session):
    result = session(None)
    result.assert_outcomes(passed=1, skipped=2)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["SKIPPED*chromium is not installed"])
    assert "unexpected skip" not in result.stdout.str()


def test_every_expected_skip_names_a_test_that_exists():
    root = Path(__file__).resolve().parents[2]
    for nodeid in EXPECTED_SKIPS:
        if nodeid.endswith("/"):  # a directory: it must hold tests
            assert list((root / nodeid).glob("test_*.py")), f"stale entry {nodeid}"
            continue
        path, name = nodeid.split("::")
        assert f"def {name}(" in (root / path).read_text(), f"stale entry {nodeid}"


def test_a_directory_entry_expects_the_skips_under_it_alone(pytester, monkeypatch):
    pytester.makeconftest('from tests.conftest import check_skips_in_ci\n\n'
                          'def pytest_configure(config):\n'
                          '    check_skips_in_ci(config, {"gpu/": "needs a CUDA device"})\n')
    skip = 'import pytest\n\ndef test_x():\n    pytest.skip("needs a CUDA device here")\n'
    pytester.makepyfile(**{"gpu/test_g": skip, "cpu/test_c": skip})
    monkeypatch.setenv("CI", "true")
    result = pytester.runpytest("-rs")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*= 1 unexpected skip(s) in CI =*",
                                 "cpu/test_c.py::test_x: needs a CUDA device here"])
    assert "gpu/test_g.py::test_x:" not in result.stdout.str()

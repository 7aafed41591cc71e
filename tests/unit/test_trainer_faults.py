"""Faults injected into a rank through the trainer's phase hooks: how they are named, how a
rank loads them, the poisoned data (keyed on windows, the same on any mesh), and a slow node."""

from __future__ import annotations

import json
import time

import pytest
import torch

from lazarus.core.errors import UserError
from lazarus.sim import trainer_faults
from lazarus.sim.trainer_faults import (
    DIVERGE_STEPS,
    DataFaults,
    Injector,
    Slowdown,
    TrainerFault,
    parse,
    worker_env,
)
from lazarus.trainer import hooks
from lazarus.trainer.steptime import ComputeClock
from lazarus.trainer.windows import DataWindows

from tests.unit.small_corpus import BATCH, SEQ, dataset, loader  # noqa: F401 (fixture)


def test_fault_specs_parse():
    assert parse("hang@14:3, crash@5,slow-step@1,loss-spike@20,diverge@30") == [
        TrainerFault("hang", 14, 3), TrainerFault("crash", 5, 0), TrainerFault("slow-step", 1),
        TrainerFault("loss-spike", 20), TrainerFault("diverge", 30)]
    assert parse("") == []


@pytest.mark.parametrize("spec", ["loss-spike@0", "nan@3", "diverge", "slow-step@2:1", "hang@x"])
def test_bad_fault_specs_are_named(spec):
    with pytest.raises(UserError, match=f"trainer fault '{spec}' must be KIND@STEP"):
        worker_env([spec])


def test_a_rank_loads_the_plugin_its_environment_names(monkeypatch, tmp_path):
    env = worker_env(["loss-spike@2"], slowdown=tmp_path / "n1.slowdown.json")
    assert env[hooks.HOOKS_ENV] == trainer_faults.HOOK
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    loaded = hooks.from_env()
    (injector,) = loaded._hooks
    assert isinstance(injector, Injector) and injector.faults == [TrainerFault("loss-spike", 2)]
    assert injector.slowdown.path == tmp_path / "n1.slowdown.json"
    assert hooks.from_env({})._hooks == []  # nothing named, nothing attached
    with pytest.raises(UserError, match="LAZARUS_TRAINER_HOOKS: cannot load 'no.such:attach'"):
        hooks.from_env({hooks.HOOKS_ENV: "no.such:attach"})


def test_poison_is_garbage_keyed_on_the_window_and_the_same_on_any_mesh(dataset):
    one = loader(dataset)
    windows, faults = DataWindows(one, skip=[]), DataFaults(parse("loss-spike@2"), one, vocab_size=256)
    clean = faults.poison(windows.next_window()[0], one.next_step())
    assert max(int(x.max()) for x, _ in clean) < 128  # the corpus is ASCII
    poisoned_window = windows.next_window()[0]
    poisoned = faults.poison(poisoned_window, one.next_step())
    assert all(int(x.min()) >= 128 and torch.equal(x[:, 1:], y[:, :-1]) for x, y in poisoned)

    # dp2 ranks together hold exactly the dp1 garbage, micro-batch by micro-batch.
    halves = []
    for rank in range(2):
        ranked = loader(dataset, dp_rank=rank, dp_size=2)
        ranked.skip(1)
        w, f = DataWindows(ranked, skip=[]), DataFaults(parse("loss-spike@2"), ranked, vocab_size=256)
        halves += f.poison(w.next_window()[0], ranked.next_step())
    assert all(torch.equal(a[0], b[0]) for a, b in zip(poisoned, halves))
    # Keyed on the window, not the step: a run that skips that window never meets the poison.
    skipping = loader(dataset)
    w = DataWindows(skipping, skip=[[poisoned_window["first"], poisoned_window["last"]]])
    f = DataFaults(parse("loss-spike@2"), skipping, vocab_size=256)
    for _ in range(4):
        batch = f.poison(w.next_window()[0], skipping.next_step())
        assert max(int(x.max()) for x, _ in batch) < 128


def test_diverge_poisons_consecutive_windows_until_they_are_skipped(dataset):
    def poisoned_steps(skip: list[list[int]]) -> list[int]:
        one = loader(dataset)
        windows, faults = DataWindows(one, skip=skip), DataFaults(parse("diverge@3"), one, vocab_size=256)
        return [step for step in range(1, 12)
                if min(int(x.min()) for x, _ in faults.poison(windows.next_window()[0], one.next_step())) >= 128]

    assert poisoned_steps([]) == list(range(3, 3 + DIVERGE_STEPS))
    assert poisoned_steps([[16, 23]]) == list(range(3, 2 + DIVERGE_STEPS))  # one window fewer
    assert poisoned_steps([[16, 8 * (2 + DIVERGE_STEPS) - 1]]) == []


def _spin(seconds):
    t = time.process_time()
    while time.process_time() - t < seconds:
        pass


def test_slowdown_multiplies_the_work_of_a_step(tmp_path):
    script = tmp_path / "n1.slowdown.json"
    slow, clock = Slowdown(str(script)), ComputeClock(torch.device("cpu"))
    script.write_text(json.dumps({"factor": 3}))
    assert slow.refresh() == 3.0
    clock.start()
    _spin(0.05)
    slow.apply(clock)
    assert clock.stop() >= 0.15
    script.write_text("{half written")   # read again next step, full speed meanwhile
    assert slow.refresh() == 1.0


def test_lazarus_up_hands_its_trainer_faults_to_the_ranks(monkeypatch):
    from lazarus.sim import chaos, up

    schedule = chaos.parse_schedule("kill-node@3,hang@14,slow-step@1,slow-checkpoint@8,loss-spike@20")
    faults = up._rank_faults([f for f in schedule if f.kind in chaos.TRAINER_KINDS], world=4)
    for key, value in worker_env(faults).items():
        monkeypatch.setenv(key, value)
    (injector,) = hooks.from_env()._hooks
    assert injector.faults == [TrainerFault("slow-step", 1), TrainerFault("slow-checkpoint", 8),
                               TrainerFault("hang", 14, 3), TrainerFault("loss-spike", 20)]

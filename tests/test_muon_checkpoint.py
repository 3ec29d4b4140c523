"""Muon's and AdamW's states in DCP checkpoints: exact resume on 2 gloo ranks, resharding to 1 and 3
ranks, and the refusal to switch optimizer at a resume."""
import json
import pathlib

import pytest
import torch
from helpers import ROOT, read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")


def launch(torchrun, phase: str, world: int, out: pathlib.Path) -> dict:
    done = torchrun(ROOT / "tests" / "muon_ckpt_worker.py", phase, out, nproc=world)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / f"{phase}.json").read_text())


def state_tensors(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from state_tensors(v, f"{prefix}{k}.")
    elif isinstance(tree, torch.Tensor):
        yield prefix[:-1], tree


@pytest.fixture(scope="module")
def runs(tmp_path_factory, torchrun):
    out = tmp_path_factory.mktemp("muon_ckpt")
    return out, {phase: launch(torchrun, phase, world, out) for phase, world in (("two", 2), ("one", 1), ("three", 3))}


# three torchrun launches, about 2 min on 2 idle cores (the runs fixture)
def test_resumed_two_rank_muon_run_has_bitwise_the_straight_losses(runs):
    _, r = runs
    straight, resumed = r["two"]["straight"], r["two"]["resumed"]
    assert len(straight) == 6 and len(resumed) == 3
    assert resumed == straight[3:]  # bitwise: the same floats


@pytest.mark.parametrize("phase", ["one", "three"])
def test_two_rank_checkpoint_loads_on_one_and_three_ranks_with_every_state_equal(runs, phase):
    out, r = runs
    saved = torch.load(out / "state_two.pt", weights_only=False)
    loaded = torch.load(out / f"state_{phase}.pt", weights_only=False)
    assert saved["step"] == loaded["step"] == 3
    a, b = dict(state_tensors(saved["optimizer"]["state"])), dict(state_tensors(loaded["optimizer"]["state"]))
    assert a.keys() == b.keys()
    assert sum(k.endswith(".momentum_buffer") for k in a) == 28 and sum(k.endswith(".exp_avg") for k in a) == 20
    for key in a:
        assert torch.equal(a[key], b[key]), key
    for key, value in saved["model"].items():
        assert torch.equal(value, loaded["model"][key]), key
    # training continues: step 4 from the same weights has the straight run's loss (up to summation order)
    assert r[phase]["continued"][-1] == pytest.approx(r["two"]["straight"][3], rel=1e-5)


def _main(tmp_path, name, *extra):
    from train_common import debug_argv

    from mhar_titan.train import main

    return main(debug_argv(tmp_path, name, "--training.local_batch_size=2", "--checkpoint.enable=true",
                           "--checkpoint.interval=2", *extra))


@pytest.mark.slow  # five short trainer runs in one process, about 25 s on 2 idle cores, 53 s loaded
def test_switching_optimizer_at_a_resume_is_refused_unless_the_optimizer_state_is_not_loaded(tmp_path, capsys):
    assert _main(tmp_path, "adamw", "--training.steps=2") == 0
    capsys.readouterr()
    step2 = tmp_path / "adamw" / "checkpoints" / "step-2"
    for extra in ([], ["--job.name=fresh", f"--checkpoint.initial_load_path={step2}",
                       "--checkpoint.initial_load_model_only=false"]):
        code = _main(tmp_path, "adamw", "--training.steps=3", "--optimizer.name=Muon", *extra)
        out, err = capsys.readouterr()
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert (f"{step2} holds AdamW optimizer state and this run has optimizer.name = \"Muon\": switching "
                "optimizer at a resume is refused. Resume with --optimizer.name=AdamW, or ") in err
        assert ("initial_load_model_only=true" if extra else "exclude_from_loading='[\"optimizer\"]'") in err
        assert "| start |" not in out  # refused before the model was built
    assert [r["step"] for r in read_metrics(tmp_path / "adamw") if "loss" in r] == [1, 2]  # nothing lost
    # without the optimizer state: the run resumes (weights, schedule, data position) with a fresh Muon
    assert _main(tmp_path, "adamw", "--training.steps=4", "--optimizer.name=Muon",
                 "--checkpoint.exclude_from_loading=[\"optimizer\"]") == 0
    assert "| optimizer | Muon 28 matrices, 786k params | AdamW 20 tensors, 6.44M params" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(tmp_path / "adamw") if "loss" in r] == [1, 2, 3, 4]
    assert _main(tmp_path, "from_adamw", "--training.steps=1", "--optimizer.name=Muon",
                 f"--checkpoint.initial_load_path={step2}") == 0  # model only (the default)
    # and back: the Muon run's checkpoint refuses AdamW
    code = _main(tmp_path, "adamw", "--training.steps=5")
    assert code == 2 and "holds Muon optimizer state and this run has optimizer.name = \"AdamW\"" in capsys.readouterr().err

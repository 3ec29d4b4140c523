"""The GPU suite's trainer rows, prepared on CPU: the wheels they carry (bench/gpu_wheels.txt)
resolve for the GPU machine (CPython 3.12, manylinux x86-64) and install with pip --target as
bench/trainer_row.py installs them, and the row's command runs the 100m paper configs on CPU
(small batches; the --tiny suite in tests/test_kernels_suite.py runs the debug configs)."""
import subprocess
import sys

import pytest
from helpers import ROOT

PATIENCE_S = 1800  # a hang guard only, per launch of a 100m model on a loaded 2-core machine (six launches)


@pytest.mark.slow  # downloads the wheels from the package index
def test_wheel_list_resolves_and_installs(tmp_path):
    wheels = tmp_path / "whl"
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_wheels.sh"), str(wheels)], capture_output=True,
                          text=True, timeout=PATIENCE_S, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    listed = [line.split("==") for line in (ROOT / "bench" / "gpu_wheels.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    names = sorted(w.name for w in wheels.glob("*.whl"))
    assert len(names) == len(listed)
    for name, version in listed:
        assert any(n.startswith(f"{name.replace('-', '_')}-{version}-") for n in names), (name, names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                    *map(str, wheels.glob("*.whl"))], check=True, timeout=PATIENCE_S)
    probe = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(site)!r}); "
                            "import tomli_w, torchdata; print(torchdata.__file__, tomli_w.__file__)"], capture_output=True, text=True)
    assert probe.returncode == 0 and probe.stdout.count(str(site)) == 2, probe.stdout + probe.stderr


@pytest.mark.slow
@pytest.mark.processes
def test_trainer_row_runs_the_paper_config_on_cpu(tmp_path):
    """The suite's trainer row as it runs on the GPU (the 100m paper configs under torchrun, local
    data, the config's own cl100k_base tokenizer from the offline cache, a SIGKILL after a checkpoint
    and a bitwise resume), minus CUDA and at a size a CPU trains in seconds."""
    table = tmp_path / "trainer.md"
    # the row's per-launch limit is the GPU window's plan, not a verdict: here a hang guard (a 100m
    # launch on a CPU shared with other jobs took more than the default 300 s, 2026-12-07)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "trainer_row.py"), "resume", "--scale", "100m",
                           "--families", "mhar,baseline", "--steps", "6", "--checkpoint-at", "2", "--batch", "1",
                           "--seq", "64", "--budget-s", str(PATIENCE_S), "--out", str(table)],
                          capture_output=True, text=True, timeout=6 * PATIENCE_S, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = table.read_text()
    assert "resumed from 2: losses bitwise equal at all 6 steps" in text, text
    assert "| baseline | 6 of 6 |" in text


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.parametrize("family", ["dense", "mudd"])
def test_a_sigkill_mid_run_resumes_the_depth_connections_bitwise(tmp_path, family):
    """DenseFormer and MUDDFormer under the GPU suite's trainer row, at the debug configs
    (`--tiny`, CPU): train.py under torchrun SIGKILLed (the whole process tree) once the step-2
    checkpoint is complete, launched again, resumes and logs the straight run's losses bit for bit
    at every step."""
    table = tmp_path / "trainer.md"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "trainer_row.py"), "resume", "--tiny", "--families",
                           family, "--steps", "6", "--checkpoint-at", "2", "--out", str(table)],
                          capture_output=True, text=True, timeout=PATIENCE_S, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = table.read_text()
    assert "resumed from 2: losses bitwise equal at all 6 steps" in text, text
    assert f"| {family} | 6 of 6 |" in text

"""The wheels the GPU suite's trainer rows carry (bench/gpu_wheels.txt) resolve for the GPU
machine (CPython 3.12, manylinux x86-64) and install with pip --target as bench/trainer_row.py
installs them; the row's command itself runs on CPU in tests/test_kernels_suite.py (--tiny)."""
import subprocess
import sys

from helpers import ROOT


def test_wheel_list_resolves_and_installs(tmp_path):
    wheels = tmp_path / "whl"
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_wheels.sh"), str(wheels)], capture_output=True,
                          text=True, timeout=600, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    listed = [line.split("==") for line in (ROOT / "bench" / "gpu_wheels.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    names = sorted(w.name for w in wheels.glob("*.whl"))
    assert len(names) == len(listed)
    for name, version in listed:
        assert any(n.startswith(f"{name.replace('-', '_')}-{version}-") for n in names), (name, names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                    *map(str, wheels.glob("*.whl"))], check=True, timeout=300)
    probe = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(site)!r}); "
                            "import tomli_w, torchdata; print(torchdata.__file__, tomli_w.__file__)"], capture_output=True, text=True)
    assert probe.returncode == 0 and probe.stdout.count(str(site)) == 2, probe.stdout + probe.stderr

"""The package's public API: `import mhar_titan` is light and resolves its names lazily, and the
README's notebook-sized script (build a debug MHAR model, train a few steps, sample) runs."""
import re
import subprocess
import sys

import pytest

from helpers import PATIENCE_S, ROOT
from train_common import SAMPLE

import mhar_titan


def test_the_package_exports_lazily_and_imports_nothing_heavy():
    code = ("import sys, mhar_titan; print(sorted(m for m in ('torch', 'mhar_titan.models', 'mhar_titan.train', "
            "'mhar_titan.config') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"
    from mhar_titan.eval.generation import generate_batch
    from mhar_titan.models import FAMILIES, Transformer
    from mhar_titan.train import run_training

    assert mhar_titan.Transformer is Transformer and mhar_titan.FAMILIES is FAMILIES
    assert mhar_titan.run_training is run_training and mhar_titan.generate_batch is generate_batch
    assert set(mhar_titan.__all__) >= {"Transformer", "ModelArgs", "FLAVORS", "FAMILIES", "load_config",
                                       "JobConfig", "run_training", "Trainer", "load_run", "generate_batch"}
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mhar_titan.nope  # noqa: B018


@pytest.mark.skipif(not (SAMPLE / "validation-00000-of-00001.parquet").exists(),
                    reason="run `python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare`")
def test_the_readme_python_example_trains_and_samples(tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## From Python"):]
    script = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert 'OUT = "outputs"\n' in script
    script = script.replace('OUT = "outputs"\n', f'OUT = {str(tmp_path)!r}\n')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=PATIENCE_S)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "8 1024" in lines  # 8 steps of 4 x 32 tokens
    assert any(line.startswith("step 8/8 | done | 8 steps") for line in lines)
    assert done.stdout.index("\n20 tokens: ROMEO:") > done.stdout.index("| metrics |")  # sampled after the summary
    assert (tmp_path / "notebook_mhar" / "checkpoints" / "step-8").is_dir()

"""bench/data.py at toy size: it runs end to end and --append writes its table into the data-loader section."""
import importlib.util
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mhar_titan.data.prepare_tokenizer import prepare_encoding
from mhar_titan.data.tokenizer import default_cache_dir
from helpers import ROOT


@pytest.fixture(scope="module")
def bench_data():
    spec = importlib.util.spec_from_file_location("bench_data", ROOT / "bench" / "data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_appends_table_with_command_machine_versions_and_date(bench_data, tmp_path, capsys):
    prepare_encoding("gpt2", default_cache_dir())
    rng, words = random.Random(0), "a bench of small words for the toy corpus".split()
    for s in range(2):
        texts = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) for _ in range(20)]
        pq.write_table(pa.table({"text": texts}), tmp_path / f"train-{s}.parquet")
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\n## Data loader\n\nEarlier notes.\n\n## Kernels: depth routing\n\nKernel text.\n")
    argv = ["--data", str(tmp_path), "--seq-len", "16", "--batch", "2", "--tokens", "640", "--workers", "0",
            "--long-chars", "3000", "--append", str(out)]
    bench_data.main(argv)
    text = out.read_text()
    data_section = text[text.index("## Data loader"):text.index("## Kernels")]
    assert "Earlier notes." in data_section and text.rstrip().endswith("Kernel text.")
    assert f"python bench/data.py --data {tmp_path}" in data_section
    assert f"{__import__('os').cpu_count()} CPU cores" in data_section and "Date: " in data_section
    assert "tiktoken " in data_section and "torch " in data_section
    rows = [line for line in data_section.splitlines() if line.startswith("| ") and " M |" in line]
    # raw encode, window x1, document x1, long-document window x1 and document x1, pretokenized, pretokenize command
    assert len(rows) == 7
    assert all(float(line.split("|")[2].split()[0]) > 0 for line in rows)
    long_rows = [line for line in rows if "M characters" in line]
    assert len(long_rows) == 2 and all(float(line.split("|")[3]) > 0 for line in long_rows)  # ratio to the corpus
    assert "appended to" in capsys.readouterr().out

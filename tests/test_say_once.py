"""One error, said once (real torchrun with 2 CPU ranks on gloo, a real unreachable hub on loopback).

* A user's error under torchrun (a memory fit the job does not have, a bad data file) ends the launch
  with its one line and exit code 2: no copy per rank, no torchrun failure lines, no
  ``ChildFailedError`` traceback (``mhar_titan.torchrun``, ``mhar_titan.say_once``). A rank whose
  error differs from rank 0's says its own.
* A Python warning every rank meets prints once.
* With the Hugging Face hub unreachable (a closed port on loopback as HF_ENDPOINT, not offline
  mode), huggingface_hub's retries come as one line naming the request, no line twice.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from helpers import PATIENCE_S, ROOT

DEBUG = str(ROOT / "train_configs" / "debug_mhar.toml")


def launch_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MHAR_", "TORCHELASTIC_"))}
    env.update(PYTHON=sys.executable, **extra)
    return env


def failure_noise(text: str) -> list[str]:
    """What torchrun adds to a failed launch: its traceback and its failure lines."""
    return [line for line in text.splitlines()
            if any(s in line for s in ("Traceback", "ChildFailedError", "failed (exitcode", "closing signal",
                                       "Root Cause", "FAILED"))]


@pytest.mark.distributed  # scripts/run_train.sh with NGPU=2: torchrun
def test_a_memory_fit_error_of_two_ranks_is_one_line_and_exit_2(tmp_path):
    """scripts/run_train.sh, both ranks' output shown: the MemoryFitError every rank meets (each with
    its own measured free memory) is printed once, by rank 0, and the launch exits 2."""
    r = subprocess.run(["bash", str(ROOT / "scripts" / "run_train.sh"), f"--job.dump_folder={tmp_path}",
                        "--training.seq_len=1000000"], cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE_S,
                       env=launch_env(NGPU="2", LOG_RANK="0,1", CONFIG=DEBUG))
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    said = [line for line in out.splitlines() if "MemoryFitError" in line]
    assert len(said) == 1 and said[0].startswith("[rank0]:cannot start training: MemoryFitError: the job does not "
                                                 "fit"), out
    assert failure_noise(out) == [], out


def run_entry(tmp_path, **faults) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mhar_titan.torchrun", "--nproc_per_node=2", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", "--role=rank", "--tee=3", str(ROOT / "tests" / "say_once_entry.py"),
           "--config", DEBUG, f"--job.dump_folder={tmp_path}", "--training.steps=1"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE_S,
                          env=launch_env(**faults))


@pytest.mark.distributed  # mhar_titan.torchrun with 2 ranks
def test_a_rank_says_its_error_only_where_it_differs_and_warnings_print_once(tmp_path):
    both = run_entry(tmp_path, MHAR_TEST_WARN="1", MHAR_TEST_DATA_ERROR_RANK0="data/a.jsonl:3: not valid JSON",
                     MHAR_TEST_DATA_ERROR_RANK1="data/b.jsonl:9: no key 'text'")
    out = both.stdout + both.stderr
    assert both.returncode == 2, out
    # each rank's own line (torchrun merges the ranks' streams in no fixed order)
    assert sorted(line for line in out.splitlines() if "DataError" in line) == [
        "[rank0]:cannot start training: DataError: data/a.jsonl:3: not valid JSON",
        "[rank1]:[rank 1] cannot start training: DataError: data/b.jsonl:9: no key 'text'"], out
    assert failure_noise(out) == [], out
    assert out.count("UserWarning: a warning every rank meets in the same words") == 1, out  # rank 0 only

    # only rank 1 fails: rank 0's line quotes it (every rank stops together), rank 1 adds nothing
    one = run_entry(tmp_path / "one", MHAR_TEST_DATA_ERROR_RANK1="data/b.jsonl:9: no key 'text'")
    out = one.stdout + one.stderr
    assert one.returncode == 2, out
    said = [line for line in out.splitlines() if "no key 'text'" in line]
    assert said == ["[rank0]:cannot start training: UserError: rank 1 could not start: DataError: data/b.jsonl:9: "
                    "no key 'text'"], out
    assert failure_noise(out) == [], out


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # train.py against a stand-in for the hub (a closed port), its retries
def test_an_unreachable_hub_is_one_counted_line_not_a_page_of_retries(tmp_path):
    port = closed_port()
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HOME=str(tmp_path / "hf"))
    r = subprocess.run([sys.executable, "train.py", "--config", DEBUG, f"--job.dump_folder={tmp_path}",
                        "--data.source=hub", "--data.hub_path=HuggingFaceFW/fineweb-edu", "--data.hub_name=sample-10BT",
                        "--validation.enable=false", "--data.hub_retry_max_s=5"],
                       cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE_S, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == len(set(lines)), out  # no line twice
    assert not [line for line in lines if "Retrying in" in line or "thrown while requesting" in line], out
    hub = [line for line in lines if line.startswith("hub: ")]
    assert len(hub) == 1 and f"http://127.0.0.1:{port}/" in hub[0] and "retries it up to 5 times" in hub[0], out
    assert lines[-1].startswith("cannot start training: DataError: opening the training data"), out


@pytest.mark.slow  # huggingface_hub's retries against a stand-in for the hub (a closed port)
def test_hub_retries_of_one_request_log_one_line():
    """The filter every command that may reach the hub installs (train.py, python -m mhar_titan.eval),
    on huggingface_hub's own retry loop against a closed loopback port (a fresh process: the tests
    run with HF_HUB_OFFLINE set, which refuses before any request)."""
    url = f"http://127.0.0.1:{closed_port()}/datasets/x/resolve/main/README.md"
    code = (
        "import logging, sys\n"
        "logging.basicConfig(format='%(name)s | %(message)s')\n"
        "from huggingface_hub.utils import http_backoff\n"
        "from mhar_titan.say_once import quiet_other_ranks\n"
        "quiet_other_ranks()\n"
        "try:\n"
        f"    http_backoff('HEAD', {url!r}, max_retries=3, base_wait_time=0.01, max_wait_time=0.01)\n"
        "except Exception as e:\n"
        "    print('raised', type(e).__name__, file=sys.stderr)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE_S,
                       env=env)
    lines = r.stderr.splitlines()
    assert lines[-1] == "raised ConnectError", r.stderr
    assert len(lines) == 2 and lines[0].startswith(f"hub: HEAD {url} failed (") and "up to 3 times" in lines[0], \
        r.stderr

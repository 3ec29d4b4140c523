"""Acceptance 5: the dry run (python -m mhar_titan.dryrun, DRY_RUN=1 scripts/run_train.sh).

The 1b configs are dry-run on CPU in a fresh process whose sockets raise on any
connection attempt: the model must stay on the meta device (the process's own peak RSS
grows by far less than the 3.8 GiB that 1B fp32 parameters would need) and the printed
parameter counts must be a row of the model-zoo listing (`python -m mhar_titan.models`).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from mhar_titan.config import ConfigError, load_config
from mhar_titan.dryrun import build_meta_model, build_model_args, estimate_memory, report
from mhar_titan.models import count_parameters
from helpers import PATIENCE_S
from slurm_tools import ROOT, launch_env

CONFIGS_1B = sorted(ROOT.glob("train_configs/*_1b.toml"))
DEBUG = str(ROOT / "train_configs" / "debug_mhar.toml")

# The memory of the process that runs it, from its own /proc counters (MiB). Not
# getrusage's ru_maxrss: a child started by subprocess inherits the parent's high-water mark
# across exec, so a probe started by a pytest process of 1.5 GB read 1532 MiB.
OWN_MEMORY = r"""
def own_mib(field):  # "VmRSS" (now) or "VmHWM" (peak) of this process
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024
"""

# Runs in a fresh interpreter: forbid network, dry-run every config, run the zoo listing,
# report this process's RSS after its imports and its peak. Prints one JSON line at the end.
PROBE = OWN_MEMORY + r"""
import contextlib, io, json, socket, sys

def no_network(*args, **kwargs):
    raise RuntimeError(f"network access attempted during the dry run: {args!r}")
socket.socket.connect = socket.socket.connect_ex = no_network
socket.create_connection = socket.getaddrinfo = no_network

from mhar_titan.dryrun import main
import mhar_titan.models.__main__
base_mib = own_mib("VmRSS")
results = {}
for config in sys.argv[1:]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["--config", config, "--world-size", "8", "--device", "cpu", "--memory-gib", "80"])
    results[config] = {"code": code, "stdout": out.getvalue()}
listing = io.StringIO()
with contextlib.redirect_stdout(listing):
    mhar_titan.models.__main__.main([])  # the listing python -m mhar_titan.models prints
print(json.dumps({"results": results, "listing": listing.getvalue(),
                  "base_mib": base_mib, "peak_mib": own_mib("VmHWM")}))
"""


def counts_from_dryrun(text: str) -> tuple[int, int, int]:
    """(total, non-embedding, connection) parameters the dry run printed."""
    grab = lambda name: int(re.search(rf"^\s+{name}\s+([\d,]+)(  \(.*\))?$", text, re.M).group(1).replace(",", ""))
    return grab("total"), grab("non-embedding"), grab("connection")


def listing_rows(text: str) -> set[tuple[str, int, int, int]]:
    """(flavor, total, non-embedding, routing extra) of every row of the zoo listing."""
    rows = set()
    for line in text.splitlines():
        numbers = re.findall(r"\b\d{1,3}(?:,\d{3})+\b|\b\d+\b", line)
        if line and not line.startswith(("flavor", "-")) and len(numbers) >= 4:
            total, non_emb, routing = (int(n.replace(",", "")) for n in numbers[-3:])
            rows.add((line.split()[0], total, non_emb, routing))
    return rows


@pytest.mark.slow
def test_dry_run_1b_configs_offline_on_meta_matches_zoo_listing():
    if not CONFIGS_1B:
        msg = "no train_configs/*_1b.toml yet (written by the configs owner)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    r = subprocess.run([sys.executable, "-c", PROBE, *map(str, CONFIGS_1B)], cwd=ROOT, env=launch_env(),
                       capture_output=True, text=True, timeout=PATIENCE_S)
    assert r.returncode == 0, r.stderr[-3000:]
    probe = json.loads(r.stdout.strip().splitlines()[-1])
    zoo = listing_rows(probe["listing"])
    assert any(flavor == "1b" for flavor, *_ in zoo), probe["listing"]
    for config, res in probe["results"].items():
        assert res["code"] == 0, (config, r.stderr[-3000:])
        text = res["stdout"]
        assert "dry run: OK" in text and "[model]" in text and "memory estimate per rank" in text
        assert "fits in 80.00 GiB (--memory-gib)" in text
        total, non_emb, routing = counts_from_dryrun(text)
        assert total > 900_000_000, (config, total)
        assert ("1b", total, non_emb, routing) in zoo, (config, total, non_emb, routing, probe["listing"])
    # fp32 parameters of one 1B model alone would be ~3.8 GiB (bf16: 1.9 GiB). Measured growth
    # over the imports: 190 MiB (2026-12-01, 2 cores, load 5), spread by the allocator only.
    grown = probe["peak_mib"] - probe["base_mib"]
    assert grown < 1024, (probe["base_mib"], probe["peak_mib"])


def test_the_probe_measures_its_own_memory_not_its_parents():
    """The probe is started by a pytest process that may hold 1.5 GB by then: its memory figure
    must be its own. Here the parent holds 768 MiB more; a child that imports nothing reads
    about 10 MiB (getrusage's ru_maxrss reads more than the parent's 768 MiB)."""
    import torch

    held = torch.ones(768 * 2**20, dtype=torch.uint8)  # resident: every page written
    r = subprocess.run([sys.executable, "-c", OWN_MEMORY + "import resource\n"
                        "print(own_mib('VmHWM'), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"],
                       capture_output=True, text=True, timeout=PATIENCE_S)
    del held
    assert r.returncode == 0, r.stderr
    own, inherited = map(float, r.stdout.split())
    assert own < 256, (own, inherited)


def test_run_train_dry_run_mode_validates_for_ngpu_ranks():
    config = str(CONFIGS_1B[0]) if CONFIGS_1B else DEBUG
    script = str(ROOT / "scripts" / "run_train.sh")
    env = launch_env(DRY_RUN="1", NGPU="8", CONFIG=config)
    ok = subprocess.run(["bash", script, "--training.local_batch_size=2", "--training.global_batch_size=32"],
                        env=env, capture_output=True, text=True, timeout=PATIENCE_S)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert re.search(r"batch: 8 ranks x local 2 x grad accumulation 2 = 32 sequences", ok.stdout), ok.stdout[:2000]
    cfg = load_config(config, ["--training.local_batch_size=2"])
    assert counts_from_dryrun(ok.stdout)[0] == count_parameters(build_model_args(cfg)).total



@pytest.mark.parametrize("overrides, message", [
    (["--training.seq_len=1024", "--model.max_seq_len=512"], "'training.seq_len' (1024) exceeds 'model.max_seq_len' (512)"),
    (["--data.tokenizer=cl100k_base", "--model.vocab_size=50304"],
     "'model.vocab_size' (50304) is smaller than tokenizer 'cl100k_base' (100277 tokens)"),
    (["--parallelism.data_parallel_shard_degree=2"], "data_parallel_shard_degree' = 2 but the job has 4 ranks"),
    (["--model.routing_heads=3"], "dim d=128 is not divisible by routing heads H=3"),
    (["--data.sharding=rows"], "data.sharding must be one of"),
    (["--data.files=[]"], "'data.files' is empty"),
    (["--training.local_batch_size=2", "--training.global_batch_size=12"],
     "'training.global_batch_size' (12) must be a multiple of local_batch_size x ranks = 2 x 4 = 8"),
])
def test_invalid_jobs_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        report(load_config(DEBUG, overrides), world_size=4, device="cpu")


@pytest.mark.parametrize("argv, last", [
    (["--device", "cpu", "--memory-gib", "80"], "dry run: OK (nothing was trained)"),
    (["--device", "cpu", "--memory-gib", "80", "--training.memory_check=off"],
     'dry run: config valid, nothing trained; NOT checked: memory fit (training.memory_check = "off")'),
    (["--device", "cpu", "--memory-gib", "80", "--data.tokenizer=hf:/nowhere", "--model.vocab_size=1024"],
     "dry run: config valid, nothing trained; NOT checked: tokenizer 'hf:/nowhere': a Hugging Face folder's "
     "tokenizer is read when training starts (model.vocab_size = 1024 must cover it)"),
])
def test_the_last_line_says_ok_only_when_the_memory_fit_was_checked(argv, last, capsys):
    from mhar_titan.dryrun import main

    assert main(["--config", DEBUG, *argv]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == last
    assert (" not checked" in err) == ("NOT checked" in last)


def test_without_the_device_or_memory_gib_the_fit_is_not_checked_and_the_last_line_says_so(capsys):
    import torch

    from mhar_titan.dryrun import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the fit is checked against cuda:0")
    assert main(["--config", DEBUG, "--device", "cuda"]) == 0
    out, err = capsys.readouterr()
    assert "  fit             not checked (no cuda device here: pass --memory-gib" in out
    assert out.splitlines()[-1] == ("dry run: config valid, nothing trained; NOT checked: memory fit "
                                    "(no cuda device here: pass --memory-gib, the memory per rank)")
    assert "dry run: OK" not in out


def test_the_model_line_says_which_routing_implementation_runs(capsys):
    from mhar_kernels import dispatch
    from mhar_titan.dryrun import main

    assert main(["--config", DEBUG, "--device", "cpu", "--memory-gib", "8", "--model.routing_kernel=triton"]) == 0
    model = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("model: "))
    runs = dispatch.backend("triton", "cpu", 128, 8)
    assert model.endswith("routing_kernel=triton" if runs == "triton" else "routing_kernel=triton (runs eager on cpu)")
    assert main(["--config", DEBUG, "--device", "cpu", "--memory-gib", "8"]) == 0  # eager asked, eager runs
    model = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("model: "))
    assert model.endswith("routing_kernel=eager")


def test_cli_exit_code_and_message(capsys):
    from mhar_titan.dryrun import main

    assert main(["--config", DEBUG, "--world-size", "4", "--training.seq_len=4096", "--model.max_seq_len=512"]) == 2
    assert "dry run: invalid job: 'training.seq_len' (4096) exceeds" in capsys.readouterr().err
    assert main(["--config", "train_configs/missing.toml"]) == 2
    assert "config file not found: train_configs/missing.toml" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, vocab, max_seq_len", [
    ([], 50304, 512),
    (["--training.seq_len=4096"], 50304, 4096),  # the trainer raises max_seq_len to seq_len
    (["--data.tokenizer=cl100k_base"], 100352, 512),  # and pads the tokenizer's vocabulary (100,277)
    (["--data.tokenizer=o200k_base"], 200064, 512),
])
def test_dry_run_sizes_the_model_like_the_trainer(overrides, vocab, max_seq_len, capsys):
    from mhar_titan.dryrun import main

    assert main(["--config", DEBUG, "--device", "cpu", *overrides]) == 0
    assert f"vocab={vocab} " in capsys.readouterr().out
    args = build_model_args(load_config(DEBUG, overrides))
    assert (args.vocab_size, args.max_seq_len) == (vocab, max_seq_len)


def test_known_vocab_sizes_match_tiktoken():
    """data.tokenizer.N_VOCAB against the encodings themselves, where the offline cache has them."""
    from mhar_titan.data import DataConfig, build_tokenizer
    from mhar_titan.data.tokenizer import N_VOCAB as TOKENIZER_N_VOCAB
    from mhar_titan.data.tokenizer import check_cache, default_cache_dir

    checked = 0
    for name, n_vocab in TOKENIZER_N_VOCAB.items():
        try:
            check_cache(name, default_cache_dir())
        except Exception:
            continue
        assert build_tokenizer(DataConfig(tokenizer=name)).n_vocab == n_vocab, name
        checked += 1
    if not checked:
        pytest.skip("no tiktoken encoding cached: run python -m mhar_titan.data.prepare_tokenizer")


def test_memory_estimate_terms():
    cfg = load_config(DEBUG, ["--training.local_batch_size=4", "--training.seq_len=256"])
    model = build_meta_model(build_model_args(cfg))
    n = sum(p.numel() for p in model.parameters())
    m1, m4 = estimate_memory(model, cfg, 1, "cpu"), estimate_memory(model, cfg, 4, "cpu")
    # sharded fp32 state: 4 (params) + 4 (grads) + 8 (AdamW) bytes per parameter, split over ranks
    assert (m1.params, m1.grads, m1.optimizer) == (4 * n, 4 * n, 8 * n)
    assert (m4.params, m4.grads, m4.optimizer) == (n, n, 2 * n)
    assert m4.activations == m1.activations  # activations are per rank and micro-batch
    p_block = sum(p.numel() for p in model.layers[0].parameters())
    p_root = n - 4 * p_block
    assert m1.gathered_params == (2 * p_block + p_root) * 4  # two blocks in flight + the root unit, fp32
    never = load_config(DEBUG, ["--training.local_batch_size=4", "--training.seq_len=256",
                                "--parallelism.fsdp_reshard_after_forward=never"])
    assert estimate_memory(model, never, 4, "cpu").gathered_params == n * 4
    # bf16 compute halves the per-element activation bytes (the fp32 loss terms stay)
    assert estimate_memory(model, cfg, 1, "cuda").activations < m1.activations
    full = load_config(DEBUG, ["--training.local_batch_size=4", "--training.seq_len=256",
                               "--activation_checkpoint.mode=full"])
    assert estimate_memory(model, full, 1, "cpu").activations < m1.activations
    # eager routing keeps normalised keys of every source at every site; the Triton kernel does not
    d, S, tokens = 128, 2 * 4 + 1, 4 * 256
    triton_cfg = load_config(DEBUG, ["--training.local_batch_size=4", "--training.seq_len=256",
                                     "--model.routing_kernel=triton"])
    triton_model = build_meta_model(build_model_args(triton_cfg))
    saved_keys = m1.activations - estimate_memory(triton_model, triton_cfg, 1, "cpu").activations
    assert saved_keys == tokens * S * (S + 1) // 2 * d * 4


def test_memory_estimate_under_full_checkpointing_keeps_one_block_of_routing_keys():
    base = ["--training.local_batch_size=4", "--training.seq_len=256", "--activation_checkpoint.mode=full"]
    eager = load_config(DEBUG, base)
    triton = load_config(DEBUG, base + ["--model.routing_kernel=triton"])
    diff = (estimate_memory(build_meta_model(build_model_args(eager)), eager, 1, "cpu").activations
            - estimate_memory(build_meta_model(build_model_args(triton)), triton, 1, "cpu").activations)
    d, L, tokens = 128, 4, 4 * 256
    # the recomputed deepest block's two sites (2L-1 and 2L sources) plus the final site (2L+1)
    assert diff == tokens * ((2 * L - 1) + 2 * L + (2 * L + 1)) * d * 4


def test_memory_estimate_counts_the_loss_path_as_built():
    """baseline_100m (8 x 2048 tokens, vocab 100,352, bf16 on CUDA): the chunked loss path (default)
    is modelled >= 8x smaller than the plain one, as the chunked loss's test measures at a scaled shape."""
    config = str(ROOT / "train_configs" / "baseline_100m.toml")
    mems = {}
    for path in ("plain", "chunked"):
        cfg = load_config(config, [f"--training.loss_path={path}", "--training.local_batch_size=8"])
        mems[path] = estimate_memory(build_meta_model(build_model_args(cfg)), cfg, 8, "cuda")
    tokens, vocab = 8 * 2048, 100_352
    assert mems["plain"].loss_path == tokens * vocab * (2 + 8)
    assert mems["plain"].loss_path >= 8 * mems["chunked"].loss_path
    assert mems["plain"].activations == mems["chunked"].activations
    text, _ = report(load_config(config, ["--training.local_batch_size=8"]), 8, "cuda")
    assert f"  {'loss_path':<16}{mems['chunked'].loss_path / 2**30:>10.2f} GiB" in text, text


def test_dry_run_says_whether_the_step_is_host_bound():
    """For a CUDA job the dry run prints the host-vs-GPU verdict of one micro-batch step by the
    benchmark's own figures (`performance.HOST_STEP_MS`, measured by bench/step_host.py, beside
    `performance.modelled_gpu_ms`): the paper's 1b MHAR recipe at one sequence per micro-batch on
    one rank is host-bound and is told the local batch (with the accumulation that keeps the 32
    sequences) at which the GPU time covers the host's, or CUDA graphs; at 32 sequences per
    micro-batch it is GPU-bound. A flavor with no measured host time says so."""
    from mhar_titan.components import performance

    config = str(ROOT / "train_configs" / "mhar_1b.toml")
    cfg = load_config(config, ["--training.local_batch_size=1"])
    args = build_model_args(cfg)
    host = performance.HOST_STEP_MS[("1b", "mhar", "full")]
    small = performance.modelled_gpu_ms(args, 1, 1024, "full")["total_ms"]
    assert host > small  # the figures themselves: one sequence of 1b is host-bound
    text, _ = report(cfg, 1, "cuda")
    verdict = re.search(r"verdict +host-bound by ([\d.]+)x", text)
    assert verdict and abs(float(verdict.group(1)) - host / small) < 0.01, text
    change = re.search(r"training\.local_batch_size = (\d+) with gradient accumulation (\d+) \(the same global "
                       r"batch of 32 sequences\), or CUDA graphs", text)
    assert change, text
    local, accum = int(change.group(1)), int(change.group(2))
    assert local * accum == 32 and local & (local - 1) == 0
    # the suggested split is the smallest power of two at which the modelled GPU time covers the host's
    assert performance.modelled_gpu_ms(args, local, 1024, "full")["total_ms"] >= host
    assert local == 2 or performance.modelled_gpu_ms(args, local // 2, 1024, "full")["total_ms"] < host

    big, _ = report(load_config(config, ["--training.local_batch_size=32"]), 1, "cuda")
    assert re.search(r"verdict +GPU-bound by [\d.]+x", big) and "to change" not in big, big
    # eight ranks with no accumulation left: no larger local batch keeps the global batch
    eight, _ = report(load_config(config, ["--training.local_batch_size=4"]), 8, "cuda")
    if "host-bound" in eight:
        assert "(no larger local batch keeps the global batch of 32 sequences" in eight, eight
        assert "to change       CUDA graphs (training.cuda_graphs = true) (no larger local batch" in eight, \
            eight  # the fused routing is captured with the rest of the step
    debug, _ = report(load_config(DEBUG, ["--model.routing_kernel=auto"]), 1, "cuda")
    assert "not modelled: no measured host time for flavor 'debug'" in debug

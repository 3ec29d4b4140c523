"""Exported folders load in stock transformers, in a process that sees only the installed package
(issue 24, acceptance 2).

One debug-flavor model of each family is exported (standard with q/k norm -> Qwen3, standard
without -> Llama, AttnRes, MHAR, block, delta in both layouts -> mhar_titan folders with remote
code), with the tiktoken gpt2 encoding, the byte tokenizer and a Llama-3-style folder tokenizer;
a cl100k_base tokenizer folder joins them. The folders are copied elsewhere and a child process
(cwd a temp folder, no checkout on its path; the package installed from this checkout with pip
into a temp folder, so the test means the same here and in a fresh clone) loads each with the
Auto classes. Supported transformers: 4.51 (the first with Qwen3) to 5.x; the test runs the
installed version and 4.51.3 (``make transformers-oldest`` installs it beside the venv).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from helpers import PATIENCE_S, ROOT, llama3_tokenizer_folder, trained_like_debug  # noqa: E402
from mhar_titan.convert import export_pretrained  # noqa: E402
from mhar_titan.convert.mhar_format import AUTO_MAP, REMOTE_FILES  # noqa: E402
from mhar_titan.convert.tokenizer_files import write_tokenizer_files  # noqa: E402
from mhar_titan.data import DataConfig, build_tokenizer  # noqa: E402
from mhar_titan.data.hf_tokenizer import load_hf_tokenizer  # noqa: E402
from mhar_titan.eval.generation import generate  # noqa: E402
from mhar_titan.models import FAMILIES  # noqa: E402

OLDEST = "4.51.3"
OLDEST_DIR = Path(sys.prefix) / f"transformers-{OLDEST.rsplit('.', 1)[0]}"
"""Where ``make transformers-oldest`` installs transformers 4.51.3 (with its tokenizers and hub)."""

TEXT = "Ünïcödé wörds, naïve café — 東京で会いましょう 🦊 Ελληνικά и русский 12345 it's\n\n  tabs\tend"
STEPS = 6
CASES = {  # name: (ModelArgs fields, tokenizer, transformers class or None for remote code)
    "standard qk-norm tied (Qwen3)": (dict(FAMILIES["baseline"]), "gpt2", "Qwen3ForCausalLM"),
    "standard untied (Llama)": (dict(FAMILIES["baseline"], qk_norm=False, tie_embeddings=False), "bytes",
                                "LlamaForCausalLM"),
    "attn_res H=1": (dict(FAMILIES["attn_res H=1"]), "bytes", None),
    "mhar H=8 untied": (dict(FAMILIES["mhar H=8"], tie_embeddings=False), "llama3", None),
    "block H=8": (dict(FAMILIES["block H=8"]), "bytes", None),
    "mhar H=8 learned temperature": (dict(FAMILIES["mhar H=8"], routing_temperature="learned",
                                          routing_logit_scale="match_heads:8"), "bytes", None),
    "delta block clean": (dict(FAMILIES["delta block H=8 +null"]), "bytes", None),
    "delta paper": (dict(FAMILIES["delta block H=8 +null"], routing_layout="paper", routing_eps=1e-6), "bytes", None),
    "dense": (dict(FAMILIES["dense"]), "bytes", None),
    "mudd": (dict(FAMILIES["mudd"]), "bytes", None),
    "hyper": (dict(FAMILIES["hyper"]), "bytes", None),
    "mhc": (dict(FAMILIES["mhc"]), "bytes", None),
}


def install_package(tmp: Path) -> Path:
    """pip-install a copy of this checkout (not editable, no dependencies) into ``tmp/site``."""
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copyfile(ROOT / name, source / name)
    for name in ("mhar_titan", "kernels"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-compile",
                    "--target", str(tmp / "site"), str(source)], check=True, capture_output=True, timeout=PATIENCE_S)
    return tmp / "site"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(spec for the child, our logits per case, the tokenizers' ids): folders exported, then
    copied to another folder, and the package installed outside the checkout."""
    tmp = tmp_path_factory.mktemp("export_stock")
    site = install_package(tmp)
    llama3 = load_hf_tokenizer(llama3_tokenizer_folder(tmp / "llama3_tokenizer", TEXT * 4 + "the quick brown fox " * 20,
                                                       ["<|begin_of_text|>", "<|end_of_text|>"]))
    tokenizers = {"gpt2": build_tokenizer(DataConfig(tokenizer="gpt2")),
                  "bytes": build_tokenizer(DataConfig(tokenizer="bytes")), "llama3": llama3}
    cases, ours = [], {}
    for name, (fields, tok_name, _) in CASES.items():
        tokenizer = tokenizers[tok_name]
        model = trained_like_debug(fields, 50_304 if tok_name == "gpt2" else 384)
        folder = tmp / "export" / name.replace(" ", "_")
        export_pretrained(model, folder, tokenizer=tokenizer)
        tokens = tokenizer.encode("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet")
        assert len(tokens) >= 17  # the batched prompts are 1, 5 and 17 tokens long
        with torch.no_grad():
            logits = model(torch.tensor([tokens]))[0]
        greedy = generate(model, tokens[:8], STEPS, stop_ids=[tokenizer.eos_id], n_vocab=tokenizer.n_vocab).tolist()
        ours[name] = (logits, greedy, tokenizer.encode(TEXT), tokenizer.eos_id)
        cases.append(dict(name=name, folder=folder, remote=CASES[name][2] is None, tokens=tokens, prompt=tokens[:8],
                          steps=STEPS, text=TEXT, n_vocab=tokenizer.n_vocab))
    cl100k = build_tokenizer(DataConfig(tokenizer="cl100k_base"))
    (tmp / "export" / "cl100k_base").mkdir()
    write_tokenizer_files(cl100k, tmp / "export" / "cl100k_base", 512)
    cases.append(dict(name="cl100k_base", folder=tmp / "export" / "cl100k_base", text=TEXT))
    ours["cl100k_base"] = (None, None, cl100k.encode(TEXT), cl100k.eos_id)
    shutil.copytree(tmp / "export", tmp / "elsewhere")
    for case in cases:
        case["folder"] = str(tmp / "elsewhere" / Path(case["folder"]).name)
    shutil.rmtree(tmp / "export")
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"repo": str(ROOT), "site": str(site), "cases": cases}))
    return tmp, site, spec, ours


def run_child(tmp: Path, site: Path, spec: Path, extra_path: list[str]) -> dict:
    """Run hf_export_child.py (copied out of the checkout) in a fresh process that sees only ``site``."""
    child_dir = tmp / "child"
    child_dir.mkdir(exist_ok=True)
    script = shutil.copyfile(ROOT / "tests" / "hf_export_child.py", child_dir / "hf_export_child.py")
    out = child_dir / f"out-{len(extra_path)}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONPATH=os.pathsep.join([*extra_path, str(site)]), HF_HOME=str(tmp / "hf_home"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    # stdin closed: transformers 5 asks on a terminal whether to trust a routed folder's code when
    # AutoTokenizer reads its config.json; without one it reads the tokenizer files alone.
    result = subprocess.run([sys.executable, str(script), str(spec), str(out)], cwd=child_dir, env=env,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=PATIENCE_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def check(seen: dict, ours: dict, site: Path) -> None:
    assert Path(seen["mhar_titan_file"]).resolve().is_relative_to(site.resolve()), seen["mhar_titan_file"]
    assert not Path(seen["cwd"]).resolve().is_relative_to(ROOT) and not seen["sys_path_has_repo"]
    for name, (logits, greedy, ids, eos) in ours.items():
        case = seen["cases"][name]
        assert case["ids"] == ids, name
        if name not in CASES or CASES[name][2] is not None or seen["transformers"].startswith("4."):
            # transformers 5 asks before reading a remote-code folder's config.json, tokenizer or not
            assert not case["tokenizer_questions"] and not case["tokenizer_warnings"], (name, case)
        assert case["eos_token_id"] == eos, name
        if logits is None:
            continue
        expected_class = CASES[name][2] or "MharTitanForCausalLM"
        assert case["class"] == expected_class, name
        if CASES[name][2] is None:  # the remote code wraps the installed package's model
            assert not case["module"].startswith("transformers."), case["module"]
        diff = (torch.tensor(case["logits"]) - logits).abs().max().item()
        assert diff <= 1e-5, f"{name}: logits differ by {diff}"
        assert case["greedy"] == greedy, name
        if CASES[name][2] is None:
            check_remote(name, case)


def check_remote(name: str, case: dict) -> None:
    """A remote-code folder: batched generate() is generate_batch, whatever the padding; the
    tokenizer pads on the left; save_pretrained writes the same folder kind."""
    batched = case["batched"]
    if CASES[name][1] == "bytes":
        assert batched["lengths"] == [1, 5, 17], name
    for way in ("left", "right", "left no cache"):
        assert batched[way] == batched["reference"], (name, way)
    assert batched["padding_side"] == "left", name
    resaved = case["resaved"]
    assert resaved["same_logits"], name
    assert resaved["auto_map"] == AUTO_MAP, name
    assert set(resaved["files"]) == {"config.json", "generation_config.json", "model.safetensors", *REMOTE_FILES}, name
    assert resaved["modeling"] == REMOTE_FILES["modeling_mhar_titan.py"], name


@pytest.mark.slow  # about 50 s of child process on 2 loaded cores
def test_exported_folders_load_in_the_installed_transformers(exported):
    tmp, site, spec, ours = exported
    seen = run_child(tmp, site, spec, [])
    check(seen, ours, site)


@pytest.mark.slow
def test_exported_folders_load_in_the_oldest_supported_transformers(exported):
    if not (OLDEST_DIR / "transformers").is_dir():
        pytest.skip(f"transformers {OLDEST} is not installed in {OLDEST_DIR}: run `make transformers-oldest`")
    tmp, site, spec, ours = exported
    seen = run_child(tmp, site, spec, [str(OLDEST_DIR)])
    assert seen["transformers"] == OLDEST
    check(seen, ours, site)


@pytest.mark.parametrize("family", ["baseline", "delta block H=8 +null"])
def test_export_honours_the_umask_and_imports_back(tmp_path, family):
    """Every file an export writes gets the umask's mode, and import reads the folder back to the
    same logits (a Qwen3 folder for the standard model, a mhar_titan one for delta MHAR)."""
    from mhar_titan.convert import load_pretrained

    model = trained_like_debug(dict(FAMILIES[family]), 384)
    old = os.umask(0o027)
    try:
        export_pretrained(model, tmp_path / "out", tokenizer=build_tokenizer(DataConfig(tokenizer="bytes")))
    finally:
        os.umask(old)
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert len(files) >= 5 and {oct(p.stat().st_mode & 0o777) for p in files} == {oct(0o640)}
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == ("qwen3" if family == "baseline" else "mhar_titan") and config["eos_token_id"] == 256
    back = load_pretrained(tmp_path / "out")
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(back(tokens), model(tokens))
    assert load_hf_tokenizer(tmp_path / "out").encode(TEXT) == list(TEXT.encode())

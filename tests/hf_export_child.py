"""Child of test_convert_export_stock: loads exported folders with transformers' Auto classes in a
process whose path holds no checkout (only an installed copy of the package) and writes what it saw.

    python hf_export_child.py SPEC.json OUT.json

SPEC: {"repo": path of the checkout, "site": where the package is installed, "cases": [{"name",
"folder", "remote": bool, "prompt": ids, "tokens": ids, "steps": int, "text", "ids", "n_vocab"}, ...]}; a
case with no "tokens" is a tokenizer-only folder. OUT: per case the transformers class, the
logits (as a list) for "tokens", the greedy continuation of "prompt", the AutoTokenizer ids and
whether loading the tokenizer asked a question or logged a warning; for remote-code folders also
batched generation of prompts of 1, 5 and 17 tokens (left padded, right padded, without a cache)
next to ``generate_batch`` of the same rows, and a ``save_pretrained`` copy's files and logits.
"""
import builtins
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

spec = json.loads(Path(sys.argv[1]).read_text())
import mhar_titan  # noqa: E402  (after transformers: whichever resolves, it must be the installed copy)

out = {
    "transformers": transformers.__version__, "mhar_titan_file": mhar_titan.__file__, "cwd": os.getcwd(),
    "sys_path_has_repo": any(Path(p or ".").resolve() == Path(spec["repo"]).resolve() for p in sys.path),
    "cases": {},
}
questions, warnings = [], []


class Recorder(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            warnings.append(record.getMessage())


def ask(prompt=""):
    questions.append(prompt)
    return "n"


logging.getLogger("transformers").addHandler(Recorder())
builtins.input = ask  # transformers asks whether to trust a folder's code with input()


def new_tokens(generated, width, eos):
    """Each row's tokens after the prompt, up to and including the first eos."""
    out = []
    for row in generated[:, width:].tolist():
        out.append(row[:row.index(eos) + 1] if eos in row else row)
    return out


def batched(model, tokenizer, case):
    """Greedy generation of three prompts of 1, 5 and 17 tokens in one batch, three ways, and
    ``generate_batch`` of the same rows (after a forward: the RoPE tables are ready)."""
    from mhar_titan.eval.generation import generate_batch

    eos = tokenizer.eos_token_id
    texts = [tokenizer.decode(case["tokens"][:n]) for n in (1, 5, 17)]  # 1, 5 and 17 tokens (bytes tokenizer)
    rows = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    seen = {"lengths": [len(row) for row in rows]}
    for name, side, cache in (("left", "left", True), ("right", "right", True), ("left no cache", "left", False)):
        tokenizer.padding_side = side
        batch = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            generated = model.generate(**batch, max_new_tokens=case["steps"], do_sample=False, use_cache=cache)
        seen[name] = new_tokens(generated, batch["input_ids"].shape[1], eos)
    seen["padding_side"] = AutoTokenizer.from_pretrained(case["folder"]).padding_side
    seen["reference"] = generate_batch(model.model, rows, case["steps"], stop_ids=[eos], n_vocab=case["n_vocab"])
    return seen


def resaved(model, case):
    """save_pretrained into a new folder: its files, auto_map, and logits of the reloaded model."""
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        again = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            same = torch.equal(again(torch.tensor([case["tokens"]])).logits, model(torch.tensor([case["tokens"]])).logits)
        return {"files": sorted(p.name for p in Path(folder).iterdir()), "same_logits": same,
                "auto_map": json.loads((Path(folder) / "config.json").read_text()).get("auto_map"),
                "modeling": (Path(folder) / "modeling_mhar_titan.py").read_text()}


for case in spec["cases"]:
    seen = {}
    questions.clear()
    warnings.clear()
    tokenizer = AutoTokenizer.from_pretrained(case["folder"])
    seen["tokenizer_questions"], seen["tokenizer_warnings"] = list(questions), list(warnings)
    seen["ids"] = tokenizer.encode(case["text"], add_special_tokens=False)
    seen["eos_token_id"] = tokenizer.eos_token_id
    if "tokens" in case:
        model = AutoModelForCausalLM.from_pretrained(case["folder"], trust_remote_code=case["remote"],
                                                     torch_dtype=torch.float32).eval()
        seen["class"] = type(model).__name__
        seen["module"] = type(model).__module__
        with torch.no_grad():
            seen["logits"] = model(torch.tensor([case["tokens"]])).logits[0].tolist()
            prompt = torch.tensor([case["prompt"]])
            generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=case["steps"],
                                       do_sample=False, pad_token_id=tokenizer.eos_token_id)
        seen["greedy"] = generated[0, prompt.shape[1]:].tolist()
        if case["remote"]:
            seen["batched"] = batched(model, tokenizer, case)
            seen["resaved"] = resaved(model, case)
    out["cases"][case["name"]] = seen
Path(sys.argv[2]).write_text(json.dumps(out))

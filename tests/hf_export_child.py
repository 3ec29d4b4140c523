"""Child of test_convert_export_stock: loads exported folders with transformers' Auto classes in a
process whose path holds no checkout (only an installed copy of the package) and writes what it saw.

    python hf_export_child.py SPEC.json OUT.json

SPEC: {"repo": path of the checkout, "site": where the package is installed, "cases": [{"name",
"folder", "remote": bool, "prompt": ids, "tokens": ids, "steps": int, "text", "ids"}, ...]}; a
case with no "tokens" is a tokenizer-only folder. OUT: per case the transformers class, the
logits (as a list) for "tokens", the greedy continuation of "prompt" and the AutoTokenizer ids.
"""
import json
import os
import sys
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
for case in spec["cases"]:
    seen = {}
    tokenizer = AutoTokenizer.from_pretrained(case["folder"])
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
    out["cases"][case["name"]] = seen
Path(sys.argv[2]).write_text(json.dumps(out))

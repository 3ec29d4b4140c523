"""README.md as a new user reads it: every fenced code block, run in order after the quickstart.

The README marks a block that is not run here with an HTML comment on the line before it:

- ``<!-- doc-test: quickstart -->``: the quickstart. Its ``make train`` runs with the set-up a
  fresh clone's ``make train`` made (the virtual environment, the tokenizer cache, the Shakespeare
  sample: this checkout's), shrunk to the first look the README itself shows
  (``make train ARGS="..."``); its ``make test`` is this suite and is not started from inside it.
- ``<!-- doc-test: gpu -->`` (needs CUDA) and ``<!-- doc-test: hub -->`` (needs the Hugging Face
  hub): not run; bash must parse them and every repository path they name must exist.
- ``<!-- doc-test: file PATH -->``: an excerpt of PATH, which must hold it verbatim.

Every other block must be ``bash`` or ``python`` and runs, in the README's order, in a copy of the
repository (a git repository of its own) with the virtual environment activated, shrunk by nothing
but what the README shows. A block fails when it exits non-zero, prints "nothing to do", or holds a
training command whose run folder logged no new step; no example may train in the quickstart's run
folder (the test shrinks the quickstart, so what an example did there would not be what a user
sees). Afterwards ``git status`` of the copy must show nothing new or changed outside ignored paths.
Two blocks are checked further: the Python example says what it trained and sampled, without a
warning (``check_python_example``), and the mid-training command did every stage
(``test_toy_midtrain.check_the_toy_experiment``).

Every ``python`` command of the blocks (and of the scripts they run) is a process of its own forked
from one warm interpreter (tests/warm_python.py) that imported torch and the package once: the
commands run as written, without paying those imports each time. The small READMEs below check the
verdicts themselves: a block that exits non-zero, prints "nothing to do" or trains no step fails,
and so does a README that leaves files git sees changed.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import PATIENCE_S, ROOT
from test_toy_midtrain import check_the_toy_experiment
from warm_python import WarmPython

README = ROOT / "README.md"
SAMPLE = ROOT / "data" / "shakespeare" / "validation-00000-of-00001.parquet"
MARKER = re.compile(r"^<!--\s*doc-test:\s*(?P<kind>[a-z]+)(?:\s+(?P<arg>\S+))?\s*-->\s*$")
FENCE = re.compile(r"^```(?P<info>\S*)\s*$")
# commands that train: their run folders must log new steps
TRAINS = re.compile(r"(?:^|\s)(?:\S*/)?(?:train\.py|toy_midtrain\.sh)(?:\s|$)|mhar_titan\.experiments run |make .*\btrain\b")
NOTHING = re.compile(r"nothing (?:left )?to do", re.IGNORECASE)
HELP = re.compile(r"(?:^|\s)(?:--help|-h)(?:\s|=|$)")  # a command asking for its usage trains nothing
REPO_PATH = re.compile(r"^(?:train_configs|scripts|slurm|eval_tasks|bench|docs)/[^\s*?{}\[\]]+$")


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    info: str  # the fence's info string: bash, python, toml, ...
    kind: str  # the marker's kind, "run" without one
    arg: str | None
    text: str

    def __str__(self):
        return f"README.md:{self.line} ({self.info}, {self.kind})"


def readme_blocks(text: str | None = None) -> list[Block]:
    """Every fenced block of the README (top level and indented), with the marker on the line before."""
    lines = (README.read_text() if text is None else text).splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i].strip())
        if not fence:
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        marker = MARKER.match(lines[i - 1].strip()) if i else None
        body = "\n".join(line[indent:] for line in lines[i + 1:end]) + "\n"
        blocks.append(Block(i + 1, fence["info"], marker["kind"] if marker else "run",
                            marker["arg"] if marker else None, body))
        i = end + 1
    return blocks


def commands(block: Block) -> list[str]:
    """The block's shell commands, continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", block.text)
    return [line for line in (ln.strip() for ln in joined.splitlines()) if line and not line.startswith("#")]


def words_of(command: str) -> list[str]:
    """shlex words of a command, leading VAR=value assignments dropped."""
    words = shlex.split(command, comments=True)
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]
    return words


# ---------------------------------------------------------------------------------------------
# fast checks of the document itself


def test_every_block_is_run_or_marked_and_the_readme_is_short():
    """The front door stays under 300 lines; a block the doc test does not run says why."""
    text = README.read_text()
    assert len(text.splitlines()) < 300, f"README.md has {len(text.splitlines())} lines: move reference text to docs/"
    blocks = readme_blocks(text)
    assert sum(b.kind == "quickstart" for b in blocks) == 1, "mark the quickstart block <!-- doc-test: quickstart -->"
    for b in blocks:
        assert b.kind in {"run", "quickstart", "gpu", "hub", "file"}, f"{b}: unknown doc-test marker {b.kind!r}"
        if b.kind == "run":
            assert b.info in {"bash", "python"}, f"{b}: a block that is not run needs a doc-test marker"
            # make's set-up targets would install into the virtual environment the run shares with
            # this checkout; show `make` variants in the quickstart's text instead
            assert b.info != "bash" or not any(words_of(c)[:1] == ["make"] for c in commands(b)), \
                f"{b}: only the quickstart block runs make"
        if b.kind == "file":
            assert b.arg and (ROOT / b.arg).is_file(), f"{b}: names no file of the repository"
            assert b.text in (ROOT / b.arg).read_text(), f"{b}: is not a verbatim excerpt of {b.arg}"
        if b.kind in {"gpu", "hub", "quickstart"}:
            assert b.info == "bash", f"{b}: a marked command block is bash"
            parsed = subprocess.run(["bash", "-n"], input=b.text, capture_output=True, text=True)
            assert parsed.returncode == 0, f"{b}: {parsed.stderr}"
            for command in commands(b):
                for word in words_of(command):
                    if REPO_PATH.match(word):
                        assert (ROOT / word).exists(), f"{b}: {word} does not exist"


def under_outputs(value: str) -> bool:
    return value in {"outputs", "outputs/"} or value.startswith("outputs/")


@pytest.mark.parametrize("doc", ["README.md", "RESULTS.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_documented_commands_write_under_outputs(doc):
    """No command of the README, the guides or RESULTS.md writes into the repository's tracked
    folders: every output flag, dump folder and export destination is under outputs/ (ignored by git)."""
    for b in readme_blocks((ROOT / doc).read_text()):
        if b.info != "bash":
            continue
        for command in commands(b):
            words = words_of(command)
            for flag in ("--out", "--output-path", "--dump-folder", "--job.dump_folder"):
                for i, word in enumerate(words):
                    value = words[i + 1] if word == flag and i + 1 < len(words) else \
                        word.split("=", 1)[1] if word.startswith(flag + "=") else None
                    if value is not None:
                        assert under_outputs(value), f"{doc}: {b}: {command!r} writes to {value}"
            if words[:4] == ["python", "-m", "mhar_titan.convert", "export"]:
                destination = [w for w in words[4:] if not w.startswith("-")][1]
                assert under_outputs(destination), f"{doc}: {b}: {command!r} exports to {destination}"
        for value in re.findall(r'--(?:out|output-path|dump-folder)[= ](\S+)', b.text):
            assert under_outputs(value) or value.startswith("$"), f"{doc}: {b}: writes to {value}"


def test_readme_says_what_the_figures_need_before_the_first_figure_command():
    """The figures need matplotlib, which `make train` does not install: the README says so (and
    how to get it) before its first analysis command."""
    text = README.read_text()
    first = min(text.index(f"mhar_titan.analysis {c}") for c in ("heatmap", "probe", "compare"))
    before = text[:first]
    section = before[before.rindex("\n## "):]
    assert "matplotlib" in section and "make setup" in section, section


def test_readme_shows_a_sampled_generation_before_any_greedy_one():
    """Greedy decoding of the quickstart's tiny model prints newlines: the README's first
    generation (command or Python) samples, and the text says what greedy decoding gives."""
    text = README.read_text()
    generations = [c for b in readme_blocks(text) if b.kind == "run" for c in commands(b)
                   if "mhar_titan.generate" in c or "generate_batch(" in c]
    assert generations, "the README shows no generation"
    first = generations[0]
    temperature = re.search(r"(?:--temperature[= ]|temperature=)([0-9.]+)", first)
    if "generate_batch(" in first and not temperature:  # the call may continue on the next line
        block = next(b for b in readme_blocks(text) if first in commands(b))
        temperature = re.search(r"temperature=([0-9.]+)", block.text)
    assert temperature and float(temperature.group(1)) > 0, f"the first generation is greedy: {first}"
    assert re.search(r"[Gg]reedy decoding[^.]*repeats", text), "say what greedy decoding of a tiny model gives"


def test_benchmarks_is_a_short_reference_whose_figures_name_command_and_date():
    """BENCHMARKS.md is a table a user reads in a minute (at most 150 lines): every row names its
    command, shapes, machine, date and whether it was measured or modelled; the dated runs are in
    the lab notebook it links, docs/benchmarks-log.md."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) <= 150, "move dated runs to docs/benchmarks-log.md"
    assert "(docs/benchmarks-log.md)" in text and (ROOT / "docs" / "benchmarks-log.md").is_file()
    table = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header[:7] == ["what", "figure", "shapes", "command", "machine", "date", "measured or modelled"], header
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    assert len(rows) >= 5
    for row in rows:
        cells = dict(zip(header, row))
        assert re.search(r"`(?:python|make|bash) [^`]*`|`make [a-z]+`", cells["command"]), row
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", cells["date"]), row
        assert re.match(r"(?:host time )?(?:measured|modelled)", cells["measured or modelled"]), row
        assert cells["shapes"] and cells["machine"], row


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped, spaces to hyphens)."""
    found = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code and (heading := re.match(r"^#{1,6}\s+(.*?)\s*$", line)):
            found.add(re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-"))
    return found


@pytest.mark.parametrize("doc", ["README.md", "BENCHMARKS.md", "RESULTS.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_links_between_the_readme_and_the_guides_resolve(doc):
    """Text moved from the README into docs/ keeps working links: every relative link of the README,
    the guides, RESULTS.md and BENCHMARKS.md names a file of the repository and, with #anchor, one
    of its headings."""
    path = ROOT / doc
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        name, _, anchor = target.partition("#")
        linked = (path.parent / name).resolve() if name else path
        assert linked.exists(), f"{doc}: the link {target} names no file"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{doc}: the link {target} names no heading of {linked.name}"


# ---------------------------------------------------------------------------------------------
# the blocks, run


def copy_of_the_repository(dest: Path) -> Path:
    """The checkout's files (tracked and untracked-but-not-ignored, as they are now) in ``dest``,
    made a git repository of its own with everything staged, plus what the quickstart's set-up
    leaves: .venv (a link to this one), the tokenizer cache and the Shakespeare sample."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    (dest / ".venv").symlink_to(ROOT / ".venv", target_is_directory=True)
    shutil.copytree(ROOT / "data" / "shakespeare", dest / "data" / "shakespeare")
    if (ROOT / ".cache" / "tiktoken").is_dir():
        shutil.copytree(ROOT / ".cache" / "tiktoken", dest / ".cache" / "tiktoken")
    git = ["git", "-c", "core.autocrlf=false"]
    subprocess.run([*git, "init", "-q"], cwd=dest, check=True)
    subprocess.run([*git, "add", "-A"], cwd=dest, check=True)
    return dest


def run_folders(root: Path) -> dict[Path, int]:
    """Run folder -> the last step its metrics.jsonl logged, for every run folder under outputs/."""
    found = {}
    for metrics in (root / "outputs").rglob("metrics.jsonl"):
        steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines() if line.strip()]
        found[metrics.parent] = max(steps, default=0)
    return found


def train_folder(command: str, root: Path) -> Path | None:
    """The run folder a ``python train.py --config ...`` command trains, as the trainer resolves it."""
    from mhar_titan.config import load_config

    words = words_of(command)
    if words[:2] != ["python", "train.py"]:
        return None
    argv = [str(root / w) if i and words[i - 1] == "--config" else
            "--config=" + str(root / w.split("=", 1)[1]) if w.startswith("--config=") else w
            for i, w in enumerate(words[2:], start=2)]
    cfg = load_config(None, argv)
    folder = Path(cfg.job.dump_folder) / cfg.job.name
    return folder if folder.is_absolute() else root / folder


def quickstart_script(block: Block, readme: str) -> str:
    """The quickstart as it runs here: `make train` with the set-up done (the targets that install are
    taken as up to date, the venv's python) and the first-look ARGS the README shows; not `make test`."""
    shown = re.search(r'`make train ARGS="([^"`]+)"`', readme)
    assert shown, 'the README shows no shorter first look (`make train ARGS="--training.steps=N"`)'
    lines = []
    for command in commands(block):
        words = words_of(command)
        if words[:2] == ["make", "train"]:
            setup = re.search(r"^train:\s*(.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE).group(1).split()
            # the first look trains a folder of its own; shrunk to it, the quickstart stays in its folder, which
            # the README's later examples read (outputs/debug_mhar)
            args = re.sub(r"--job\.name=\S+\s*", "", shown.group(1))
            lines.append(shlex.join(["make", *[f"--assume-old={t}" for t in setup], *words[1:], "PY=python",
                                     f"ARGS={args}"]))
        else:
            assert words[:2] == ["make", "test"], f"{block}: an unexpected quickstart command {command!r}"
    return "\n".join(lines) + "\n"


def run_block(block: Block, script: str, root: Path, warm: WarmPython | None = None) -> tuple[str, str]:
    """Run one block in ``root`` with the virtual environment activated (and ``warm``'s `python`
    first on PATH); (stdout, stderr). AssertionError when it exits non-zero or prints "nothing to do"."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "VIRTUAL_ENV"))}
    env["PYTHONUNBUFFERED"] = "1"
    activate = "source .venv/bin/activate\n"
    if warm is not None:
        env = warm.env(env)
        env["PYTHON"] = str(warm.bin / "python")  # the interpreter scripts/*.sh run (theirs: .venv/bin/python)
        activate += f"export PATH={shlex.quote(str(warm.bin))}:$PATH\n"
    if block.info == "python":
        (root / "outputs").mkdir(exist_ok=True)
        path = root / "outputs" / f"readme_block_{block.line}.py"
        path.write_text(script)
        argv = ["bash", "-e", "-c", activate + f"python {shlex.quote(str(path))}"]
    else:
        argv = ["bash", "-e", "-o", "pipefail", "-c", activate + script]
    done = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=PATIENCE_S)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{block} exited {done.returncode}:\n{script}\n{out[-4000:]}"
    assert not NOTHING.search(out), f"{block} did nothing:\n{script}\n{out[-3000:]}"
    return done.stdout, done.stderr


def check_python_example(stdout: str, stderr: str, root: Path) -> None:
    """The README's notebook-sized script (build a model, train 8 steps, sample from the checkpoint)
    says what it did, in order, and triggers none of the trainer's warnings (a warm-up longer than its
    8 steps did)."""
    assert "warmup_steps" not in stderr and "WARNING" not in stdout + stderr, stderr[-3000:]
    lines = stdout.splitlines()
    assert "8 1024" in lines  # 8 steps of 4 x 32 tokens
    assert any(line.startswith("step 8/8 | done | 8 steps") for line in lines)
    assert stdout.index("\n20 tokens: ROMEO:") > stdout.index("| metrics |")  # sampled after the summary
    assert (root / "outputs" / "notebook_mhar" / "checkpoints" / "step-8").is_dir()



def run_in_order(readme: str, root: Path, warm: WarmPython | None = None) -> int:
    """Run the blocks of ``readme`` in ``root`` (a copy of the repository) as the module docstring
    says; AssertionError at the first block that fails, does nothing, or trains where it must not.
    Returns how many blocks ran."""
    quickstart: set[Path] = set()
    ran = 0
    for block in readme_blocks(readme):
        if block.kind not in {"run", "quickstart"}:
            continue
        script = quickstart_script(block, readme) if block.kind == "quickstart" else block.text
        before = run_folders(root)
        started = time.monotonic()
        stdout, stderr = run_block(block, script, root, warm)
        if block.info == "python" and "run_training(" in block.text:
            check_python_example(stdout, stderr, root)
        for command in commands(block) if block.info == "bash" else []:
            toy = re.match(r"^OUT=(\S+) .*\bscripts/toy_midtrain\.sh$", command)
            if toy:  # the shrunk mid-training experiment did every stage
                check_the_toy_experiment(stdout, root / toy.group(1))
        print(f"{block}: {time.monotonic() - started:.0f} s")  # with -s: where the test's time goes
        ran += 1
        after = run_folders(root)
        advanced = {f for f, step in after.items() if step > before.get(f, -1)}
        if block.kind == "quickstart":
            assert advanced, f"{block}: the quickstart trained nothing"
            quickstart = advanced
            continue
        assert not advanced & quickstart, (f"{block} trains in the quickstart's run folder "
                                          f"{sorted(advanced & quickstart)}: give it its own --job.name")
        trains = [c for c in commands(block) if TRAINS.search(c) and not HELP.search(c)] if block.info == "bash" else []
        if block.info == "python" and "run_training(" in block.text:
            trains = ["run_training"]
        assert not trains or advanced, f"{block}: {trains[0]!r} logged no new step in any run folder"
        for command in trains:
            folder = train_folder(command, root)
            assert folder is None or folder in advanced, f"{block}: {command!r} logged no new step in {folder}"
    return ran


def git_status(root: Path) -> list[str]:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=root,
                          capture_output=True, text=True, check=True).stdout.splitlines()


def assert_nothing_changed_that_git_sees(root: Path) -> None:
    """Every file of the copy is as it was staged: nothing new or changed outside ignored paths."""
    stray = [line for line in git_status(root) if not line.startswith("A  ")]
    assert not stray, f"README commands wrote or changed files that git sees (write under outputs/): {stray[:20]}"


# ---------------------------------------------------------------------------------------------
# the doc test's verdicts, on small READMEs run in a small git repository (nothing trains)


@pytest.fixture
def small_repo(tmp_path) -> Path:
    """A git repository holding one tracked file, everything staged, with an (empty) virtual
    environment to activate and outputs/ ignored, as the doc test's copy is."""
    root = tmp_path / "repo"
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "activate").write_text("")
    (root / ".gitignore").write_text(".venv\noutputs/\n")
    (root / "tracked.txt").write_text("as committed\n")
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    return root


def readme_of(*blocks: str) -> str:
    return "# A README\n\n" + "\n\ntext\n\n".join(f"```bash\n{b}\n```" for b in blocks) + "\n"


def logs_a_step(run: str, step: int) -> str:
    """A block that logs ``step`` in run folder outputs/``run`` as a training would (and names train.py)."""
    return f"mkdir -p outputs/{run} && echo '{{\"step\": {step}}}' >> outputs/{run}/metrics.jsonl  # python train.py"


def test_the_doc_test_runs_every_block_in_order_and_passes_a_good_readme(small_repo):
    readme = readme_of("echo one > outputs_first.txt && rm outputs_first.txt", logs_a_step("a", 1), logs_a_step("a", 2))
    assert run_in_order(readme, small_repo) == 3
    assert_nothing_changed_that_git_sees(small_repo)


@pytest.mark.parametrize("block, message", [
    ("exit 3", r"README.md:\d+ \(bash, run\) exited 3"),
    ("false | cat", r"exited 1"),  # pipefail
    ("echo 'Nothing to do: the run finished at step 40'", r"did nothing"),
    ("echo 'nothing left to do' >&2", r"did nothing"),
    ("echo python train.py --config x.toml", r"logged no new step in any run folder"),
    (logs_a_step("a", 1), r"logged no new step"),  # the same step again: no new step
])
def test_the_doc_test_fails_a_block_that_exits_non_zero_does_nothing_or_trains_no_step(small_repo, block, message):
    readme = readme_of(logs_a_step("a", 1), block)
    with pytest.raises(AssertionError, match=message):
        run_in_order(readme, small_repo)


@pytest.mark.parametrize("block", ["echo changed > tracked.txt", "echo new > notes.txt", "rm tracked.txt"])
def test_the_doc_test_fails_a_readme_that_changes_what_git_sees(small_repo, block):
    assert run_in_order(readme_of(block), small_repo) == 1
    with pytest.raises(AssertionError, match="wrote or changed files that git sees"):
        assert_nothing_changed_that_git_sees(small_repo)


@pytest.mark.slow  # every example's training, analysis, evaluation, export, sweep: 14 and 25 min on 2 cores
# shared with other test runs (load average 3-7 and 7-9, 2026-12-04), most of it the trainings
@pytest.mark.lm_eval
@pytest.mark.skipif(not SAMPLE.exists(), reason="run `make train` (or `make setup`) first: no Shakespeare sample")
@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None or importlib.util.find_spec("matplotlib") is None,
                    reason="the README's evaluation and figures need `make setup`")
def test_the_readme_blocks_run_in_order_after_the_quickstart(tmp_path, warm_python):
    test_every_block_is_run_or_marked_and_the_readme_is_short()  # nothing runs unless every block is accounted for
    root = copy_of_the_repository(tmp_path / "clone")
    assert all(line.startswith("A  ") for line in git_status(root)), git_status(root)[:5]
    ran = run_in_order(README.read_text(), root, warm_python)
    assert ran >= 10, f"only {ran} README blocks ran"
    assert_nothing_changed_that_git_sees(root)

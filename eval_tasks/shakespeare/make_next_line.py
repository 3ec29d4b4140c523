"""Write next_line.jsonl, the examples of the ``shakespeare_next_line`` task (shakespeare_next_line.yaml).

    python eval_tasks/shakespeare/make_next_line.py data/shakespeare/validation-00000-of-00001.parquet

A multiple-choice task over the held-out works of the local Shakespeare sample (Julius Caesar and
Twelfth Night, never in a training shard; ``mhar_titan.data.prepare_shakespeare``): two consecutive
lines of a speech, then the line that follows among four, the three others drawn from elsewhere in
the same work. Lines are verse or prose lines of 20 to 80 characters; speaker names and stage
directions are not lines. Seeded: the same file on every run.
"""
import json
import pathlib
import random
import sys

import pyarrow.parquet as pq

EXAMPLES = 400
CHOICES = 4
SEED = 2026


def speeches(text: str) -> list[list[str]]:
    """The speeches of an act: runs of spoken lines between speaker headings and stage directions."""
    out, current = [], []
    for raw in text.splitlines():
        line = raw.strip()
        spoken = line and not line.startswith("[") and not (line.isupper() and line.endswith("."))
        if spoken:
            current.append(line)
        elif current:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


def main(path: str) -> None:
    rng = random.Random(SEED)
    works: dict[str, list[list[str]]] = {}
    for row in pq.read_table(path).to_pylist():
        works.setdefault(row["title"], []).extend(speeches(row["text"]))
    candidates = []  # (work, two context lines, next line)
    for title, speech_list in works.items():
        for speech in speech_list:
            for i in range(len(speech) - 2):
                window = speech[i:i + 3]
                if all(20 <= len(s) <= 80 for s in window):
                    candidates.append((title, window))
    rng.shuffle(candidates)
    lines = {t: sorted({s for sp in speeches_ for s in sp if 20 <= len(s) <= 80}) for t, speeches_ in works.items()}
    rows = []
    for title, (a, b, answer) in candidates[:EXAMPLES]:
        distractors = rng.sample([s for s in lines[title] if s not in (a, b, answer)], CHOICES - 1)
        choices = distractors + [answer]
        rng.shuffle(choices)
        rows.append({"context": f"{a}\n{b}", "choices": choices, "answer": choices.index(answer)})
    out = pathlib.Path(__file__).with_name("next_line.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} examples from {len(candidates)} candidate windows -> {out}")


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the checkout's package, installed or not
    from mhar_titan.cli_args import run_command

    run_command(main, sys.argv[1])

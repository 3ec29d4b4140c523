"""Evaluation: greedy generation equals the step-by-step argmax of the model's logits, seeded
sampling, the lm-eval adapter's log-likelihoods as sums of token log-probabilities (lm-eval
itself is not needed), and perplexity as the token-weighted cross-entropy."""
import io
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from helpers import tiny_model

from mhar_titan.data import DataConfig, build_tokenizer
from mhar_titan.eval.generation import choose_token, generate
from mhar_titan.eval.lm_eval_adapter import MharLM
from mhar_titan.eval.perplexity import evaluate_perplexity


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(DataConfig(tokenizer="gpt2"))


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, random_queries=True, residual="attn_res", routing_heads=4)


def logprobs(model, ids):
    """log p(ids[i] | ids[:i]) for i >= 1, from one forward."""
    with torch.no_grad():
        lp = F.log_softmax(model(torch.tensor([ids[:-1]])).float(), dim=-1)[0]
    return lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_greedy_generation_is_the_stepwise_argmax(model, tok):
    prompt = tok.encode("To be, or not")
    new = generate(model, prompt, 12, n_vocab=tok.n_vocab)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            logits = model(torch.tensor([ids]))[0, -1]
            ids.append(int(logits[:tok.n_vocab].argmax()))
    assert new.tolist() == ids[len(prompt):]
    assert generate(model, prompt, 12, n_vocab=tok.n_vocab).tolist() == new.tolist()  # deterministic
    batch = generate(model, torch.tensor([prompt, prompt]), 5, n_vocab=tok.n_vocab)
    assert batch.shape == (2, 5) and batch[0].tolist() == batch[1].tolist() == new[:5].tolist()


def test_sampling_is_seeded_and_top_k_one_is_greedy(model, tok):
    prompt = tok.encode("Friends")
    a = generate(model, prompt, 10, temperature=1.0, seed=5, n_vocab=tok.n_vocab)
    assert a.tolist() == generate(model, prompt, 10, temperature=1.0, seed=5, n_vocab=tok.n_vocab).tolist()
    assert a.tolist() != generate(model, prompt, 10, temperature=1.0, seed=6, n_vocab=tok.n_vocab).tolist()
    assert (generate(model, prompt, 10, temperature=0.7, top_k=1, seed=1, n_vocab=tok.n_vocab).tolist()
            == generate(model, prompt, 10, n_vocab=tok.n_vocab).tolist())
    assert int(a.max()) < tok.n_vocab  # padded embedding rows are never produced
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]])
    draws = {int(choose_token(logits, 1.0, top_k=2, generator=torch.Generator().manual_seed(s))) for s in range(40)}
    assert draws == {1, 2}
    for bad in (-1.0, float("nan"), float("inf")):  # nan and inf sampled garbage or raised deep in torch
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            choose_token(logits, bad)
    with pytest.raises(ValueError, match="top_p"):
        choose_token(logits, 1.0, top_p=float("nan"))
    with pytest.raises(ValueError, match="prompt"):
        generate(model, [], 3)


def test_adapter_loglikelihood_is_the_sum_of_token_logprobs(model, tok):
    lm = MharLM(model, tok, batch_size=2)
    requests = [("To be, or not to", " be"), ("The quality of mercy", " is not strained"),
                ("", "Hello world"), ("Once more unto the breach, ", "dear friends")]
    got = lm.loglikelihood(requests)
    for (context, continuation), (ll, greedy) in zip(requests, got):
        context_ids = tok.encode(context.rstrip(" ")) or [tok.eos_id]
        cont_ids = tok.encode(continuation if not context.endswith(" ") else " " + continuation)
        lp = logprobs(model, context_ids + cont_ids)[-len(cont_ids):]
        assert ll == pytest.approx(lp.sum().item(), rel=1e-5, abs=1e-5), (context, continuation)
        with torch.no_grad():
            ids = context_ids + cont_ids
            argmax = model(torch.tensor([ids[:-1]]))[0, -len(cont_ids):].argmax(-1)
        assert greedy is (argmax.tolist() == cont_ids)
    # the model's own greedy continuation (token by token) is greedy
    context_ids = tok.encode("Now is the winter")
    greedy_ids = generate(model, context_ids, 3).tolist()
    lm.encode_pair = lambda context, continuation: (context_ids, greedy_ids)
    assert lm.loglikelihood([("Now is the winter", "(tokens given above)")])[0][1] is True


def test_adapter_rolling_loglikelihood_windows(model, tok):
    text = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate."
    ids = [tok.eos_id] + tok.encode(text)
    full = MharLM(model, tok).loglikelihood_rolling([(text,)])[0]
    assert full == pytest.approx(logprobs(model, ids).sum().item(), rel=1e-5)
    # windows of 8 tokens: each target sees at most the 8 tokens before its window's end
    windowed = MharLM(model, tok, max_length=8).loglikelihood_rolling([(text,)])[0]
    expected = 0.0
    for begin in range(0, len(ids) - 1, 8):
        end = min(begin + 8, len(ids) - 1)
        first = max(0, end - 8)
        expected += logprobs(model, ids[first:end + 1])[-(end - begin):].sum().item()
    assert windowed == pytest.approx(expected, rel=1e-5)
    assert windowed != pytest.approx(full, rel=1e-4)  # truncated context really changes the number


def test_adapter_generate_until_stops_before_the_stop_string(model, tok):
    lm = MharLM(model, tok)
    context = "ROMEO:"
    text = tok.decode(generate(model, tok.encode(context), 8, n_vocab=tok.n_vocab).tolist())
    out = lm.generate_until([(context, {"until": [], "max_gen_toks": 8})])[0]
    assert out == text
    stop = text[3:5]
    cut = lm.generate_until([(context, {"until": [stop], "max_gen_toks": 8})])[0]
    assert cut == text[:text.index(stop)]


def test_adapter_refuses_a_continuation_longer_than_the_context_and_warns_once_for_a_cut_context(model, tok,
                                                                                                caplog):
    lm = MharLM(model, tok, max_length=8)
    long = " and tomorrow" * 5  # 10 tokens: more than max_length
    with pytest.raises(ValueError, match=r"continuation of 10 tokens does not fit the model's context of 8 tokens"):
        lm.loglikelihood([("Tomorrow,", long)])
    context = "Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace"
    with caplog.at_level("WARNING", logger="mhar_titan.eval.lm_eval_adapter"):
        (cut, _), (again, _) = lm.loglikelihood([(context, " from day"), (context + " from", " day")])
        lm.generate_until([(context, {"until": [], "max_gen_toks": 2})] * 2)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "the context loses its first tokens" in warned[0], warned
    assert "generate_until: a prompt of" in warned[1] and "exceeds max_length 8" in warned[1], warned
    # the cut context is scored on its last tokens (as lm-eval's hf model does)
    ids = (tok.encode(context) + tok.encode(" from day"))[-9:]
    assert cut == pytest.approx(logprobs(model, ids)[-2:].sum().item(), rel=1e-5, abs=1e-5)


def test_perplexity_is_the_token_weighted_cross_entropy(model):
    g = torch.Generator().manual_seed(0)
    x1, x2 = torch.randint(0, 50_000, (2, 10), generator=g), torch.randint(0, 50_000, (1, 6), generator=g)
    y1, y2 = torch.roll(x1, -1, 1), torch.roll(x2, -1, 1)
    y1[0, :4] = -100  # ignored labels do not count
    result = evaluate_perplexity(model, [(x1, y1), (x2, y2)])
    with torch.no_grad():
        total = sum(F.cross_entropy(model(x)[y != -100], y[y != -100], reduction="sum").item()
                    for x, y in ((x1, y1), (x2, y2)))
    assert result.tokens == 16 + 6
    assert result.loss == pytest.approx(total / 22, rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(total / 22), rel=1e-6)
    with pytest.raises(ValueError, match="no target tokens"):
        evaluate_perplexity(model, [(x2, torch.full_like(y2, -100))])


def test_progress_bar_is_silent_off_a_terminal_and_shows_rate_on_one(monkeypatch, capsys):
    """Off a terminal short work prints nothing (long work prints lines: tests/test_progress_logs.py)."""
    from mhar_titan.progress import progress

    bar = progress(range(3), desc="scoring", unit="batch")
    assert list(bar) == [0, 1, 2]
    assert capsys.readouterr().err == ""

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out, err = Terminal(), Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    bar = progress(range(3), desc="scoring", unit="batch")
    assert not bar.disable and list(bar) == [0, 1, 2]
    text = err.getvalue()  # count of total, rate (and ETA once known) on stderr, nothing on stdout
    assert "scoring" in text and "0/3" in text and "batch/s" in text and out.getvalue() == ""


def test_adapter_under_lm_eval_answers_its_instances(model, tok):
    """Only where lm-eval is installed: MharLM is its LM, registered, and answers Instances as tuples."""
    lm_eval_model = pytest.importorskip("lm_eval.api.model")
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    lm = MharLM(model, tok)
    assert isinstance(lm, lm_eval_model.LM) and get_model("mhar_titan") is MharLM and lm.device == torch.device("cpu")
    pair, text = ("To be, or not to", " be"), ("Hello world",)
    assert lm.loglikelihood([Instance("loglikelihood", {}, pair, 0)]) == lm.loglikelihood([pair])
    assert lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, text, 0)]) == lm.loglikelihood_rolling([text])
    gen = ("ROMEO:", {"until": ["\n"], "max_gen_toks": 4})
    assert lm.generate_until([Instance("generate_until", {}, gen, 0)]) == lm.generate_until([gen])


def test_reading_a_truncated_checkpoint_points_to_the_previous_step_with_the_readers_flag(tmp_path):
    """eval / generate / analysis read weights only: a truncated newest checkpoint names the
    previous complete one and ``--step N`` (their flag), not the trainer's checkpoint.load_step."""
    from mhar_titan.checkpoint import CheckpointError
    from mhar_titan.convert.dcp_io import save_model_dcp
    from mhar_titan.eval.load import load_run

    net = tiny_model(seed=1, residual="attn_res", routing_heads=2)
    folder = tmp_path / "run" / "checkpoints"
    for step in (2, 4):
        save_model_dcp(net, folder / f"step-{step}", step=step)
    shard = next((folder / "step-4").glob("*.distcp"))
    with open(shard, "r+b") as f:  # a real shard cut short, as `truncate -s` does
        f.truncate(shard.stat().st_size // 2)
    with pytest.raises(CheckpointError) as err:
        load_run(tmp_path / "run")
    message = str(err.value)
    assert str(folder / "step-4") in message and "cannot be read" in message
    assert f"pass {folder / 'step-2'} (or the run folder with --step 2)" in message
    assert "load_step" not in message and "\n" not in message
    loaded = load_run(tmp_path / "run", step=2)  # the way out the message gives
    assert loaded.step == 2
    assert all(torch.equal(a, b) for a, b in zip(loaded.model.state_dict().values(), net.state_dict().values()))


def test_a_run_folder_that_does_not_exist_lists_the_run_folders_beside_it(tmp_path):
    from mhar_titan.eval.load import load_run

    for name in ("mhar_a", "baseline_b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.toml").write_text("")
    (tmp_path / "not_a_run").mkdir()
    with pytest.raises(FileNotFoundError) as err:
        load_run(tmp_path / "debug_mhar")
    assert str(err.value) == (f"{tmp_path / 'debug_mhar'} does not exist; pass a run folder (<dump_folder>/<job.name>) "
                              f"or one of its checkpoints/step-N folders; run folders in {tmp_path}: baseline_b, mhar_a")
    with pytest.raises(FileNotFoundError, match=r"step-N folders$"):
        load_run(tmp_path / "nowhere" / "debug_mhar")


def test_few_examples_warns_of_every_task_below_the_minimum():
    from mhar_titan.eval.tasks import MIN_EXAMPLES, few_examples

    results = {"n-samples": {"small": {"original": 8, "effective": 8}, "limited": {"original": 400, "effective": 20},
                             "enough": {"original": 400, "effective": MIN_EXAMPLES}}}
    warnings = few_examples(results)
    assert [w.split()[0] for w in warnings] == ["small", "limited"]
    assert "scored 20 examples" in warnings[1] and "+/-0.22 (95%)" in warnings[1]
    assert few_examples({}) == []

"""KV-cache decoding equals decoding without it: next-token logits within 1e-5 (fp32) at every
step and the same greedy tokens, for every family (DenseFormer and MUDDFormer too: a token's
connection reads only its own depth history, so only attention is cached), granularity, routing
mode and layout and for grouped routing; batched prompts of different lengths (left padding) equal each row alone;
top-p, stop ids and stop strings; past max_seq_len the cached path re-runs the window."""
import pytest
import torch

from helpers import tiny_model

from mhar_titan.eval.generation import Decoding, choose_token, generate, generate_batch
from mhar_titan.models.kv_cache import KVCache

CASES = {
    "baseline": dict(residual="standard"),
    "attn_res H=1": dict(residual="attn_res", routing_heads=1),
    "mhar H=4": dict(residual="attn_res", routing_heads=4),
    "mhar H=4 no qk norm, untied": dict(residual="attn_res", routing_heads=4, qk_norm=False, tie_embeddings=False),
    "block H=4": dict(residual="attn_res", routing_heads=4, routing_granularity="block", routing_block_layers=2),
    "delta clean +null": dict(residual="attn_res", routing_heads=4, routing_mode="delta", routing_null_source=True),
    "delta block": dict(residual="attn_res", routing_heads=4, routing_mode="delta", routing_granularity="block",
                        routing_block_layers=2),
    "delta paper": dict(residual="attn_res", routing_heads=4, routing_mode="delta", routing_null_source=True,
                        routing_layout="paper", routing_eps=1e-6),
    "grouped g=3": dict(residual="attn_res", routing_heads=4, routing_group_size=3),
    "grouped auto, block": dict(residual="attn_res", routing_heads=2, routing_group_size="auto",
                                routing_granularity="block", routing_block_layers=2),
    "dense": dict(residual="dense"),
    "dense k=2 p=2": dict(residual="dense", dense_dilation=2, dense_period=2),
    "mudd": dict(residual="mudd"),
    "mudd plain": dict(residual="mudd", mudd_prepost_norm=False),
    "hyper": dict(residual="hyper"),
    "hyper static n=2": dict(residual="hyper", hyper_dynamic=False, hyper_rate=2),
    "mhc": dict(residual="mhc"),
    "mhc mean exit": dict(residual="mhc", mhc_exit="mean"),
}

PROMPTS = [[11, 400, 7, 201, 5, 33, 100], [42, 17], [300, 5, 6, 7]]


def routed_model(case: str):
    model = tiny_model(seed=2, random_queries=CASES[case]["residual"] != "standard", n_layers=4, vocab_size=512,
                       **CASES[case])
    if CASES[case]["residual"] == "attn_res" and model.routing.alpha is not None:
        with torch.no_grad():  # open the delta gates (0 at init) so routing changes the stream
            model.routing.alpha.uniform_(0.5, 1.5)
            if model.routing.null_source is not None:
                model.routing.null_source.normal_()
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_cached_logits_equal_the_full_forward_at_every_step(case):
    model = routed_model(case)
    cached = Decoding(model, PROMPTS, capacity=10)
    plain = Decoding(model, PROMPTS, use_cache=False)
    cache = cached.cache
    for step in range(6):
        with torch.no_grad():
            alone = torch.cat([model(torch.tensor([row]))[:, -1] for row in cached.rows])
        assert torch.allclose(cached.logits, alone, atol=1e-5, rtol=0), (case, step)
        assert torch.allclose(cached.logits, plain.logits, atol=1e-5, rtol=0), (case, step)
        greedy = cached.logits.argmax(-1)
        assert greedy.tolist() == plain.logits.argmax(-1).tolist()
        cached.append(greedy)
        plain.append(greedy)
    assert cached.cache is cache and cache.length == 7 + 6  # one prefill, then one slot per step
    greedy = generate_batch(model, PROMPTS, 6)
    assert greedy == [row[len(p):] for row, p in zip(plain.rows, PROMPTS)]
    assert greedy[1] == generate(model, PROMPTS[1], 6, use_cache=False).tolist()  # a row alone


def test_past_max_seq_len_the_cache_reruns_the_window():
    model = tiny_model(seed=1, random_queries=True, residual="attn_res", routing_heads=4, max_seq_len=12,
                       vocab_size=512)
    prompt = list(range(100, 109))  # 9 tokens; 10 new ones run past max_seq_len = 12
    cached = Decoding(model, [prompt, prompt[:3]], capacity=10)
    plain = Decoding(model, [prompt, prompt[:3]], use_cache=False)
    for _ in range(10):
        assert torch.allclose(cached.logits, plain.logits, atol=1e-5, rtol=0)
        nxt = cached.logits.argmax(-1)
        cached.append(nxt)
        plain.append(nxt)
    assert len(cached.rows[0]) == 19 and cached.cache.row_lengths().tolist()[0] == 12


def test_the_cache_rejects_slots_beyond_its_capacity_and_positions_beyond_max_seq_len():
    cache = KVCache(n_layers=1, pad=[0, 2], capacity=4, max_seq_len=8)
    assert cache.extend(torch.zeros(2, 3, dtype=torch.long)).tolist() == [[0, 1, 2], [0, 0, 0]]  # padding slots sit at position 0
    assert cache.row_lengths().tolist() == [3, 1]
    with pytest.raises(ValueError, match="4 slots"):
        cache.extend(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len=2"):
        KVCache(n_layers=1, pad=[0], capacity=4, max_seq_len=2).extend(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="pad"):
        KVCache(n_layers=1, pad=[4], capacity=4, max_seq_len=8)


def test_stop_ids_and_stop_strings_end_only_their_row():
    model = routed_model("mhar H=4")
    free = generate_batch(model, PROMPTS, 8)
    stop = free[1][2]
    stopped = generate_batch(model, PROMPTS, 8, stop_ids=[stop])
    assert stopped[1] == free[1][:free[1].index(stop) + 1]
    assert stopped[0] == (free[0] if stop not in free[0] else free[0][:free[0].index(stop) + 1])
    decode = lambda ids: " ".join(str(t) for t in ids)  # noqa: E731 - a toy detokenizer
    text = decode(free[2][:3])
    by_text = generate_batch(model, PROMPTS, 8, stop_strings=[text], decode=decode)
    assert by_text[2] == free[2][:3] and by_text[0] == free[0]
    with pytest.raises(ValueError, match="decode"):
        generate_batch(model, PROMPTS, 2, stop_strings=["x"])


def test_top_p_keeps_the_smallest_nucleus_and_sampling_matches_with_and_without_cache():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = {int(choose_token(logits, 1.0, top_p=0.75, generator=torch.Generator().manual_seed(s)))
             for s in range(60)}
    assert draws == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3: the first two tokens
    assert {int(choose_token(logits, 1.0, top_p=0.4, generator=torch.Generator().manual_seed(s)))
            for s in range(20)} == {0}
    with pytest.raises(ValueError, match="top_p"):
        choose_token(logits, 1.0, top_p=0.0)
    model = routed_model("delta clean +null")
    kwargs = dict(temperature=0.9, top_k=50, top_p=0.9, seed=4)
    assert generate_batch(model, PROMPTS, 8, **kwargs) == generate_batch(model, PROMPTS, 8, use_cache=False, **kwargs)


EOS = 3


@pytest.mark.parametrize("restart", [False, True], ids=["positions run on", "positions restart"])
@pytest.mark.parametrize("case", ["baseline", "mhar H=4", "dense", "mudd"])
def test_cached_decoding_respects_the_document_mask(case, restart):
    """Under attn_mask_type = "block_causal" the cache masks keys of earlier documents (prompts
    that hold an EOS, and an EOS appended while decoding), and with rope_per_document its
    positions restart after each EOS: the cached logits equal a full forward of each row alone
    (which builds the document mask from the whole row) at every step."""
    model = tiny_model(seed=2, random_queries=case != "baseline", n_layers=4, vocab_size=512,
                       attn_mask_type="block_causal", rope_per_document=restart, eos_id=EOS, **CASES[case])
    prompts = [[11, 400, EOS, 201, 5, 33, 100], [42, EOS], [300, 5, EOS, 7]]
    cached = Decoding(model, prompts, capacity=10)
    appended = [[9, 8, 7], [EOS, 6, 5], [4, EOS, EOS]]  # an EOS while decoding opens a new document
    for step in range(3):
        with torch.no_grad():
            alone = torch.cat([model(torch.tensor([row]))[:, -1] for row in cached.rows])
        assert torch.allclose(cached.logits, alone, atol=1e-5, rtol=0), (case, restart, step)
        cached.append([row[step] for row in appended])
    with torch.no_grad():
        causal = tiny_model(seed=2, random_queries=case != "baseline", n_layers=4, vocab_size=512, **CASES[case])
        assert not torch.allclose(Decoding(causal, prompts).logits, Decoding(model, prompts).logits, atol=1e-4)

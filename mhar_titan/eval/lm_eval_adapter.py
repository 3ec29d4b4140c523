"""Our checkpoints behind lm-eval's model interface (``lm_eval.api.model.LM``).

``MharLM`` answers the three request types of the EleutherAI evaluation harness:

* ``loglikelihood``: requests with ``args = (context, continuation)`` -> ``(log p(continuation |
  context), is_greedy)``: the sum of the continuation tokens' log-probabilities (nats) and
  whether every one of them is the argmax. An empty context is replaced by the eos token.
* ``loglikelihood_rolling``: ``args = (text,)`` -> log p(text) given only the eos token, scored
  in windows of ``max_length`` tokens: each window predicts the next up-to-``max_length`` tokens
  with as much preceding text as fits (no token is scored twice).
* ``generate_until``: ``args = (context, gen_kwargs)`` with lm-eval's keys ``until`` (str or
  list), ``max_gen_toks``, ``do_sample``, ``temperature``, ``top_k``, ``top_p`` -> the generated
  text, cut before the first stop string (decoding with the KV cache stops once one appears).

Tokenization: the context's trailing spaces move to the continuation; the pair is encoded as
one text and split after the context's own tokens, so the continuation tokens are the ones the
model would read after the context.

Inputs longer than ``max_length``: a context that does not fit beside its continuation, or a
prompt longer than ``max_length``, loses its first tokens, with one warning per run and kind (as
lm-eval's ``hf`` model warns); a continuation longer than ``max_length`` cannot be scored whole
and raises ValueError (lm-eval's ``hf`` model stops on it too).

lm-eval is optional: without it ``MharLM`` is a plain class with the same methods (the tests
use it that way); with it, ``MharLM`` subclasses ``LM`` and importing this module registers it
under the name ``mhar_titan``, so ``lm_eval.simple_evaluate(model="mhar_titan",
model_args="run=outputs/debug_mhar,device=cuda", tasks=[...])`` works after the import
(``python -m mhar_titan.eval lm-eval`` passes an ``MharLM`` instance directly).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from mhar_titan.eval.generation import generate_batch
from mhar_titan.models.args import family_name
from mhar_titan.progress import progress

logger = logging.getLogger(__name__)

try:  # optional dependency
    from lm_eval.api.model import LM as _Base
    from lm_eval.api.registry import register_model as _register
except ImportError:  # pragma: no cover - exercised when lm-eval is absent (CI)
    _Base = object
    _register = None


def _args(request: Any) -> tuple:
    """lm-eval ``Instance.args``, or a plain tuple."""
    return tuple(request.args) if hasattr(request, "args") else tuple(request)


class MharLM(_Base):
    """lm-eval adapter for a ``Transformer`` and its tokenizer.

    Args:
        model: the model (eval mode is set here).
        tokenizer: ``mhar_titan.data.Tokenizer`` (encode, decode, eos_id, n_vocab).
        batch_size: sequences per forward in the log-likelihood requests.
        max_length: longest model input in tokens (default: the model's ``max_seq_len``).
        source: what the model is, recorded by ``get_model_info`` in lm-eval's results (the
            command passes the run folder, checkpoint and step).
    """

    def __init__(self, model: torch.nn.Module, tokenizer, batch_size: int = 8, max_length: Optional[int] = None,
                 source: Optional[dict] = None):
        if _Base is not object:
            super().__init__()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size)
        self.max_length = int(max_length or model.args.max_seq_len)
        if self.max_length > model.args.max_seq_len:
            raise ValueError(f"max_length {self.max_length} exceeds the model's max_seq_len {model.args.max_seq_len}")
        self._device = next(model.parameters()).device
        self.source = dict(source or {})
        self._warned: set[str] = set()

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("%s (warned once per run)", message)

    def get_model_info(self) -> dict:
        """What lm-eval records in its results file's ``config``: ``source`` (run folder,
        checkpoint, step), the family (``models.args.family_name``), the model's arguments, its
        parameter count and dtype, the tokenizer and ``max_length``."""
        return {**self.source, "family": family_name(self.model.args), "tokenizer": self.tokenizer.name,
                "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
                "max_length": self.max_length, "model_arguments": dataclasses.asdict(self.model.args)}

    @property
    def device(self) -> torch.device:
        """Where the model's parameters are (lm-eval reads it)."""
        return self._device

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None) -> "MharLM":
        """lm-eval's ``--model_args``: ``run=DIR[,step=N][,device=cuda][,batch_size=8][,max_length=T]``."""
        from mhar_titan.eval.load import load_run

        kv = dict(item.split("=", 1) for item in arg_string.split(",") if item)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        if "run" not in kv:
            raise ValueError("model_args needs run=<run folder or step-N folder>")
        device = kv.get("device", extra.get("device", "cpu"))
        loaded = load_run(kv["run"], step=int(kv["step"]) if "step" in kv else None, device=device,
                          routing_kernel=kv.get("routing_kernel", "auto"))
        batch = kv.get("batch_size", extra.get("batch_size", 8))
        return cls(loaded.model, loaded.tokenizer, batch_size=int(batch) if str(batch).isdigit() else 8,
                   max_length=int(kv["max_length"]) if "max_length" in kv else None, source=loaded.source())

    # ------------------------------------------------------------------ tokens

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids); see the module docstring."""
        spaces = len(context) - len(context.rstrip(" "))
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        context_ids = self.tokenizer.encode(context) if context else []
        whole = self.tokenizer.encode(context + continuation)
        if whole[:len(context_ids)] != context_ids:  # a merge across the boundary: encode separately
            whole = context_ids + self.tokenizer.encode(continuation)
        if not context_ids:
            context_ids = [self.tokenizer.eos_id]
            return context_ids, whole
        return context_ids, whole[len(context_ids):]

    @torch.no_grad()
    def _score(self, pieces: Sequence[tuple[list[int], int]], desc: Optional[str] = None) -> list[tuple[float, bool]]:
        """For each (tokens, n): sum of log p of the last n tokens of ``tokens`` given the ones
        before, and whether each was the argmax. ``len(tokens) <= max_length + 1``. With ``desc``,
        the batches show progress under that label (`mhar_titan.progress`: a bar on a terminal, a
        line every few seconds in a log)."""
        out = []
        starts = range(0, len(pieces), self.batch_size)
        for start in (starts if desc is None else progress(starts, desc=desc, unit="batch")):
            chunk = pieces[start:start + self.batch_size]
            width = max(len(t) - 1 for t, _ in chunk)
            x = torch.zeros(len(chunk), width, dtype=torch.long)
            for i, (tokens, _) in enumerate(chunk):
                x[i, :len(tokens) - 1] = torch.tensor(tokens[:-1])
            logprobs = F.log_softmax(self.model(x.to(self.device)).float(), dim=-1)
            for i, (tokens, n) in enumerate(chunk):
                end = len(tokens) - 1  # right padding leaves the first `end` positions exact (causal)
                target = torch.tensor(tokens[-n:], device=self.device)
                rows = logprobs[i, end - n:end]
                out.append((float(rows.gather(-1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())))
        return out

    # ------------------------------------------------------------------ lm-eval interface

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), is_greedy)`` per request (nats, summed over tokens)."""
        pieces = []
        for request in requests:  # tokenization only: the progress is the scoring's
            context, continuation = _args(request)[:2]
            ctx, cont = self.encode_pair(context, continuation)
            if not cont:
                raise ValueError(f"empty continuation after tokenization in request {(context, continuation)!r}")
            if len(cont) > self.max_length:
                raise ValueError(f"a continuation of {len(cont)} tokens does not fit the model's context of "
                                 f"{self.max_length} tokens, so it cannot be scored whole (request "
                                 f"{(context[:40], continuation[:40])!r}...); evaluate at a longer max_length")
            if len(ctx) + len(cont) > self.max_length + 1:
                self._warn_once("context", f"loglikelihood: context ({len(ctx)} tokens) and continuation "
                                           f"({len(cont)}) exceed max_length {self.max_length}; the context loses "
                                           "its first tokens")
            tokens = (ctx + cont)[-(self.max_length + 1):]
            pieces.append((tokens, min(len(cont), len(tokens) - 1)))
        return self._score(pieces, desc="loglikelihood")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log p(text) per request (nats), given only the eos token, in windows of max_length."""
        results = []
        for request in progress(requests, desc="loglikelihood_rolling", unit="req"):
            (text,) = _args(request)[:1]
            seq = [self.tokenizer.eos_id] + self.tokenizer.encode(text)
            pieces = []
            for begin in range(0, len(seq) - 1, self.max_length):  # targets seq[begin+1 : end+1]
                end = min(begin + self.max_length, len(seq) - 1)
                first = max(0, end - self.max_length)
                pieces.append((seq[first:end + 1], end - begin))
            results.append(sum(ll for ll, _ in self._score(pieces)))
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Generated text per request, cut before the first ``until`` string."""
        outputs = []
        for request in progress(requests, desc="generate_until", unit="req"):
            context, kwargs = _args(request)[:2]
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            sample = kwargs.get("do_sample", False)
            temperature = float(kwargs.get("temperature", 1.0 if sample else 0.0)) if sample else 0.0
            prompt = self.tokenizer.encode(context) or [self.tokenizer.eos_id]
            if len(prompt) > self.max_length:
                self._warn_once("prompt", f"generate_until: a prompt of {len(prompt)} tokens exceeds max_length "
                                          f"{self.max_length}; it loses its first tokens")
                prompt = prompt[-self.max_length:]
            new = generate_batch(self.model, [prompt], int(kwargs.get("max_gen_toks", 256)), temperature=temperature,
                                 top_k=kwargs.get("top_k"), top_p=kwargs.get("top_p"), n_vocab=self.tokenizer.n_vocab,
                                 stop_ids=[self.tokenizer.eos_id], stop_strings=[s for s in until if s],
                                 decode=self.tokenizer.decode)[0]
            text = self.tokenizer.decode([t for t in new if t != self.tokenizer.eos_id])
            cuts = [text.index(s) for s in until if s and s in text]
            outputs.append(text[:min(cuts)] if cuts else text)
        return outputs


if _register is not None:  # pragma: no cover - needs lm-eval
    # lm-eval fills its model registry with its own models (hf, vllm, ...) only while the registry
    # is empty: register them first, or model="hf" would be unknown after this import.
    import lm_eval.models  # noqa: F401

    _register("mhar_titan")(MharLM)

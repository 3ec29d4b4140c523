"""Evaluation of trained checkpoints: loading, validation perplexity, generation, lm-eval.

==================  ===========================================================
``load``            ``load_run``: a run folder or ``step-N`` folder -> model + tokenizer
``perplexity``      ``evaluate_perplexity``: loss and perplexity on held-out batches
``generation``      ``generate``: greedy / temperature / top-k continuation
``lm_eval_adapter`` ``MharLM``: lm-eval's model interface (lm-eval optional)
==================  ===========================================================

Commands: ``python -m mhar_titan.eval perplexity RUN`` and ``python -m mhar_titan.eval lm-eval
RUN --tasks ...``; ``python -m mhar_titan.generate RUN`` prints a sample continuation.
"""

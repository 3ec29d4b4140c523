"""Look inside trained models and compare runs.

==============  =============================================================
``routing``     ``RoutingRecorder`` / ``routing_summary``: per-site mean routing weights, entropy,
                effective number of sources; ``routing_entropy`` (the trainer's metric)
``heatmap``     PNG heatmaps (one panel per routing head and the single-head view) + report
``mixing``      the mixing weights of DenseFormer (alpha) and MUDDFormer (mean dynamic weights per
                stream): ``MixRecorder``, ``mixing_summary``, their heatmap and report
``probe``       the query probe of MHAR_SPEC 3.3 (slice discrepancy vs random queries)
``compare``     loss curves against tokens, a tail-mean validation-loss table naming each run's arm, B - A for
                chosen pairs, the learned routing temperature
``plots``       the headless matplotlib set-up
==============  =============================================================

Command line: ``python -m mhar_titan.analysis {heatmap,probe,compare} ...`` (``--help``).
The figures need matplotlib (``pip install -e '.[analysis]'``); ``routing`` does not.
"""

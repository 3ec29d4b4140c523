"""Paired experiments: sweep files, their launcher and their results.

==============  =============================================================
``sweep``       a TOML sweep file -> ``Sweep`` with its ``Run`` list (families x grid x seeds),
                each family's arm and the pairs it asks about
``launch``      runs them one after another locally (resumable) or emits SLURM jobs
``results``     tail means, paired differences to the baseline and within pairs (mean, standard
                error over seeds), the plots (loss, learned routing temperature)
``schedule``    two arms schedule-matched: LR per step, tokens per step, data order
==============  =============================================================

Command line: ``python -m mhar_titan.experiments {list,run,slurm,results} SWEEP.toml`` (``--help``).
"""

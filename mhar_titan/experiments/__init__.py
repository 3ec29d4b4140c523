"""Paired experiments: sweep files, their launcher and their results.

==============  =============================================================
``sweep``       a TOML sweep file -> ``Sweep`` with its ``Run`` list (families x grid x seeds)
``launch``      runs them one after another locally (resumable) or emits SLURM jobs
``results``     tail means, paired differences (mean, standard error over seeds), the plot
==============  =============================================================

Command line: ``python -m mhar_titan.experiments {list,run,slurm,results} SWEEP.toml`` (``--help``).
"""

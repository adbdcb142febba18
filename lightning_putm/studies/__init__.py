"""Studies: sweeps run as Optuna studies, tuning on validation classes, and the analyses the docs use.

* :mod:`.sweep` — a sweep file read into points, and the metric names a study optimises;
* :mod:`.study` — :class:`~.study.Study`: the points as trials in an Optuna storage (SQLite or PostgreSQL),
  resumable and shareable between processes; each trial is one ``evaluate.py`` run given to it by the job;
* :mod:`.summary` and :mod:`.summary_report` — the summary table (paired 95% CIs, SimpleShot baseline), its
  files and figure;
* :mod:`.tune` — the tune job's selection rule and its test-classes report;
* ``compare_presets``, ``combine_tunes``, ``sensitivity_figure``, ``navigator_confidence``, ``table`` (with
  ``table_runs``, the run folders read and merged, and ``significance``, the paired t-test and Holm's correction)
  — analyses of finished runs behind ``python -m lightning_putm <command>``; ``reference`` imports someone
  else's code from a local checkout for the side-by-side benchmarks.

Layer: below the jobs, above evaluation. It may import ``evaluation``, ``methods``, ``data`` and the core; only
the jobs and ``python -m lightning_putm`` import it, and it imports no job (the study job hands
:meth:`~.study.Study.run` the function that runs one evaluation).
"""

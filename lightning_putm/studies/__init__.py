"""Studies: analyses of finished runs that the docs use (``python -m lightning_putm <command>``).

``compare_presets``, ``combine_tunes``, ``sensitivity_figure`` and ``navigator_confidence`` read the output
folders of ``evaluate.py`` and ``tune`` (or a feature file) and print tables and draw figures; ``reference``
imports someone else's code from a local checkout for the side-by-side benchmarks. This wing will also receive
the study and tune jobs (today ``jobs/study.py`` and ``jobs/tune.py``) later.

Layer: at the level of the jobs. It may import ``evaluation``, ``methods``, ``data``, ``config`` and the tune
job's selection rule; nothing below it imports it.
"""

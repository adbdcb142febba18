"""The jobs behind the commands, each thin: it reads its settings, calls its wing and reports.

* :mod:`.evaluate` — ``evaluate.py`` (wing: :mod:`lightning_putm.evaluation`);
* :mod:`.train` — ``train_backbone.py`` (wing: :mod:`lightning_putm.pretraining`);
* :mod:`.predict` — ``evaluate.py predict`` (wing: :mod:`lightning_putm.prediction`);
* :mod:`.study` and :mod:`.tune` — ``python -m lightning_putm study|tune`` (wing: :mod:`lightning_putm.studies`).

They are the top of the import graph: nothing in the package imports a job except ``__main__`` and the scripts.
"""

"""Predictions on a user's own images: labelled support folders and a query folder → one task → CSV files.

* :mod:`.images` — the folders read and checked, images read the way the checkpoint was trained, features;
* :mod:`.outputs` — the solved task: per-image probabilities, per-class counts, the console table;
* :mod:`.settings` — ``conf/predict.yaml`` + overrides, validated before anything is written.

``jobs/predict.py`` runs them (``evaluate.py predict``).
"""

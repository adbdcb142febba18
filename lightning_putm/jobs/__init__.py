"""The two jobs behind the scripts: ``train_backbone.py`` (:mod:`.train`) and ``evaluate.py`` (:mod:`.evaluate`).

They are the top of the import graph: the only modules that build Trainers with the few-shot callback.
"""

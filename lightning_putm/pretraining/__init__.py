"""Pretraining a backbone on a benchmark's base classes with S2M2 (Mangla et al., WACV 2020).

* :mod:`.module` — :class:`~.module.S2M2Module`, the LightningModule of the three stages;
* :mod:`.checkpoints` — atomic checkpoint writes, safe reads, and loading a backbone from a checkpoint;
* :mod:`.settings` — ``train_backbone.py``'s settings, read and checked before anything is created;
* :mod:`.stages` — the Trainer, logger and data of one stage; :mod:`.progress` — its console output.

``jobs/train.py`` runs the stages; nothing here imports a job.
"""

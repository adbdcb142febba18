"""Feature tables: the tensor-only file format, extraction from a backbone, and the cache keyed by what made them.

* :mod:`.files` — :class:`FeatureSet` and our safe, tensor-only file format (read with ``weights_only=True``);
* :mod:`.table` — rows scattered back to dataset order;
* :mod:`.extraction` — the Lightning modules that run a backbone over a split (``trainer.predict``);
* :mod:`.cache` — one cache file per (checkpoint content, data, split, transform).

The format's names are re-exported here: ``from lightning_putm.features import FeatureSet, load_features``.
"""

from lightning_putm.features.files import FeatureSet, feature_set_from_label_dict, load_features, save_features

__all__ = ["FeatureSet", "feature_set_from_label_dict", "load_features", "save_features"]

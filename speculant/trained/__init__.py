"""Trained drafters' networks and their trainers (DFlash, EAGLE-3, Medusa, MTP), the speculators
folder format and training data; the driver is the one loop of ``speculant.tools.trainer``, fed by
``speculant.tools.train`` (``speculant train``: a feature cache) or ``speculant.tools.train_batched``
(padded batches, the target's states on the fly)."""

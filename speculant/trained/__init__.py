"""Trained drafters' networks and their trainers (DFlash, EAGLE-3, Medusa), the speculators folder
format and training data; the drivers are ``speculant.tools.train`` (``speculant train``: a feature
cache) and ``speculant.tools.train_batched`` (padded batches, the target's states on the fly)."""

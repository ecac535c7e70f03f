"""Trained drafters' networks and their trainers (DFlash, EAGLE-3, Medusa), the speculators folder
format and training data; the driver of ``speculant train`` is ``speculant.tools.train``."""

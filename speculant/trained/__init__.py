"""Trained drafters: networks (DFlash), the speculators folder format, training data and the trainer."""

"""Analyses over a loaded model: settings, splits, decoders, superposition, the run of them all and saved
decoder files (layer 3)."""

"""Training pipeline for EAGLE-3 heads."""

"""Bundled demo scripts: a deterministic training job and a short urgent eval."""

"""Test helpers for kb_reindex: fakes that let tests exercise real clients over real I/O."""

"""Floor 1, the words: the typed values every floor speaks (plans, validation results, lifecycle, errors).
Imports nothing of kb_reindex outside this folder; only the standard library and pydantic/numpy types."""

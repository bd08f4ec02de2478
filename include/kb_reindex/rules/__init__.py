"""Floor 3, the decisions a step asks for: locks and fences, the freeze, the manifest and the structural checks,
the audit, the alias compare-and-swap, collection settings. May import `domain` and `services`."""

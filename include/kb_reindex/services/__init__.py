"""Floor 2, what talks to the outside: the Qdrant store, the state DB (`state/`), the embedders, the sources and
chunking, the settings and the runtime's `Deps`. May import `domain` and this folder, never a rule or a step."""

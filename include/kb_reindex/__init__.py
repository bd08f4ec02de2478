"""kb-reindex: blue-green reindexing of a RAG knowledge base in Qdrant.

The folders are the floors, each importing only its own folder and the ones below it: `domain` (the words),
`services` (Qdrant, the state DB, embedders, sources, settings), `rules`, `steps`, `run` (the one step sequence
the CLI and the DAGs share), and the edges: `cli`, `airflow`, `web`, and `reader` (the assistant's import).
`testing` holds our protocol test servers; the product never imports it.
"""

from __future__ import annotations

__version__ = "0.1.0"

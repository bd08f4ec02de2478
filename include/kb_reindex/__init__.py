"""kb-reindex: blue-green reindexing of a RAG knowledge base in Qdrant.

Steps live in their own modules (plan, build, validate, promote); `engine` chains them for the CLI and
the DAGs call the same functions task by task.
"""

from __future__ import annotations

__version__ = "0.1.0"

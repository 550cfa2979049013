"""How a model spec becomes a loaded model: the embedded default, GGUF, HF folders, hub, random weights."""

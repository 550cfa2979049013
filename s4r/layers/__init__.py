"""Cache layers, one storage kind per file: full, S4R low-rank (and its segments), quantized, evicting."""

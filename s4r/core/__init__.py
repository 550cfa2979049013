"""The S4R method as plain tensor functions: sampling, bases, bands, selection, latent attention, ratios."""

"""The transformers integration: the Cache object, the attention hook, chunked and layer-wise forward."""

"""Serving many long documents from one model: chat messages rendered into a prompt (`prompt`), the
byte-budgeted store of compressed document caches with spill to disk (`document_store`, `disk_index`),
independent copies of a cache per request (`forking`), the decoding loop (`generate`) and the engine that
ties them together behind one lock (`engine`). The HTTP server on top lives in `s4r_cli.server`."""

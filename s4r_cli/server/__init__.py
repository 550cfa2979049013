"""The OpenAI-compatible HTTP server of `s4r serve`: the app (`app`), request and response bodies
(`schemas`), errors as OpenAI-style JSON (`errors`), Prometheus text (`metrics`), the model worker
(`worker`). The serving library under it is `s4r.serving`."""

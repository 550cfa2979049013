"""A session: ingest documents, answer questions, save and load, memory and speed figures."""

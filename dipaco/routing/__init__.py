"""Routing: documents to paths, once per document, from their first tokens."""

"""Inference: a trained path as a Hugging Face model directory (manifest, streamed zip) and
the route endpoint that maps a text to its path (docs/design.md §6)."""

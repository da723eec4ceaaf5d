"""Inference engines behind one interface: generate answers, capture hidden states."""

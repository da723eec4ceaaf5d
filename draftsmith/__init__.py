"""draftsmith: train EAGLE-3 drafters for a target LLM and prove they will be accepted before deploying."""

__version__ = "0.1.0"

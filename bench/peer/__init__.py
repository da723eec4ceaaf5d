"""draftsmith's trainer against SpecForge 0.2.0 at equal data: `python -m bench.peer` (__main__.py), one
module per stage (install, convert, train, validate, vllm, diff, report). shim.py runs in SpecForge's side
environment, by path, and imports nothing from here."""
